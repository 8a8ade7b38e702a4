"""Getting a complete entry into the shard cache: locks, the identity check, the download and
room within the limit (see :mod:`meshfeed.storage.cache` for the protocol)."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from meshfeed.errors import SourceError
from meshfeed.storage._download import TooLargeForCache, Want, get_checked, on_disk, one_request
from meshfeed.storage._layout import Entry, book, checksum, held_bytes, held_read
from meshfeed.storage._lock import FileLock
from meshfeed.storage.retry import RetryPolicy
from meshfeed.storage.urls import RemoteInfo, changed, filesystem, is_url, remote_info, retried

#: The entries this process's caches hold shared, by lock file: each holding cache, and how it
#: lets go of what it holds between reads (the ``make_room`` its reader gave, or None). ``flock``
#: makes two caches of one process exclude each other like two processes, so a fill that needs
#: an entry another cache of this process holds asks that one to let go first (a reader that
#: was stopped early, or is between reads, lets go), and names the cause if it still waits.
_HOLDERS: dict[str, weakref.WeakKeyDictionary[Any, Callable[[], None] | None]] = {}
_HOLDERS_LOCK = threading.Lock()


def _forget_holders_in_child() -> None:
    """In a forked child: the parent's holds are not this process's."""
    global _HOLDERS_LOCK
    _HOLDERS.clear()
    _HOLDERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_holders_in_child)

#: Seconds a demanded download that finds no room waits for entries read to their end that a
#: reader still holds, before it evicts entries downloaded ahead and not read yet instead. A
#: stream lets go of a shard read to its end at once, or (read by it then) within its holds'
#: idle time (``IDLE``, 0.25 s, checked every ``IDLE / 4`` by their watcher:
#: :mod:`meshfeed.sources.streams.holds`), so well within this on a loaded machine; the pending
#: entry evicted in its place is the last downloaded ahead, which a worker lagging behind the
#: others reads next: it downloaded that shard twice in one epoch.
READ_GRACE = 1.0


class Fill:
    """The entry-filling half of :class:`~meshfeed.storage.ShardCache` (its settings and
    per-process state are set by the cache's constructor)."""

    cache_dir: Path
    cache_limit: int | None
    storage_options: dict[str, Any]
    retry: RetryPolicy
    lock_timeout: float
    verify: str
    _mutex: threading.Lock
    _stats: dict[str, int]
    _verified: set[str]
    _held: dict[str, FileLock]
    _infos: dict[str, RemoteInfo]
    _expected: dict[str, Want]
    _entries: dict[str, Entry]
    _current: dict[str, str]
    _asked_at: dict[str, float]  # URL -> when its download-ahead was asked (time.time())

    # -- this process's holds -----------------------------------------------------------------

    def _holding(self, lock: FileLock, make_room: Callable[[], None] | None) -> None:
        """This cache now holds ``lock``'s entry shared (``make_room``: how it lets go)."""
        with _HOLDERS_LOCK:
            holders = _HOLDERS.setdefault(lock.path, weakref.WeakKeyDictionary())
            holders.setdefault(self, make_room)

    def _not_holding(self, lock: FileLock) -> None:
        with _HOLDERS_LOCK:
            holders = _HOLDERS.get(lock.path)
            if holders is not None:
                holders.pop(self, None)
                if not holders:
                    del _HOLDERS[lock.path]

    def _held_here(self, lock: FileLock) -> list[Callable[[], None] | None]:
        """How each other cache of this process that holds ``lock``'s entry lets go."""
        with _HOLDERS_LOCK:
            holders = _HOLDERS.get(lock.path)
            return [] if holders is None else [v for k, v in holders.items() if k is not self]

    def _ask_holders_here(self, lock: FileLock) -> None:
        """Ask the other caches of this process that hold ``lock``'s entry to let go of what
        they hold and do not read now (their readers' ``make_room``)."""
        for let_go in self._held_here(lock):
            if let_go is not None:
                let_go()

    # -- entries ------------------------------------------------------------------------------

    def _entry(self, url: str) -> Entry:
        # kept per URL (one per file of the job): a reader asks for its shards every read
        entry = self._entries.get(url)
        if entry is None:
            if not is_url(url):
                raise ValueError(f"{url!r} is not a URL; local files need no cache")
            entry = self._entries[url] = Entry.of(self.cache_dir, url, self.storage_options)
        return entry

    def _read_meta(self, entry: Entry, *, deep: bool) -> dict[str, Any] | None:
        """The sidecar of a complete entry; with ``deep``, its checksum checked once here."""
        meta = entry.read_meta()
        if meta is not None and deep and entry.url not in self._verified:
            recorded = str(meta.get("checksum", ""))
            if checksum(entry.data, md5=recorded.startswith("md5:")) != recorded:
                return None
            self._verified.add(entry.url)
        return meta

    def _expect(self, url: str, meta: dict[str, Any], want: Want) -> None:
        if want.version is not None and meta["version"] != want.version:
            raise changed(url, found=meta["version"], expected=want.version, cached=True)
        if not want.fits(meta):
            raise SourceError(
                f"{url}: this process holds a cached copy with {meta.get('checksum')}, but the "
                f"job expects {want.digest}; the dataset was rewritten while this job ran: "
                "start a new run"
            )

    def identify(self, url: str) -> RemoteInfo | None:
        """The job's identity check of ``url``: the version the bucket holds, asked once per
        job (one metadata request, remembered; the answer travels to worker processes, which
        then get None here: they ask nothing)."""
        if url in self._current:
            with self._mutex:
                return self._infos.get(url)

        def head() -> RemoteInfo:
            self._count("heads")
            return remote_info(url, self.storage_options, retry=None)

        info = retried(self.retry, head, url, "stat", self.storage_options, self._on_retry)
        with self._mutex:
            self._infos[url] = info
        self._current[url] = info.version
        return info

    def remember(self, infos: Iterable[RemoteInfo]) -> None:
        """What a listing said about objects (size, version, MD5): a download of one of them
        at that version then needs no metadata request first."""
        with self._mutex:
            self._infos.update((info.url, info) for info in infos)

    def _want(self, url: str, version: str | None) -> Want:
        """What this job accepts as ``url``: the given version, the registered digest, or
        the version the bucket holds now (the identity check)."""
        if version is not None:
            return Want(version)
        expected = self._expected.get(url)
        if expected is not None:
            return expected
        if url not in self._current:
            self.identify(url)
        return Want(self._current[url])

    def _touch(self, entry: Entry, *, demanded: bool = True, until_finished: bool = False) -> None:
        # the sidecar's mtime is the entry's last use (LRU); a download-ahead, or a reader
        # that will tell finished(), marks it pending (not to be evicted by a download-ahead
        # before it is read to its end), unless it was read to its end since the
        # download-ahead was asked
        if demanded:
            entry.mark(pending=False, until_read=until_finished)
        else:
            with self._mutex:
                asked = self._asked_at.get(entry.url)
            entry.mark(pending=True, asked=asked)

    def _acquire(
        self,
        entry: Entry,
        lock: FileLock,
        want: Want,
        *,
        demanded: bool,
        make_room: Callable[[], None] | None = None,
        on_booked: Callable[[], None] | None = None,
        until_finished: bool = False,
    ) -> bool:
        """Take the shared lock of a complete entry, downloading it first if needed.

        False only for a download-ahead (``demanded=False``) that found no room. Before any
        wait (for another process's download, or for room), ``make_room`` releases what the
        caller holds: a reader that waits holding entries could wait for itself.
        ``on_booked``: called once room for a download is booked, before its transfer.
        ``until_finished``: see :meth:`ShardCache.local_path`.
        """
        make_room = _once(make_room)
        deadline = time.monotonic() + self.lock_timeout
        deep = self.verify == "checksum"
        what = f"caching {entry.url}"
        fetched = False
        for _ in range(8):  # a concurrent eviction between our two locks sends us round again
            if not lock.try_acquire(exclusive=False):
                make_room()
                lock.acquire(exclusive=False, deadline=deadline, what=what)
                self._count("waits")
            meta = self._read_meta(entry, deep=deep)
            ready = meta is not None and want.fits(meta)
            if not ready:  # ready after all where another process cached it meanwhile
                lock.release()
                ready = self._exclusive_or_ready(entry, lock, want, deadline, what, make_room)
            if ready:  # held shared
                if not fetched:
                    self._count("hits")
                self._touch(entry, demanded=demanded, until_finished=until_finished)
                return True
            meta = self._read_meta(entry, deep=deep)
            if meta is None or not want.fits(meta):
                # missing, or a copy of another version of the object: once nobody holds it
                # (this exclusive lock), it is replaced by the version the caller expects (a
                # bucket that no longer holds that version is refused by name in _download)
                with on_disk(self.cache_dir, f"store {entry.url}"):
                    entry.clean()
                    done = self._download(
                        entry, want, demanded=demanded, make_room=make_room, on_booked=on_booked
                    )
                if not done:
                    lock.release()
                    return False
                fetched = True
            lock.acquire(exclusive=False, deadline=deadline, what=what)  # downgrade
        raise SourceError(
            f"{entry.url} kept disappearing from {self.cache_dir} while being cached (evicted "
            "by other processes each time); raise cache_limit well above the largest file"
        )

    def _exclusive_or_ready(
        self,
        entry: Entry,
        lock: FileLock,
        want: Want,
        deadline: float,
        what: str,
        make_room: Callable[[], None],
    ) -> bool:
        """Take ``entry``'s exclusive lock (False), or find it complete meanwhile and hold it
        shared (True). Waiting for the exclusive lock alone could wait forever: the process
        that downloads the entry keeps a shared hold on it while it reads."""

        def attempt() -> bool | None:
            if lock.try_acquire(exclusive=True):
                return False
            if lock.try_acquire(exclusive=False):
                meta = self._read_meta(entry, deep=self.verify == "checksum")
                if meta is not None and want.fits(meta):
                    return True
                lock.release()
            make_room()  # about to wait for another process's download
            self._ask_holders_here(lock)  # or for another reader of this process
            return None

        try:
            ready, waited = lock.wait_for(attempt, deadline, what)
        except SourceError as exc:
            if not self._held_here(lock):
                raise
            raise SourceError(
                f"{entry.url}: waited {self.lock_timeout:g} s for its entry in the shard cache "
                f"at {self.cache_dir}, which another reader of this same process holds (a "
                "stream, loader or ShardCache over this URL that is still open: e.g. stopped "
                "early with break, and not closed), while this one needs another version of "
                "the file (it was rewritten since); close the earlier reader first "
                "(ShardedStream.close(), ShardCache.close()), or give this one another cache_dir"
            ) from exc
        if waited:
            self._count("waits")
        return ready

    # -- download and eviction ----------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._mutex:
            self._stats[key] += n

    def _on_retry(self, _: BaseException) -> None:
        self._count("retries")

    def _download(
        self,
        entry: Entry,
        want: Want,
        *,
        demanded: bool,
        make_room: Callable[[], None] | None = None,
        on_booked: Callable[[], None] | None = None,
    ) -> bool:
        """Under the entry's exclusive lock: book room, fetch, check and publish ``entry.url``
        (``on_booked`` is told once the room is booked)."""
        url = entry.url
        fs, path = filesystem(url, self.storage_options)
        with self._mutex:
            info = None if want.known else self._infos.get(url)
        if info is not None and info.version != want.version:
            info = None

        def head() -> RemoteInfo:
            self._count("heads")
            found = remote_info(url, self.storage_options, retry=None)
            if want.version is not None and found.version != want.version:
                raise changed(url, found=found.version, expected=want.version)
            return found

        if info is None and not want.known:
            info = retried(self.retry, head, url, "stat", self.storage_options, self._on_retry)
        size = int(want.size if info is None else info.size)  # type: ignore[arg-type]
        if self.cache_limit is not None and size > self.cache_limit:
            raise TooLargeForCache(url, size, self.cache_limit)  # a download-ahead skips it
        reserved = self._reserve(entry, size, demanded=demanded, make_room=make_room)
        if reserved is None:  # a download-ahead that found no room (it waits: _ahead)
            return False
        if on_booked is not None:
            on_booked()
        entry.data.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.temp()
        kwargs = one_request(fs)
        vouch = entry.read_vouch() if want.known else None

        def get() -> dict[str, Any]:
            nonlocal info
            self._count("gets")
            try:
                return get_checked(fs, path, tmp, url, info, want, vouch, **kwargs)
            except ConnectionError:
                if info is not None:  # the object may have changed: ask again next time
                    info = head()
                raise

        try:
            meta = retried(self.retry, get, url, "download", self.storage_options, self._on_retry)
            entry.publish(tmp, meta)
            if "etag" in meta and not meta.get("vouched"):
                entry.write_vouch(meta)
        finally:
            tmp.unlink(missing_ok=True)
            reserved.unlink(missing_ok=True)
        self._verified.add(url)
        self._count("downloads")
        self._count("vouched", int(bool(meta.get("vouched"))))
        self._count("bytes", int(meta["size"]))
        return True

    def _reserve(
        self, entry: Entry, size: int, *, demanded: bool, make_room: Callable[[], None] | None
    ) -> Path | None:
        """Book ``size`` bytes within the limit (None: a download-ahead found no room).

        A demanded file first asks its caller to release what it holds (``make_room``), then
        waits for other processes' readers to release theirs, at most ``lock_timeout``. It
        evicts entries idle or read to their end first, and waits for those read to their end
        that other readers still hold at most ``READ_GRACE``, before it evicts the entries
        downloaded ahead and not read yet (:mod:`meshfeed.storage._layout`).
        """
        deadline = time.monotonic() + self.lock_timeout
        #: First only entries idle or read to their end; ``grace``: until when to wait for
        #: those other readers hold (set at the first wait).
        read_first, grace = demanded and self.cache_limit is not None, None
        pause = 0.005
        while True:
            booked, evicted = book(
                self.cache_dir,
                entry,
                size,
                limit=self.cache_limit,
                deadline=deadline,
                demanded=demanded and not read_first,
            )
            self._count("evictions", evicted)
            if booked is not None or not demanded:
                return booked
            if make_room is not None:
                make_room()
                make_room = None
                continue
            if read_first:
                now = time.monotonic()
                grace = min(now + READ_GRACE, deadline) if grace is None else grace
                if now >= grace or not held_read(self.cache_dir, entry):
                    read_first, pause = False, 0.005  # now entries downloaded ahead too
                    continue
                self._count("waits")
                time.sleep(pause)
                pause = min(pause * 1.5, 0.05)
                continue
            with self._mutex:
                mine = [self._entry(u) for u in self._held]
            mine_bytes = sum(int((e.read_meta() or {}).get("size", 0)) for e in mine)
            if mine_bytes + size > int(self.cache_limit or 0):
                raise SourceError(
                    f"no room in the shard cache at {self.cache_dir} for {entry.url} ({size} "
                    f"bytes) within cache_limit={self.cache_limit}: this reader itself holds "
                    f"{len(mine)} files ({mine_bytes} bytes); release some first "
                    "(ShardCache.release), or raise cache_limit"
                )
            if time.monotonic() >= deadline:
                raise SourceError(
                    f"no room in the shard cache at {self.cache_dir} for {entry.url} ({size} "
                    f"bytes) within cache_limit={self.cache_limit} after {self.lock_timeout:g} s: "
                    f"readers of this node hold {held_bytes(self.cache_dir)} bytes of it; raise "
                    "cache_limit (to at least the largest shard times the readers sharing the "
                    "cache), or use fewer readers per node"
                )
            self._count("waits")
            time.sleep(pause)
            pause = min(pause * 1.5, 0.1)


def _once(fn: Callable[[], None] | None) -> Callable[[], None]:
    """``fn`` callable any number of times, run the first time only (None: nothing)."""
    done = fn is None

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()  # type: ignore[misc]

    return call
