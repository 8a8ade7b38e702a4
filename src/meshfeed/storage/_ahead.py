"""Download-ahead of the shard cache: background downloads in the caller's order, kept going
under a limit as room is freed (#29).

Under ``cache_limit`` a download-ahead never evicts a held entry, one downloaded ahead and not
read yet, or one read in the last seconds (:mod:`meshfeed.storage._layout`). One that finds no
room waits in this process's queue, in the order asked; every later download-ahead goes behind
it (one download at a time, from the queue's head; without a limit, ``prefetch_workers`` at
once). Each time room may have been freed (a reader read a file to its end:
:meth:`ShardCache.finished`; or the last hold of a file ended) the queue is tried again from
its head, one download after another, and stops at the first that still finds no room. So a
limited epoch keeps downloading ahead while it reads, as the shards read to their end leave
the cache, without evicting what will be read soon (no shard downloaded twice).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from meshfeed.storage._download import TooLargeForCache, Want, on_disk
from meshfeed.storage._fill import Fill

#: seconds between retries of the queue on a plain release (a file read to its end retries at
#: once): a released entry is evictable by a download-ahead only IN_USE seconds after its use
RETRY_PAUSE = 0.25


class Ahead(Fill):
    """The download-ahead half of :class:`~meshfeed.storage.ShardCache` (its per-process state
    is set by :meth:`_init_ahead`, from the cache's constructor and after a fork)."""

    prefetch_workers: int

    def _init_ahead(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        # URL -> what the job accepts as it: download-aheads waiting for room, in order
        # (None: its place is kept while its task learns what it must be)
        self._waiting: dict[str, Want | None] = {}
        # one drain of the queue at a time: two downloads in flight could book room out of
        # order (the later one first), where the limit has room for one
        self._drainers = threading.BoundedSemaphore(1)
        self._claimed: set[str] = set()  # being tried by a drain
        self._settled = threading.Condition(self._mutex)  # a claimed one was tried
        self._kicked = False  # room may have been freed since the running drain began
        self._full: set[str] = set()  # waiting ones counted in stats()["skipped_prefetch"]
        self._errors: dict[str, Exception] = {}  # failed downloads, for their futures
        self._last_full = 0.0  # when the queue last found no room

    def _ahead_pool(self) -> ThreadPoolExecutor:
        with self._mutex:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.prefetch_workers, thread_name_prefix="meshfeed-prefetch"
                )
            return self._pool

    def _queue(self, urls: list[str]) -> None:
        """Under a limit, keep the places of ``urls`` in the queue in the caller's order (their
        tasks run in any order)."""
        if self.cache_limit is not None:
            with self._mutex:
                for url in urls:
                    self._waiting.setdefault(url, None)

    def _prefetch_one(self, url: str, version: str | None = None) -> bool:
        try:
            want = self._want(url, version)
        except BaseException:
            with self._mutex:  # its kept place must not stop the queue
                if url in self._waiting and self._waiting[url] is None:
                    del self._waiting[url]
            raise
        if self.cache_limit is None:  # room for all: downloads in parallel, in any order
            return bool(self._try(url, want))
        with self._mutex:  # under a limit: in the caller's order, from the queue's head
            if self._waiting.get(url) is None:  # its kept place, or none
                self._waiting[url] = want
        self._drain(wait=True)
        deadline = time.monotonic() + self.lock_timeout
        with self._mutex:
            while url in self._claimed and time.monotonic() < deadline:  # another drain's
                self._settled.wait(timeout=deadline - time.monotonic())
            err = self._errors.pop(url, None)
            waits = url in self._waiting
        if err is not None:
            raise err
        return not waits and self._entry(url).read_meta() is not None

    def _try(self, url: str, want: Want) -> bool | None:
        """One download-ahead: True (cached), None (no room now), False (never fits)."""
        entry = self._entry(url)
        with on_disk(self.cache_dir, f"hold {url}"):
            lock = entry.open_lock()
        try:
            return True if self._acquire(entry, lock, want, demanded=False) else None
        except TooLargeForCache:
            self._count("skipped_prefetch")
            return False
        finally:
            lock.close()

    def _demanded(self, url: str) -> None:
        """A reader asks for ``url`` itself: it no longer waits to be downloaded ahead."""
        with self._mutex:
            self._waiting.pop(url, None)
            self._full.discard(url)

    def _released(self) -> None:
        """The last hold of a file ended: room may be freed soon, so the queue is tried again,
        at most every RETRY_PAUSE seconds (each try lists the cache)."""
        with self._mutex:
            due = bool(self._waiting) and time.monotonic() - self._last_full >= RETRY_PAUSE
        if due:
            self._kick()

    def _kick(self) -> None:
        """Try the queue again in the background."""
        with self._mutex:
            if not self._waiting:
                return
            self._kicked = True
        # a pool shut down (close) raises RuntimeError: nothing more to download
        with contextlib.suppress(RuntimeError):
            self._ahead_pool().submit(self._drain)

    def _drain(self, *, wait: bool = False) -> None:
        """Run the queue (one drain at a time: without ``wait``, one already running goes round
        once more instead; with it, it waits at most ``lock_timeout``)."""
        while True:
            if not self._drainers.acquire(timeout=self.lock_timeout if wait else 0):
                return
            try:
                with self._mutex:
                    self._kicked = False
                self._drain_queue()
            finally:
                self._drainers.release()
            with self._mutex:
                if not (self._kicked and self._waiting):
                    return

    def _drain_queue(self) -> None:
        """Download the waiting files in order until one finds no room (or none is left)."""
        while True:
            with self._mutex:
                head = next((h for h in self._waiting.items() if h[0] not in self._claimed), None)
                if head is None:
                    return
                url, want = head
                if want is None:  # its own task will come here once it knows what it must be
                    return
                self._claimed.add(url)
            error = None
            try:
                done = self._try(url, want)
            except Exception as e:  # for its future; a later local_path retries it
                done, error = False, e
            with self._mutex:
                self._claimed.discard(url)
                self._settled.notify_all()
                if done is None:
                    self._last_full = time.monotonic()
                    if url not in self._full:
                        self._full.add(url)
                        self._stats["skipped_prefetch"] += 1
                    return
                if self._waiting.get(url) is want:
                    del self._waiting[url]
                if url in self._full:
                    self._full.discard(url)
                    self._stats["resumed_prefetch"] += int(done)
                if error is not None:
                    if len(self._errors) > 64:  # nobody asked for these: bounded
                        self._errors.clear()
                    self._errors[url] = error
