"""One remote object read by ranges: aligned blocks fetched by ranged GETs, the last few kept in memory.

For a file too large for the node's disk (a 2 TB token corpus over a 200 GB cache) or read
only in part (a Parquet file's footer and a few row groups). :class:`RangedFile` splits the
object into blocks of ``block_size`` bytes; a read fetches the blocks it touches that are not
in memory, consecutive ones in one GET, separate ones concurrently, through
:meth:`ShardCache.open_range` (retried; counted in ``stats()["range_reads"]``; served from
the node's whole-file copy when one of the same version is cached). The last ``max_blocks``
blocks stay in memory (a per-process LRU), so reads that fall in one block cost one GET.

Cost: every miss moves a whole block. Shuffled small reads (training windows of a few KB over
a corpus far larger than ``block_size * max_blocks``) fetch about one block per read, every
epoch, where a whole-file download is one GET per file per node; read by ranges only what
cannot be cached whole, or keep ``block_size`` small for shuffled reads.

Identity: the object's version (size and ETag or version id, as :func:`version_of` gives it)
is asked once per process (on opening or unpickling, in a forked worker on its first read) and
compared with the version recorded when the file was first opened; a rewritten object is a
:class:`~meshfeed.errors.SourceError` naming it, as for whole files. A read that comes back
short (an object truncated since) is one too.
"""

from __future__ import annotations

import io
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshfeed.errors import SourceError
from meshfeed.storage._download import TooLargeForCache
from meshfeed.storage.urls import changed, remote_info

if TYPE_CHECKING:
    from meshfeed.storage.cache import ShardCache

__all__ = ["Ranged", "RangeReads", "RangedFile", "check_ranged", "local_or_ranged"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RangeReads:
    """How a file is read by ranges: ``block_size`` bytes per block (the unit of a GET and of
    the in-memory cache), ``max_blocks`` blocks kept per process (memory:
    ``block_size * max_blocks`` per process), ``concurrency`` GETs in flight for one read."""

    block_size: int = 4 << 20
    max_blocks: int = 32
    concurrency: int = 8

    def __post_init__(self) -> None:
        for name in ("block_size", "max_blocks", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int (got {name}={value!r})")


#: How a reader takes a remote file: ``None``, whole (cached) unless larger than ``cache_limit``;
#: ``True`` or a :class:`RangeReads`, by ranges (with those settings); ``False``, always whole.
Ranged = bool | RangeReads | None


def check_ranged(ranged: object) -> None:
    """Raise TypeError naming ``ranged`` unless it is a :data:`Ranged`."""
    if ranged is not None and not isinstance(ranged, (bool, RangeReads)):
        raise TypeError(
            f"ranged must be None (whole files unless larger than cache_limit), True, False or "
            f"a RangeReads(block_size=..., max_blocks=...) (got {ranged!r})"
        )


def local_or_ranged(
    url: str, cache: ShardCache, ranged: Ranged, *, version: str | None = None
) -> str | RangedFile:
    """``url`` as ``ranged`` says: the path of its whole cached copy (held, as
    :meth:`ShardCache.local_path`), or a :class:`RangedFile` (by request, or with ``ranged=None``
    where the file is larger than ``cache_limit``)."""
    check_ranged(ranged)
    if ranged is None or ranged is False:
        try:
            return cache.local_path(url, version=version)
        except TooLargeForCache:
            if ranged is False:
                raise
    reads = ranged if isinstance(ranged, RangeReads) else None
    return RangedFile(url, cache=cache, reads=reads, version=version)


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block numbers as ``[lo, hi)`` runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


class RangedFile:
    """The object at ``url`` read by blocks through ``cache`` (see the module docstring).

    ``version``: the version a job recorded (:attr:`version` of an earlier opening); another
    one is refused by name. Picklable: a worker process gets the settings and the version,
    checks it once, and keeps its own blocks.

    >>> f = RangedFile("s3://bucket/corpus.bin", cache=ShardCache("/tmp/c"))  # doctest: +SKIP
    >>> f.read_many([(0, 4096), (1 << 30, (1 << 30) + 4096)])  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        cache: ShardCache,
        reads: RangeReads | None = None,
        version: str | None = None,
    ) -> None:
        self.url = url
        self.cache = cache
        self.reads = reads or RangeReads()
        self.version = version
        self.size = 0
        self._pid = -1
        self._check_process()

    def _check_process(self) -> None:
        """In a new process (or on opening): ask the version once and start empty."""
        if self._pid == os.getpid():
            return
        info = remote_info(self.url, self.cache.storage_options, retry=self.cache.retry)
        if self.version is not None and info.version != self.version:
            raise changed(self.url, found=info.version, expected=self.version)
        self.version, self.size = info.version, info.size
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "cache": self.cache, "reads": self.reads, "version": self.version}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("url"), **state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"RangedFile({self.url!r}, size={self.size}, version={self.version!r})"

    def __str__(self) -> str:
        return self.url

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        """``f[a:b]``: those bytes, from a block in memory or else one GET of just them (for
        small probes that should not fetch a block)."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"a RangedFile takes a contiguous slice, e.g. f[0:4096] (got {key!r})")
        start, stop, _ = key.indices(self.size)
        stop = max(start, stop)
        bs = self.reads.block_size
        self._check_process()
        with self._lock:
            block = self._blocks.get(start // bs)
        if block is not None and stop <= (start // bs + 1) * bs:
            return block[start % bs : start % bs + stop - start]
        return self._get(start, stop)

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` (clipped to the object)."""
        return bytes(self.read_many([(start, stop)])[0])

    def read_many(self, spans: list[tuple[int, int]]) -> list[memoryview]:
        """The bytes of each ``[start, stop)`` span (clipped to the object), as read-only views.

        The blocks missing from memory are fetched once for all spans: a run of consecutive
        blocks in one GET, the runs ``concurrency`` at a time. A read needing more blocks than
        ``max_blocks`` is still served whole; only the last ``max_blocks`` stay.
        """
        self._check_process()
        bs, size = self.reads.block_size, self.size
        clipped = [(max(0, min(a, size)), max(0, min(b, size))) for a, b in spans]
        need = sorted({k for a, b in clipped if b > a for k in range(a // bs, (b - 1) // bs + 1)})
        blocks = self._blocks_of(need)
        out: list[memoryview] = []
        for a, b in clipped:
            if b <= a:
                out.append(memoryview(b""))
                continue
            first, last = a // bs, (b - 1) // bs
            span = range(first, last + 1)
            data = blocks[first] if first == last else b"".join(blocks[k] for k in span)
            out.append(memoryview(data)[a - first * bs : b - first * bs])
        return out

    def open(self) -> io.RawIOBase:
        """A seekable binary file object over this object (for pyarrow and other readers).

        Unbuffered: each read is the span asked for, served from blocks."""
        return _RawRanged(self)

    def close(self) -> None:
        """Drop the blocks in memory and stop this process's fetch threads."""
        if self._pid != os.getpid():
            return
        with self._lock:
            self._blocks.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    # -- fetching ----------------------------------------------------------------------------

    def _blocks_of(self, need: list[int]) -> dict[int, bytes]:
        with self._lock:
            got = {k: self._blocks[k] for k in need if k in self._blocks}
            for k in got:
                self._blocks.move_to_end(k)
        runs = _runs([k for k in need if k not in got])
        if len(runs) > 1:
            fetched = list(self._executor().map(self._get_run, runs))
        else:
            fetched = [self._get_run(run) for run in runs]
        bs = self.reads.block_size
        with self._lock:
            for (lo, hi), data in zip(runs, fetched, strict=True):
                for k in range(lo, hi):
                    got[k] = self._blocks[k] = data[(k - lo) * bs : (k - lo + 1) * bs]
            while len(self._blocks) > self.reads.max_blocks:
                self._blocks.popitem(last=False)
        return got

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.reads.concurrency, thread_name_prefix="meshfeed-ranged"
                )
            return self._pool

    def _get_run(self, run: tuple[int, int]) -> bytes:
        bs = self.reads.block_size
        return self._get(run[0] * bs, min(run[1] * bs, self.size))

    def _get(self, start: int, stop: int) -> bytes:
        if stop <= start:
            return b""
        try:
            data = self.cache.open_range(self.url, start, stop, version=self.version)
            error = None if len(data) == stop - start else f"{len(data)} bytes came back"
        except OSError as e:  # transient errors were retried: a range past the end, a 404
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            raise SourceError(
                f"cannot read bytes [{start}, {stop}) of {self.url} ({error}); it was "
                f"{self.size} bytes (version {self.version!r}) when opened, so it was truncated, "
                "rewritten or removed since: write objects under a new name, then reopen"
            )
        return data


class _RawRanged(io.RawIOBase):
    """A raw, seekable, read-only file over a :class:`RangedFile`."""

    def __init__(self, file: RangedFile) -> None:
        self._file = file
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._file.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset} in {self._file.url}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._file.read_many([(self._pos, self._pos + len(view))])[0]
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)
