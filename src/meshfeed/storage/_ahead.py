"""Download-ahead of the shard cache: background downloads in the caller's order, kept going
under a limit as room is freed (#29).

Under ``cache_limit`` a download-ahead never evicts a held entry, one downloaded ahead and not
read yet, or one read in the last seconds (:mod:`meshfeed.storage._layout`). One that finds no
room waits in this process's queue, in the order asked; every later download-ahead goes behind
it. Room is booked from the queue's head, one file after another (a later file booked first
could take the room of an earlier one, read sooner), and each booked file is transferred in the
background, ``prefetch_workers`` at once (without a limit, all are downloaded that many at once,
in any order). Each time room may have been freed (a reader read a file to its end:
:meth:`ShardCache.finished`; or the last hold of a file ended) the queue is tried again from its
head, and stops at the first that still finds no room. A queue that finds no room while
entries read to their end are left, held by readers (a worker process of the node reads a
shard a moment after this process was told it was read; its release is not heard here), is
tried again every ``RETRY_PAUSE`` seconds for ``READ_GRACE`` seconds after a file was read to
its end or asked ahead. So a limited epoch keeps downloading ahead while it reads, as the
shards read to their end leave the cache, without evicting what will be read soon (no shard
downloaded twice).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from meshfeed.storage._download import TooLargeForCache, Want, on_disk
from meshfeed.storage._fill import READ_GRACE, Fill
from meshfeed.storage._layout import held_read

#: seconds between retries of the queue on a plain release (a file read to its end retries at
#: once): a released entry is evictable by a download-ahead only IN_USE seconds after its use
RETRY_PAUSE = 0.25


class Ahead(Fill):
    """The download-ahead half of :class:`~meshfeed.storage.ShardCache` (its per-process state
    is set by :meth:`_init_ahead`, from the cache's constructor and after a fork)."""

    prefetch_workers: int

    def _init_ahead(self) -> None:
        # by name, made on first use: "prefetch" runs the download-ahead tasks; under a limit,
        # "transfer" the transfers of booked download-aheads, prefetch_workers at once (a pool
        # of their own: the drain that books them may run in a "prefetch" thread)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._slots = threading.BoundedSemaphore(self.prefetch_workers)
        # URL -> what the job accepts as it: download-aheads waiting for room, in order
        # (None: its place is kept while its task learns what it must be)
        self._waiting: dict[str, Want | None] = {}
        # one drain of the queue at a time: two downloads in flight could book room out of
        # order (the later one first), where the limit has room for one
        self._drainers = threading.BoundedSemaphore(1)
        self._claimed: set[str] = set()  # being tried by a drain
        self._settled = threading.Condition(self._mutex)  # a claimed one was tried
        self._kicked = False  # room may have been freed since the running drain began
        self._scheduled = False  # a drain is submitted and has not started yet
        self._full: set[str] = set()  # waiting ones counted in stats()["skipped_prefetch"]
        self._errors: dict[str, Exception] = {}  # failed downloads, for their futures
        self._last_full = 0.0  # when the queue last found no room
        self._asked_at: dict[str, float] = {}  # URL -> when last asked ahead (time.time())
        # until when (time.monotonic()) a queue that finds no room while entries read to their
        # end are held is tried again, and the timer of that retry
        self._held_until = 0.0
        self._held_timer: threading.Timer | None = None

    def _pool(self, name: str) -> ThreadPoolExecutor:
        """The pool of the ``meshfeed-{name}`` threads (made on first use)."""
        with self._mutex:
            if name not in self._pools:
                self._pools[name] = ThreadPoolExecutor(
                    self.prefetch_workers, thread_name_prefix=f"meshfeed-{name}"
                )
            return self._pools[name]

    def _stop_ahead(self) -> None:
        """Stop the download-ahead threads (waiting for the transfers in flight)."""
        with self._mutex:
            pools, self._pools = self._pools, {}
            self._waiting.clear()
            timer, self._held_timer = self._held_timer, None
        if timer is not None:
            timer.cancel()
        for pool in pools.values():  # "prefetch" first: it is made first
            pool.shutdown(wait=True, cancel_futures=True)

    def _queue(self, urls: list[str]) -> None:
        """Under a limit, keep the places of ``urls`` in the queue in the caller's order (their
        tasks run in any order)."""
        if self.cache_limit is not None:
            with self._mutex:
                for url in urls:
                    self._waiting.setdefault(url, None)
                self._held_until = time.monotonic() + READ_GRACE

    def _prefetch_one(self, url: str, version: str | None, asked: float) -> bool:
        """Download ``url`` ahead (``asked``: when the caller asked, ``time.monotonic()``)."""
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
            # its place is gone where a reader asked for it (or read it to its end) since the
            # call: put back by a late task, it was downloaded a second time once room freed
            gone = url not in self._waiting
            if not gone and self._waiting[url] is None:  # its kept place
                self._waiting[url] = want
            # a head that found no room since the call asked is tried again when room is
            # freed: the tasks of one prefetch call would each try it at once
            head = next((h for h in self._waiting if h not in self._claimed), None)
            stuck = head in self._full and self._last_full >= asked
        if gone:
            return self._entry(url).read_meta() is not None
        if not stuck:
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

    def _try(
        self, url: str, want: Want, on_booked: Callable[[], None] | None = None
    ) -> bool | None:
        """One download-ahead: True (cached), None (no room now), False (never fits)."""
        entry = self._entry(url)
        with on_disk(self.cache_dir, f"hold {url}"):
            lock = entry.open_lock()
        try:
            ok = self._acquire(entry, lock, want, demanded=False, on_booked=on_booked)
            return True if ok else None
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

    def _kick(self, *, read: bool = False) -> None:
        """Try the queue again in the background (one drain submitted at a time: a reader
        releases a file per batch, and a backlog of drains would each list the cache).
        ``read``: a file was read to its end, which readers of other processes may hold a
        moment longer (a drain that finds it held is tried again: :meth:`_retry_held`)."""
        with self._mutex:
            if read:
                self._held_until = time.monotonic() + READ_GRACE
            if not self._waiting:
                return
            self._kicked = True
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._pool("prefetch").submit(self._kicked_drain)
        except RuntimeError:  # a pool shut down (close): nothing more to download
            with self._mutex:
                self._scheduled = False

    def _kicked_drain(self) -> None:
        with self._mutex:
            self._scheduled = False
        self._drain()

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
        """Book room for the waiting files in order until one finds no room (or none is left);
        each booked file is transferred in the background (``prefetch_workers`` at once)."""
        while True:
            with self._mutex:
                head = next((h for h in self._waiting.items() if h[0] not in self._claimed), None)
                if head is None:
                    return
                url, want = head
                if want is None:  # its own task will come here once it knows what it must be
                    return
                self._claimed.add(url)
            tried, full = threading.Event(), threading.Event()
            started = self._slots.acquire(timeout=self.lock_timeout)
            with self._mutex:  # a reader may have asked for it while this waited for a slot
                if started and self._waiting.get(url) is not want:
                    self._slots.release()
                    self._claimed.discard(url)
                    self._settled.notify_all()
                    continue
            try:
                if started:
                    self._pool("transfer").submit(self._transfer, url, want, tried, full)
            except RuntimeError:  # the pool was shut down (close)
                self._slots.release()
                started = False
            if not started:  # every slot still busy: it keeps its place, tried again later
                with self._mutex:
                    self._claimed.discard(url)
                    self._settled.notify_all()
                return
            # its room booked (the transfer goes on), or its try over (no room: stop here);
            # a try that waits longer (another process's download of it) goes on alone
            tried.wait(timeout=self.lock_timeout)
            if full.is_set():
                self._retry_held(url)
                return
            if not tried.is_set():
                return

    def _retry_held(self, url: str) -> None:
        """``url``, the queue's head, found no room: where entries read to their end are left
        (held: a worker process that read a shard lets go of it within its holds' idle time,
        and that release kicks no queue of this process), try the queue again RETRY_PAUSE
        seconds later, until READ_GRACE after a file was last read to its end or asked ahead."""
        with self._mutex:
            if self._held_timer is not None or time.monotonic() >= self._held_until:
                return
        if not held_read(self.cache_dir, self._entry(url)):
            return
        timer = threading.Timer(RETRY_PAUSE, self._held_retried)
        timer.daemon = True
        with self._mutex:
            if self._held_timer is not None or not self._pools:  # one at a time; or closed
                return
            self._held_timer = timer
        timer.start()

    def _held_retried(self) -> None:
        with self._mutex:
            self._held_timer = None
        self._kick()

    def _transfer(
        self, url: str, want: Want, tried: threading.Event, full: threading.Event
    ) -> None:
        """One download-ahead from the queue's head, in a transfer thread: ``tried`` is set
        once its room is booked or its try is over, ``full`` where it found no room."""
        done: bool | None = False
        error = None
        try:
            done = self._try(url, want, on_booked=tried.set)
        except Exception as e:  # for its future; a later local_path retries it
            error = e
        finally:
            self._slots.release()
            if self._settle(url, want, done, error):
                full.set()
            tried.set()

    def _settle(self, url: str, want: Want, done: bool | None, error: Exception | None) -> bool:
        """Record the outcome of one try of ``url`` from the queue; True where it found no
        room (it keeps its place in the queue)."""
        with self._mutex:
            self._claimed.discard(url)
            self._settled.notify_all()
            if done is None:
                self._last_full = time.monotonic()
                if url not in self._full:
                    self._full.add(url)
                    self._stats["skipped_prefetch"] += 1
                return True
            if self._waiting.get(url) is want:
                del self._waiting[url]
            if url in self._full:
                self._full.discard(url)
                self._stats["resumed_prefetch"] += int(bool(done))
            if error is not None:
                if len(self._errors) > 64:  # nobody asked for these: bounded
                    self._errors.clear()
                self._errors[url] = error
        return False
