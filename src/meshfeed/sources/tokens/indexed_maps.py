"""The ``.bin`` memory maps of local token corpora: at most ``max_open`` per process, re-opened
on demand and checked against the file as it was when its corpus opened (#32).

Python's ``mmap`` keeps a duplicate of the file's descriptor for as long as the map lives, so a
mixture that mapped each of 10,000 corpora held 10,000 descriptors and failed with ``Too many
open files``. A :class:`~meshfeed.sources.tokens.indexed.TokenCorpus` records its ``.bin``'s
identity (device, inode, size, modification time) on open and maps the file only when read,
through this process-wide LRU. A map dropped from the LRU is closed once nothing else holds a
view of it (a document a caller kept); mapped again, the file must still be the one recorded:
a file truncated, grown, rewritten or replaced in between is a
:class:`~meshfeed.errors.SourceError` that names it.

The LRU's lookup (a lock, a hash, a move) would cost a batch read more than the read of a small
batch itself, so the common case skips it: while fewer than half the limit's maps are kept, a
corpus that maps its file keeps the map in its own :class:`MapHolder` and reads it from there
with one attribute lookup, as if it had mapped the file on open. Only the corpora read after
that go through the LRU (the rest of the budget), so a process still holds at most
:func:`max_open_maps` maps.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from collections import OrderedDict

from meshfeed.errors import SourceError

__all__ = [
    "FileIdentity",
    "MapHolder",
    "check_identity",
    "file_identity",
    "map_checked",
    "max_open_maps",
    "read_ends",
]

FileIdentity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns

_DEFAULT_LIMIT = 256  # well under the usual soft limit of 1024 descriptors

_lock = threading.Lock()
_maps: OrderedDict[tuple[str, FileIdentity], mmap.mmap | bytes] = OrderedDict()
_limit = [_DEFAULT_LIMIT]


class MapHolder:
    """A corpus's own reference to its ``.bin``'s map, kept while the process has room.

    ``buf`` is None until :func:`map_checked` grants the corpus a kept map, and again after
    :func:`max_open_maps` takes the kept maps back (a new limit); then the corpus reads through
    the LRU until granted one again. A holder that dies (its corpus collected) frees its place.
    """

    __slots__ = ("__weakref__", "buf")

    def __init__(self) -> None:
        self.buf: mmap.mmap | bytes | None = None


_held: weakref.WeakSet[MapHolder] = weakref.WeakSet()


def _new_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a fork while another thread held it would leave it held


if sys.platform != "win32":  # fork and register_at_fork are POSIX only
    os.register_at_fork(after_in_child=_new_lock_in_child)


def file_identity(path: str | os.PathLike[str]) -> FileIdentity:
    """The identity of the file at ``path`` that a later map is checked against."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def max_open_maps(limit: int | None = None) -> int:
    """The most ``.bin`` maps this process keeps open (256 by default); ``limit`` sets it.

    Each open map holds one file descriptor. Returns the limit in force before the call, so a
    caller can restore it. Setting it takes back every map a corpus kept (closed at its
    corpus's next read, or when nothing holds it) and closes the least recently read maps
    beyond the new bound.
    """
    previous = _limit[0]
    if limit is None:
        return previous
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"max_open_maps takes a positive integer (got {limit=!r})")
    with _lock:
        _limit[0] = limit
        for holder in list(_held):
            holder.buf = None
        _held.clear()
        _evict()
    return previous


def _evict() -> None:
    while _maps and len(_maps) > max(0, _limit[0] - len(_held)):
        _maps.popitem(last=False)  # unmapped (and its descriptor closed) once no view remains


def map_checked(
    path: str, identity: FileIdentity, holder: MapHolder | None = None
) -> mmap.mmap | bytes:
    """The read-only map of ``path``, from the LRU or mapped now; raise :class:`SourceError`
    naming the file when it is no longer the file with ``identity``.

    With a ``holder`` and room among the kept maps, the map moves out of the LRU into
    ``holder.buf``, where its corpus reads it from then on without calling this.
    """
    key = (path, identity)
    with _lock:
        buf = _maps.get(key)
        if buf is not None:
            _maps.move_to_end(key)
            return _keep(key, buf, holder)
    buf = _map_now(path, identity)
    with _lock:
        buf = _maps.setdefault(key, buf)  # another thread may have mapped it meanwhile
        _maps.move_to_end(key)
        return _keep(key, buf, holder)


def _keep(
    key: tuple[str, FileIdentity], buf: mmap.mmap | bytes, holder: MapHolder | None
) -> mmap.mmap | bytes:
    """Under the lock: hand the LRU's ``buf`` to ``holder`` if there is room; then evict."""
    # half the limit for maps kept by their corpora; the other half is the LRU's
    if holder is not None and holder.buf is None and len(_held) < _limit[0] // 2:
        del _maps[key]
        holder.buf = buf
        _held.add(holder)
    _evict()
    return buf


def _map_now(path: str, identity: FileIdentity) -> mmap.mmap | bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SourceError(
            f"{path} was removed since its corpus was opened; a corpus must stay in place "
            "while a loader reads it (write a new one under a new prefix)"
        ) from None
    except OSError as e:  # unreadable (permissions, I/O): never a bad sample to substitute
        raise SourceError(f"cannot read {path}: {e}") from e
    try:
        st = os.fstat(fd)
        check_identity(path, identity, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        if st.st_size == 0:
            return b""  # mmap refuses empty files; an empty buffer behaves the same
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)  # the map keeps its own duplicate


def check_identity(path: str, then: FileIdentity, now: FileIdentity) -> None:
    """Raise :class:`SourceError` naming ``path`` when ``now`` is not the identity ``then``."""
    if now[2] != then[2]:
        raise SourceError(
            f"{path} changed size while open ({then[2]} bytes when opened, {now[2]} now): it "
            "was truncated or rewritten under a running reader; write corpora under a new "
            "prefix, then reopen"
        )
    if now != then:
        raise SourceError(
            f"{path} was rewritten or replaced since its corpus was opened (same size, another "
            "file or modification time); write corpora under a new prefix, then reopen"
        )


def read_ends(path: str, identity: FileIdentity, probe: int) -> tuple[bytes, bytes]:
    """The first and last ``probe`` bytes of ``path`` (read, not mapped: no descriptor kept),
    checked against ``identity`` like a map."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SourceError(f"{path} was removed since its corpus was opened") from None
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e}") from e
    try:
        st = os.fstat(fd)
        check_identity(path, identity, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        size = st.st_size
        return os.pread(fd, min(probe, size), 0), os.pread(fd, probe, max(0, size - probe))
    finally:
        os.close(fd)
