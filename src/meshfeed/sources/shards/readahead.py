"""Read-ahead of shard files into the page cache, in the stream's order (#29): :class:`ReadAhead`.

A shard is read through its memory map, and the first touch of a page that is not cached is a
page fault: the reading thread stops, holding the GIL, while the kernel reads around that page.
A shuffle window's first batch touches every shard of the window, so without read-ahead the
reader stalls there, one fault after another, for the whole window, with one read in flight.

The stream tells its reader which shards its order reads next (``plan``). When the reader opens
one of them, the next ``ahead_bytes`` of planned shards are brought into the page cache by
background threads, several files at once, each with one ``madvise(MADV_POPULATE_READ)`` over
the pages ``mincore`` reports missing: the kernel reads them in large requests, nothing is
copied, and the GIL is free meanwhile. The opening thread then waits (GIL free, at most
``wait_s``) until its own shard is cached, or populates it itself if no thread has started on
it. Values stay zero-copy views of the reader's own map, so nothing read here is ever served
and a file changed under the reader is still refused by the reader's checks. A dataset already
in the page cache costs one ``mincore`` per shard and reads nothing. Where the kernel lacks
``MADV_POPULATE_READ`` (Linux < 5.14, other systems), nothing is read ahead: the faults read.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ReadAhead", "populate", "uncached_runs"]

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # <linux/mman.h>, Linux 5.14+ (the mmap module does not export it)


def _libc() -> tuple[Any, Any] | None:
    """``(mincore, madvise)`` of the C library, called through ctypes (which lets go of the
    GIL); None off Linux, where ``MADV_POPULATE_READ`` does not exist."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        mincore, madvise = libc.mincore, libc.madvise
    except (OSError, AttributeError, TypeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.restype = madvise.restype = ctypes.c_int
    return mincore, madvise


_LIBC = _libc()
#: Set when the kernel refused MADV_POPULATE_READ: read-ahead stops asking.
_UNSUPPORTED = threading.Event()


def uncached_runs(address: int, size: int) -> list[tuple[int, int]]:
    """The byte ranges of the ``size`` mapped bytes at page-aligned ``address`` whose pages are
    NOT in the page cache, as ``(start, stop)`` offsets in order (all of it where unknown)."""
    if size <= 0:
        return []
    vec = np.zeros((size + _PAGE - 1) // _PAGE, np.uint8)
    if _LIBC is None or _LIBC[0](address, size, vec.ctypes.data) != 0:
        return [(0, size)]
    flags = np.concatenate([[0], (vec & 1) == 0, [0]]).astype(np.int8)
    edges = (np.flatnonzero(np.diff(flags)) * _PAGE).tolist()
    return [(a, min(b, size)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def populate(path: str) -> int:
    """Bring the file at ``path`` into the page cache (the pages not there yet) and return
    the bytes asked of the kernel; 0 where it cannot (no ``MADV_POPULATE_READ``; a file gone
    or empty: its reader reports that). Blocks until the pages are read, without the GIL."""
    if _LIBC is None or _UNSUPPORTED.is_set():
        return 0
    with contextlib.suppress(OSError, ValueError):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 0
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        try:
            view = np.frombuffer(m, np.uint8)
            base = view.ctypes.data
            del view  # the map closes below only once no view exports it
            asked = 0
            for a, b in uncached_runs(base, size):
                a -= a % _PAGE
                if _LIBC[1](base + a, b - a, _MADV_POPULATE_READ) != 0:
                    if ctypes.get_errno() == errno.EINVAL:  # a kernel before 5.14
                        _UNSUPPORTED.set()
                    break  # or EFAULT: the file shrank meanwhile
                asked += b - a
            return asked
        finally:
            m.close()
    return 0


class ReadAhead:
    """Brings the planned shard files into the page cache ahead of the reader, ``threads``
    files at a time (threads made on first need, in the process that reads).

    ``plan(shards)`` records the order the stream reads them in and starts on the first ones;
    ``opened(shard)``, from the reader as it opens ``shard``, starts on the planned shards from
    it on up to ``ahead_bytes`` (``size(shard)``: its bytes) and returns once ``shard`` is
    cached (at most ``wait_s`` seconds: past that, its faults read what is missing). A shard
    not in the plan (a reader used without a stream, or in a worker process, which gets no
    plan) returns at once: its faults read it, as without read-ahead. A process forked from
    the one that planned starts with no plan."""

    def __init__(
        self,
        size: Callable[[str], int],
        *,
        ahead_bytes: int = 64 << 20,
        threads: int = 4,
        wait_s: float = 30.0,
    ) -> None:
        if ahead_bytes < 0 or threads < 1 or wait_s <= 0:
            raise ValueError(
                "ahead_bytes must be >= 0, threads >= 1 and wait_s > 0 (got "
                f"{ahead_bytes=}, {threads=}, {wait_s=})"
            )
        self.size, self.ahead_bytes, self.threads, self.wait_s = size, ahead_bytes, threads, wait_s
        self._fresh()

    def _fresh(self) -> None:
        self._pid = os.getpid()
        self._order: list[str] = []
        self._at: dict[str, int] = {}
        self._reads: dict[str, cf.Future[int]] = {}
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _check_fork(self) -> None:
        # A forked worker inherits this object without its threads (reads it waited for would
        # never finish) and maybe with the lock held: it starts empty, with no plan (the plan
        # is its parent's, which reads ahead for it: the page cache is shared).
        if self._pid != os.getpid():
            self._fresh()

    @property
    def enabled(self) -> bool:
        """Whether this system can read ahead (Linux with ``MADV_POPULATE_READ``) and
        ``ahead_bytes`` asks it to."""
        return _LIBC is not None and not _UNSUPPORTED.is_set() and self.ahead_bytes > 0

    def plan(self, shards: list[str]) -> None:
        """The stream reads ``shards`` next, in this order: start on the first ones."""
        if not self.enabled:
            return
        self._check_fork()
        with self._lock:
            self._order = list(shards)
            self._at = {s: i for i, s in enumerate(self._order)}
            # a new plan looks at its shards again: the page cache may have dropped them
            self._reads = {s: r for s, r in self._reads.items() if not r.done()}
        if shards:
            self._start(0)

    def opened(self, shard: str) -> None:
        """The reader opens ``shard``: start on the planned shards from it on, and return
        once ``shard`` is in the page cache."""
        self._check_fork()
        i = self._at.get(shard)
        if i is None:
            return
        self._start(i)
        read = self._reads.get(shard)
        if read is None or read.done():
            return
        if read.cancel():  # still queued behind others: read it in this thread, now
            populate(shard)
        else:
            cf.wait([read], timeout=self.wait_s)

    def _start(self, first: int) -> None:
        with self._lock:
            todo, budget, order = [], self.ahead_bytes, self._order
            for k in range(first, len(order)):  # not a slice: a plan can hold 10,000 shards
                if budget <= 0:
                    break
                budget -= self.size(order[k])
                if order[k] not in self._reads:
                    todo.append(order[k])
            if not todo:
                return
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.threads, "meshfeed-readahead")
            for s in todo:
                self._reads[s] = self._pool.submit(populate, s)

    def close(self) -> None:
        """Stop the threads: reads under way finish, queued ones are dropped."""
        self._check_fork()
        with self._lock:
            pool, self._pool = self._pool, None
            self._reads.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
