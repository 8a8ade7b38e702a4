"""The node-local shard cache: each remote file downloads once per node, atomically, within a limit.

The protocol, for every process of the node that shares ``cache_dir`` (files: see
:mod:`meshfeed.storage._layout`):

- A download runs under the entry's exclusive lock (``flock``): a temporary file in the same
  folder, its size checked against the server's (and its MD5 against a single-part ETag),
  fsynced, renamed, then the sidecar; a process killed at any point leaves no valid entry, only
  a temporary file that the next writer (or a new ``ShardCache``) removes. The others wait for
  the lock (at most ``lock_timeout``) and then reuse the entry.
- A reader holds the entry's shared lock from :meth:`ShardCache.local_path` until
  :meth:`ShardCache.release` (or :meth:`ShardCache.close`, or its death); eviction takes the
  exclusive lock without waiting, so a held entry is never evicted.
- ``cache_limit`` is a limit: every download first books its size (under a lock for the whole
  cache), evicting unheld entries (sidecar first) to make room: those read to their end least
  recently used first, then those downloaded ahead, or being read by a stream, and not read
  to their end yet, then those read in the last seconds (:mod:`meshfeed.storage._layout`). A
  download-ahead evicts only the first kind (it never evicts what will be read soon, so a
  limited epoch downloads each shard once where the limit holds the shards read at once); one that finds no room waits, in order, until a
  reader frees some (:meth:`ShardCache.finished`; :mod:`meshfeed.storage._ahead`); a
  demanded file asks its caller to release
  what it holds (``make_room``) and then waits for other processes' readers to release theirs
  (at most ``lock_timeout``, then an error that says how much the held entries take). So the
  files of the cache never take more than the limit (plus the one file being renamed into
  place). A file larger than ``cache_limit`` itself is never downloaded:
  :class:`TooLargeForCache` names it (a download-ahead skips it); the token corpus and
  Parquet readers then read it by ranges.
- Each cached file is checked against its source once per job: against an index's size and
  content hash where the caller registered them (:meth:`ShardCache.expect`: no metadata request
  at all, the bytes hashed once as they enter the cache), else against the object's version
  asked once per job (one metadata request; a cached copy of another version is replaced).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

from meshfeed.errors import SourceError
from meshfeed.storage._ahead import Ahead
from meshfeed.storage._download import (
    CacheDiskError,
    TooLargeForCache,
    Want,
    check_writable,
    on_disk,
)
from meshfeed.storage._layout import Entry, checksums, sweep
from meshfeed.storage._lock import FileLock
from meshfeed.storage.retry import RetryPolicy
from meshfeed.storage.urls import (
    RemoteInfo,
    StorageOptions,
    filesystem,
    is_url,
    local_path_of,
    remote_info,
    retried,
)

__all__ = ["CacheDiskError", "ShardCache", "TooLargeForCache", "default_cache_dir", "resolve"]


def default_cache_dir() -> str:
    """``$MESHFEED_CACHE_DIR``, else ``~/.cache/meshfeed/shards``."""
    env = os.environ.get("MESHFEED_CACHE_DIR")
    return env or os.path.join(os.path.expanduser("~"), ".cache", "meshfeed", "shards")


class ShardCache(Ahead):
    """Local copies of remote files, shared by every process of a node through ``cache_dir``.

    ``local_path(url)`` returns a local path to the complete file, downloading it first if no
    process of the node has (one download however many processes ask at once: the others wait
    for it, at most ``lock_timeout`` seconds). The entry stays held (never evicted) until as
    many ``release(url)`` calls, or ``close()``. ``cache_limit`` bounds the bytes kept (None:
    no bound).
    ``verify="checksum"`` re-hashes an entry this object did not download on its first use
    (a full read); the default trusts a published entry's size. Transient network failures
    are retried for ``retry_timeout`` seconds, then :class:`~meshfeed.errors.SourceError`
    names the URL. The object pickles as its settings (worker processes get their own).

    >>> cache = ShardCache("/tmp/shards", cache_limit=20 << 30)  # doctest: +SKIP
    >>> path = cache.local_path("s3://bucket/corpus.idx")  # doctest: +SKIP
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        cache_limit: int | None = None,
        storage_options: StorageOptions | None = None,
        retry_timeout: float = 60.0,
        lock_timeout: float = 600.0,
        prefetch_workers: int = 2,
        verify: Literal["size", "checksum"] = "size",
    ) -> None:
        if cache_limit is not None and (
            isinstance(cache_limit, bool) or not isinstance(cache_limit, int) or cache_limit < 1
        ):
            raise ValueError(
                f"cache_limit must be a positive number of bytes or None (got {cache_limit=})"
            )
        if verify not in ("size", "checksum"):
            raise ValueError(f"verify must be 'size' or 'checksum' (got {verify=!r})")
        if not isinstance(prefetch_workers, int) or prefetch_workers < 1:
            raise ValueError(f"prefetch_workers must be a positive int (got {prefetch_workers=})")
        if lock_timeout <= 0:
            raise ValueError(f"lock_timeout must be positive seconds (got {lock_timeout=})")
        self.cache_dir = Path(cache_dir if cache_dir is not None else default_cache_dir())
        self.cache_limit = cache_limit
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.retry = RetryPolicy(timeout=retry_timeout)
        self.lock_timeout = float(lock_timeout)
        self.prefetch_workers = prefetch_workers
        self.verify = verify
        check_writable(self.cache_dir)
        # what this job checked or was told about its files (travels to worker processes)
        self._expected: dict[str, Want] = {}
        self._current: dict[str, str] = {}  # URL -> the version the bucket holds, asked once
        self._init_process_state()
        with on_disk(self.cache_dir, "remove stale temporary files"):
            sweep(self.cache_dir)

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._held: dict[str, FileLock] = {}  # one shared lock per held URL
        self._holds: Counter[str] = Counter()  # local_path calls not yet released, per URL
        self._verified: set[str] = set()
        self._infos: dict[str, RemoteInfo] = {}  # the identity check's answers, for the download
        self._entries: dict[str, Entry] = {}
        self._init_ahead()
        self._stats = dict.fromkeys(
            ("downloads", "vouched", "hits", "bytes", "gets", "heads", "range_reads", "retries",
             "evictions", "waits", "skipped_prefetch", "resumed_prefetch"),
            0,
        )  # fmt: skip

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # a forked child: the parent's locks and threads are not ours
            # (the fork's handler already closed this child's copies of the parent's lock
            # descriptors, each once: meshfeed.storage._lock)
            self._init_process_state()

    # -- pickling: settings only ------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {
            "cache_dir": str(self.cache_dir),
            "cache_limit": self.cache_limit,
            "storage_options": self.storage_options,
            "retry_timeout": self.retry.timeout,
            "lock_timeout": self.lock_timeout,
            "prefetch_workers": self.prefetch_workers,
            "verify": self.verify,
            "expected": self._expected,
            "current": self._current,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        expected, current = state.pop("expected", {}), state.pop("current", {})
        self.__init__(state.pop("cache_dir"), **state)  # type: ignore[misc]
        self._expected, self._current = dict(expected), dict(current)

    def __repr__(self) -> str:
        return f"ShardCache({str(self.cache_dir)!r}, cache_limit={self.cache_limit})"

    # -- public API --------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters of this process: downloads, hits, bytes downloaded, GET requests (``gets``,
        ranged ones included), metadata requests (``heads``), ``range_reads``, ``retries``,
        ``evictions``, ``waits`` (times another process held an entry we wanted),
        ``skipped_prefetch`` (download-aheads that found no room, or a file larger than the
        limit) and ``resumed_prefetch`` (of those, downloaded ahead later, once room was
        freed)."""
        with self._mutex:
            return dict(self._stats)

    def entry_path(self, url: str) -> str:
        """Where ``url`` is (or would be) cached; it is only safe to read via :meth:`local_path`."""
        return str(self._entry(url).data)

    def local_path(
        self,
        url: str,
        *,
        version: str | None = None,
        make_room: Callable[[], None] | None = None,
        until_finished: bool = False,
    ) -> str:
        """A local path to the complete file at ``url``, held until :meth:`release`.

        The file is checked against its source once per job: ``version`` (from
        :func:`version_of`, e.g. stored in a checkpoint) where given, else the size and
        digest registered by :meth:`expect`, else the version the bucket holds, asked once per
        job; a cached copy of another version is replaced, and a bucket that holds another
        ``version`` raises :class:`SourceError` naming the URL. ``make_room``: called (once)
        when the cache is full of held entries, to release what the caller holds; then the
        call waits for other processes to release theirs (at most ``lock_timeout``).
        ``until_finished``: the caller reads the file over many reads and calls
        :meth:`finished` once it has read it to its end (as a stream does); until then (at
        most ``PENDING`` seconds) no download-ahead evicts it, however long it goes unread
        and unheld between reads. A ``file://`` URL returns its path uncached.
        """
        self._check_fork()
        local = local_path_of(url)
        if local is not None:
            return local
        entry = self._entry(url)
        want = self._want(url, version)
        self._demanded(url)
        with self._mutex:
            held = url in self._held
        if held:  # our shared lock keeps the entry: no eviction can have removed it
            meta = self._read_meta(entry, deep=False)
            if meta is not None:
                self._expect(url, meta, want)
                with self._mutex:
                    self._holds[url] += 1
                self._count("hits")
                self._touch(entry, until_finished=until_finished)
                return str(entry.data)
        with on_disk(self.cache_dir, f"hold {url}"):
            lock = entry.open_lock()
        try:
            self._acquire(
                entry, lock, want, demanded=True, make_room=make_room, until_finished=until_finished
            )
        except BaseException as e:
            lock.close()
            gone = _unfetchable(url, e)
            if gone is None:
                raise
            raise gone from e
        with self._mutex:
            old = self._held.pop(url, None)
            self._held[url] = lock
            self._holds[url] += 1
        if old is not None:
            old.close()
        self._holding(lock, make_room)
        return str(entry.data)

    def expect(self, url: str, *, digest: str, size: int) -> None:
        """The file at ``url`` is ``size`` bytes with content ``digest`` (``"blake2b:HEX"``,
        blake2b-128 of the bytes, as a dataset index records it): its copy is checked against
        them as it enters the cache (a mismatch names the URL), and no metadata request is
        made for it. The expectations travel with the cache to worker processes."""
        if not digest.startswith("blake2b:") or isinstance(size, bool) or size < 0:
            raise ValueError(
                f"expect takes digest='blake2b:HEX' and a size in bytes (got {digest=}, {size=})"
            )
        self._expected[url] = Want(digest=digest, size=int(size))

    def release(self, url: str) -> None:
        """End one hold of ``url`` (one :meth:`local_path` call); after the last, its entry may
        be evicted again."""
        self._check_fork()
        with self._mutex:
            self._holds[url] -= 1
            if self._holds[url] > 0:
                return
            del self._holds[url]
            lock = self._held.pop(url, None)
        if lock is not None:
            self._not_holding(lock)
            lock.close()
        self._released()

    def finished(self, url: str) -> None:
        """The caller read ``url`` to its end and will not read it again soon: its entry is
        evicted first once nobody holds it, and the download-aheads waiting for room
        (:meth:`prefetch`) are tried again at once."""
        self._check_fork()
        if local_path_of(url) is not None:
            return
        self._demanded(url)
        self._entry(url).mark_read()
        self._kick(read=True)

    @contextlib.contextmanager
    def hold(self, url: str, *, version: str | None = None) -> Iterator[str]:
        """``with cache.hold(url) as path:`` — :meth:`local_path`, released on exit."""
        path = self.local_path(url, version=version)
        try:
            yield path
        finally:
            self.release(url)

    def prefetch(
        self, urls: Iterable[str], *, versions: Mapping[str, str] | None = None
    ) -> list[Future[bool]]:
        """Download ``urls`` ahead in background threads; each future says if the file is cached.

        Bounded by ``cache_limit``: a file that finds no room without evicting a held entry,
        one downloaded ahead and unread or one read in the last seconds is not downloaded now
        (its future gives False, ``stats()["skipped_prefetch"]`` counts it); it waits in this
        process's queue, in the order asked (later ones go behind it), and is downloaded as
        room is freed (:meth:`finished`, or the last :meth:`release` of a file), unless a
        reader asks for it first. A file larger than the limit is skipped. Errors land in the
        futures; a later :meth:`local_path` retries them.
        """
        self._check_fork()
        pool = self._pool("prefetch")
        todo = [url for url in urls if local_path_of(url) is None]
        now = time.time()
        with self._mutex:
            if len(self._asked_at) > 4096:  # bounded: an endless stream of URLs
                self._asked_at.clear()
            self._asked_at.update(dict.fromkeys(todo, now))
        self._queue(todo)
        known, asked = versions or {}, time.monotonic()
        return [pool.submit(self._prefetch_one, url, known.get(url), asked) for url in todo]

    def open_range(self, url: str, start: int, stop: int, *, version: str | None = None) -> bytes:
        """Bytes ``[start, stop)`` of ``url``: from the cached copy if there is one (of
        ``version``, when given), else one ranged GET (retried), without downloading the whole
        file. The GET checks no version: the caller asks :func:`remote_info` once."""
        if isinstance(start, bool) or isinstance(stop, bool) or not 0 <= start <= stop:
            raise ValueError(f"need 0 <= start <= stop (got {start=}, {stop=}) to read {url}")
        self._check_fork()
        entry = self._entry(url)
        meta = self._read_meta(entry, deep=False)
        if meta is not None and Want(version).fits(meta):
            with contextlib.suppress(FileNotFoundError), open(entry.data, "rb") as f:
                # an eviction after open unlinks the name only; these bytes stay readable
                f.seek(start)
                data = f.read(stop - start)
                self._count("hits")
                return data
        fs, path = filesystem(url, self.storage_options)

        def get() -> bytes:
            self._count("gets")
            return bytes(fs.cat_file(path, start=start, end=stop))

        options = self.storage_options
        data = retried(self.retry, get, url, "read a range of", options, self._on_retry)
        self._count("range_reads")
        self._count("bytes", len(data))
        return data

    def adopt(self, url: str, local: str | os.PathLike[str]) -> str:
        """Make ``local``, a file just uploaded to ``url``, the cached copy of ``url``.

        The file is moved (a rename when it lies on the cache's file system), after its size
        and, for a single-part ETag, its MD5 are checked against the server's (one HEAD); the
        entry records its blake2b digest, as a dataset index does. So a writer that uploads a
        corpus leaves it cached for the readers of its node (no download). Returns the entry's
        path (not held).
        """
        self._check_fork()
        entry = self._entry(url)
        lock = entry.open_lock()
        try:
            lock.acquire(
                exclusive=True,
                deadline=time.monotonic() + self.lock_timeout,
                what=f"adopting {url}",
            )
            self._count("heads")
            info = remote_info(url, self.storage_options, retry=self.retry)
            self._current[url] = info.version
            # recorded as blake2b: readers of a dataset index expect that digest (an MD5
            # entry would not fit their expectation and be downloaded again)
            md5, digest = checksums(Path(local))
            size = os.path.getsize(local)
            if size != info.size or (info.md5 is not None and md5 != f"md5:{info.md5}"):
                raise SourceError(
                    f"{url} is not the file {os.fspath(local)} ({info.size} bytes there, {size} "
                    "here, or another MD5); upload it again before adopting it"
                )
            entry.clean()
            tmp = entry.temp()
            shutil.move(os.fspath(local), tmp)
            meta = {"url": url, "size": size, "version": info.version, "checksum": digest}
            entry.publish(tmp, meta)
        finally:
            lock.close()
        return str(entry.data)

    def close(self) -> None:
        """Release every held entry and stop the download-ahead threads."""
        with self._mutex:
            held, self._held = self._held, {}
            self._holds.clear()
        if os.getpid() != self._pid:
            return
        for lock in held.values():
            self._not_holding(lock)
            lock.close()
        self._stop_ahead()

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve(
    path_or_url: str | os.PathLike[str], *, cache: ShardCache | None, version: str | None = None
) -> str:
    """A local path for ``path_or_url``: a local path or ``file://`` URL as is, any other URL
    through ``cache`` (downloaded once per node, held until ``cache.release(url)``).

    ``version``: as in :meth:`ShardCache.local_path`. A URL without a cache raises ValueError.
    """
    p = os.fspath(path_or_url)
    if not is_url(p):
        return p
    local = local_path_of(p)
    if local is not None:
        return local
    if cache is None:
        raise ValueError(
            f"{p} is a URL, so it needs a local cache: pass cache=ShardCache(cache_dir=...) "
            "(or cache_dir= where the reader takes one)"
        )
    return cache.local_path(p, version=version)


#: Credential failures of object-store clients (botocore's), by class name: raised as they are,
#: they name neither the URL nor the fix.
_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError"})


def _unfetchable(url: str, exc: BaseException) -> SourceError | None:
    """A :class:`SourceError` naming ``url`` for a file the cache was asked for and could not
    fetch for good: missing or forbidden in the bucket (a dataset rewritten or deleted under
    the job, credentials that expired), or no credentials. Such a file is no bad sample: as a
    bare ``FileNotFoundError`` the loader substituted other rows for the whole shard. None for
    any other error (raised as it is)."""
    if isinstance(exc, SourceError):
        return None
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        what = "is missing from" if isinstance(exc, FileNotFoundError) else "is forbidden in"
        return SourceError(
            f"{url} {what} the bucket ({type(exc).__name__}: {exc}); the dataset changed under "
            "this job (rewritten or deleted), or its credentials no longer allow reading it: "
            "restore or rewrite the dataset, or renew the credentials, then resume"
        )
    if type(exc).__name__ in _CREDENTIALS:
        return SourceError(
            f"cannot read {url}: {type(exc).__name__}: {exc}; give the object store's "
            "credentials (environment, profile, or storage_options)"
        )
    return None
