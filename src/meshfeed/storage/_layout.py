"""The shard cache on disk: one entry's files, publishing them, and the folder's usage and eviction.

Layout of ``cache_dir``: one folder per remote folder (a hash of its URL and endpoint), holding
for each file ``NAME`` (the remote base name, so ``corpus.bin`` and ``corpus.idx`` stay side by
side) the data, a sidecar ``NAME.meshfeed.json`` (URL, size, remote version, checksum)
and a lock file ``NAME.meshfeed.lock``; from S3 also ``NAME.meshfeed.etag``, the ETag of the
last download that matched its expected checksum, kept when the entry is evicted (a download
again of the same object is then not hashed: :func:`meshfeed.storage._download.get_checked`).
Lock and ETag files stay for every URL ever cached (empty, and about 200 bytes); the limit
counts data files. Temporary files (downloads in flight, and "bookings":
sparse files as large as a download in flight, counted against the limit) are named
``.NAME[...].RANDOM.meshfeed.tmp``.

An entry is valid only with its sidecar and a data file of the sidecar's size; the data is
renamed into place before the sidecar, and eviction removes the sidecar first, so no reader
ever takes a partial file for a complete one.

The sidecar's mtime is the entry's last use, except for an entry downloaded ahead, or read by a
stream, and not read to its end yet: its mtime lies ``PENDING`` seconds in the future, and reads
keep it there until it is marked read to its end (a stream reads it over many batches, and tells
the cache when its rows are all returned). A stream's shard is pending from its first read even
where the reader fetched it before its download-ahead ran: dated by its last read, a shard read
in part and then left unread for ``IN_USE`` seconds (a loaded machine, a worker waiting for the
training loop) would be evicted by a download-ahead and downloaded again for its other rows.

Eviction takes, in this order: entries idle for ``IN_USE`` seconds or marked read to their end
(least recently used first), entries pending (downloaded ahead or being read by a stream, not
read to their end yet), then entries read in the last ``IN_USE`` seconds (a plain reader's
files). A download-ahead evicts only the first kind: it stops at the limit rather than evict
what will be read soon, which would only download it twice. A demanded download evicts the
first kind first too, and where entries read to their end are left, held by a reader, it waits
for them a moment (``READ_GRACE`` in :mod:`meshfeed.storage._fill`) before it evicts pending
ones: a stream lets go of a shard read to its end within its holds' idle time, and the pending
entry evicted in its place (the last downloaded ahead) is the one a reader lagging behind reads
next, downloaded twice. An entry downloaded ahead and never read, or read in part (a job that
stopped), is an ordinary entry again ``PENDING`` seconds later.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshfeed.storage._lock import FileLock
from meshfeed.storage.urls import StorageOptions

SIDE = ".meshfeed.json"
ETAG = ".meshfeed.etag"
LOCK = ".meshfeed.lock"
TMP = ".meshfeed.tmp"
BOOKING = ".booking"
_HASH_BLOCK = 1 << 22
#: seconds a downloaded-ahead, unread entry is kept from other download-aheads (see above)
PENDING = 300.0
#: an entry read in the last IN_USE seconds is in a reader's window (evicted last)
IN_USE = 2.0
#: an entry marked read to its end is dated this many seconds before the marking: far older
#: than any use (evicted first), and telling when it was marked
READ_SHIFT = 1e7


@dataclass(frozen=True, slots=True)
class Entry:
    """The files of one cached URL."""

    url: str
    data: Path

    @classmethod
    def of(cls, cache_dir: Path, url: str, options: StorageOptions) -> Entry:
        folder, _, name = url.rstrip("/").rpartition("/")
        client = options.get("client_kwargs") or {}
        endpoint = options.get("endpoint_url") or client.get("endpoint_url") or ""
        key = hashlib.blake2b(f"{folder}\0{endpoint}".encode(), digest_size=8).hexdigest()
        name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "object"
        return cls(url, cache_dir / key / name)

    @property
    def sidecar(self) -> Path:
        return self.data.with_name(self.data.name + SIDE)

    @property
    def etag(self) -> Path:
        return self.data.with_name(self.data.name + ETAG)

    def read_vouch(self) -> dict[str, Any] | None:
        """The record of the last download from S3 that matched its expected checksum."""
        try:
            record = json.loads(self.etag.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("url") == self.url else None

    def write_vouch(self, meta: dict[str, Any]) -> None:
        """Under the entry's exclusive lock: record a checked download's ETag. Not synced, and
        a record that cannot be written is skipped: without one the next download is hashed."""
        keys = ("url", "size", "version", "checksum", "etag")
        tmp = self.temp(ETAG)
        try:
            tmp.write_text(json.dumps({k: meta[k] for k in keys}))
            os.replace(tmp, self.etag)
        except OSError:
            tmp.unlink(missing_ok=True)

    @property
    def lock(self) -> Path:
        return self.data.with_name(self.data.name + LOCK)

    def temp(self, suffix: str = "") -> Path:
        return self.data.with_name(f".{self.data.name}{suffix}.{uuid.uuid4().hex[:12]}{TMP}")

    def open_lock(self) -> FileLock:
        self.data.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.lock))

    def read_meta(self) -> dict[str, Any] | None:
        """The sidecar of a complete entry of this URL; None when there is none."""
        try:
            meta = json.loads(self.sidecar.read_text())
            size = self.data.stat().st_size
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("url") != self.url or meta.get("size") != size:
            return None
        return meta

    def publish(self, tmp: Path, meta: dict[str, Any]) -> None:
        """Under the entry's exclusive lock: data, then sidecar, each fsynced and renamed."""
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        side_tmp = self.temp(SIDE)
        with open(side_tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.data)
        os.replace(side_tmp, self.sidecar)  # the entry is complete from here on
        fd = os.open(self.data.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def mark(self, *, pending: bool, asked: float | None = None, until_read: bool = False) -> None:
        """Date the entry's last use: now, or (``pending``) downloaded ahead, not read yet.
        A use keeps a pending date: the stream that planned the entry reads it over many
        batches, and it stays pending until :meth:`mark_read` (#29). A use ``until_read``
        (a reader that will call :meth:`mark_read` once it has read the entry to its end)
        makes the entry pending where it was not: the reader fetched it before its
        download-ahead, and reads it over many batches all the same. A download-ahead asked
        at ``asked`` (``time.time()``) that finds the entry read to its end since then is
        late (a reader fetched and read it first): the entry stays read."""
        now = time.time()
        with contextlib.suppress(OSError):
            t = self.sidecar.stat().st_mtime
            if pending and asked is not None and _read(t, now) and t >= asked - READ_SHIFT:
                return
            if pending or t <= now:
                t = now + (PENDING if pending or until_read else 0.0)
                os.utime(self.sidecar, (t, t))

    def mark_read(self) -> None:
        """Date the entry as read to its end: idle (evicted first, even by a download-ahead;
        the least recently read first)."""
        t = time.time() - READ_SHIFT
        with contextlib.suppress(OSError):
            os.utime(self.sidecar, (t, t))

    def clean(self) -> None:
        """Under the entry's exclusive lock: remove every trace of an incomplete entry."""
        self.sidecar.unlink(missing_ok=True)
        self.data.unlink(missing_ok=True)
        for tmp in self.data.parent.glob(f".{self.data.name}*{TMP}"):
            tmp.unlink(missing_ok=True)


def checksum(path: Path, *, md5: bool) -> str:
    """``md5:HEX`` (comparable with a single-part ETag) or ``blake2b:HEX`` of a file.

    One hash, one pass: where the server's ETag is an MD5 that is the one worth computing.
    """
    return _digests(path, hasher(md5=md5))[0]


def checksums(path: Path) -> tuple[str, str]:
    """(``md5:HEX``, ``blake2b:HEX``) of a file in one pass: the MD5 to compare with a
    single-part ETag, the blake2b-128 that a dataset index records and its readers expect."""
    md5, blake = _digests(path, hasher(md5=True), hasher(md5=False))
    return md5, blake


def hasher(*, md5: bool) -> Any:
    """A new MD5 (comparable with a single-part ETag) or blake2b-128 (what an index records)."""
    return hashlib.md5(usedforsecurity=False) if md5 else hashlib.blake2b(digest_size=16)


def _digests(path: Path, *hashes: Any) -> list[str]:
    """``name:HEX`` of each of ``hashes`` over the file, read once."""
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            for h in hashes:
                h.update(block)
    return [f"{h.name}:{h.hexdigest()}" for h in hashes]


def sweep(cache_dir: Path) -> None:
    """Remove temporary files (and data without a sidecar) that no writer holds."""
    for tmp in cache_dir.glob(f"*/.*{TMP}"):
        # .NAME[.meshfeed.json|.booking].RANDOM.meshfeed.tmp -> NAME
        name = tmp.name[1 : -len(TMP)].rsplit(".", 1)[0].removesuffix(SIDE).removesuffix(ETAG)
        name = name.removesuffix(BOOKING)
        lock = FileLock(str(tmp.with_name(name + LOCK)))
        try:
            if lock.try_acquire(exclusive=True):
                entry = Entry("", tmp.with_name(name))
                if not entry.sidecar.exists():
                    entry.data.unlink(missing_ok=True)
                tmp.unlink(missing_ok=True)
        finally:
            lock.close()


def _usage(cache_dir: Path) -> list[tuple[float, int, Path]]:
    """(last use, bytes, sidecar) of every entry, and (inf, bytes, booking) of every booking."""
    out = []
    for p in cache_dir.glob(f"*/.*{BOOKING}.*{TMP}"):
        try:
            out.append((float("inf"), p.stat().st_size, p))  # bookings: never evicted
        except OSError:
            # gone since the listing: its download ended (a booking is removed without the
            # cache-wide lock), and its entry, if published, is counted by its sidecar
            continue
    for side in cache_dir.glob(f"*/*{SIDE}"):
        try:
            t = side.stat().st_mtime
            size = int(json.loads(side.read_text())["size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append((t, size, side))
    return out


def _read(t: float, now: float) -> bool:
    """Whether an entry of last use ``t`` is marked read to its end (:meth:`Entry.mark_read`)."""
    return t < now - READ_SHIFT / 2


def held_read(cache_dir: Path, keep: Entry) -> bool:
    """Whether entries marked read to their end (other than ``keep``) are left in the cache.
    Asked after a booking that evicts idle entries only found no room, those left are held:
    a stream's reader lets go of such a shard within its holds' idle time."""
    now = time.time()
    return any(
        _read(t, now) and side != keep.sidecar
        for t, _, side in _usage(cache_dir)
        if t != float("inf")
    )


def _rank(t: float, now: float) -> tuple[int, float]:
    """Eviction order (module docstring): idle entries, then pending ones (the last downloaded
    first: download-ahead runs in reading order, so it is read last), then those in use."""
    if t > now:
        return 1, -t
    return (0, t) if t < now - IN_USE else (2, t)


def _evict(
    cache_dir: Path, need: int, limit: int, keep: Entry, *, pending: bool
) -> tuple[bool, int]:
    """Evict unheld entries in eviction order until ``need`` more bytes fit ``limit``.

    Returns (whether they fit, entries evicted). A held entry (a shared lock anywhere on the
    node) cannot be locked exclusively without waiting, so it stays; without ``pending`` (a
    download-ahead) only idle entries go (see the module docstring).
    """
    now = time.time()
    usage = _usage(cache_dir)
    total = sum(size for _, size, _ in usage)
    entries = [e for e in usage if e[0] != float("inf")]  # bookings stay
    evicted = 0
    for t, size, side in sorted(entries, key=lambda e: _rank(e[0], now)):
        if total + need <= limit or (not pending and _rank(t, now)[0] > 0):
            break
        data = side.with_name(side.name[: -len(SIDE)])
        if data == keep.data:
            continue
        lock = FileLock(str(data.with_name(data.name + LOCK)))
        try:
            if lock.try_acquire(exclusive=True) and side.exists():
                side.unlink()  # first: without its sidecar the entry is gone for everyone
                data.unlink(missing_ok=True)
                total -= size
                evicted += 1
        finally:
            lock.close()
    return total + need <= limit, evicted


def book(
    cache_dir: Path,
    entry: Entry,
    size: int,
    *,
    limit: int | None,
    deadline: float,
    demanded: bool = True,
) -> tuple[Path | None, int]:
    """Make room for ``size`` bytes and book them: (the booking or None, entries evicted).

    None where room could not be made (held entries fill the limit; for a download-ahead,
    ``demanded=False``, held and downloaded-ahead unread entries). The booking is a sparse
    file of ``size`` bytes beside the entry, counted by every process's room check until the
    download is published or abandoned; checks and bookings are serialised by one lock for
    the whole cache.
    """
    lock = FileLock(str(cache_dir / f"cache{LOCK}"))
    try:
        lock.acquire(exclusive=True, deadline=deadline, what="the cache-wide lock, to make room")
        fits, evicted = (
            (True, 0) if limit is None else _evict(cache_dir, size, limit, entry, pending=demanded)
        )
        if not fits:
            return None, evicted
        booking = entry.temp(BOOKING)
        with open(booking, "wb") as f:
            f.truncate(size)
        return booking, evicted
    finally:
        lock.close()


def held_bytes(cache_dir: Path) -> int:
    """Bytes of the cache's entries and bookings (what the limit counts)."""
    return sum(size for _, size, _ in _usage(cache_dir))
