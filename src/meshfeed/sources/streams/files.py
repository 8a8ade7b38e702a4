"""The file-opening seam of the shard-format readers (MDS, WebDataset tar).

A reader does all of its I/O through one ``open_file(name) -> BinaryIO`` callable: a readable,
seekable binary file object for a shard name. The default, :func:`open_shard`, opens URLs
(``http(s)://``, ``s3://``, any fsspec protocol) through :func:`meshfeed.storage.open_url`,
whose reads are byte ranges, and anything else with the builtin ``open(name, "rb")``; pass
another function (e.g. a ``functools.partial`` with ``storage_options``) to change either.
The readers keep a few handles open per process and drop them when they are pickled to a
worker, so ``open_file`` must be picklable too (a module-level function or a
``functools.partial`` of one, not a lambda).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, BinaryIO

from meshfeed.errors import SourceError
from meshfeed.sources.streams.readers import edge_identity, shard_identity

__all__ = ["OpenFile", "open_local", "open_shard", "read_at", "shard_version"]

#: Opens a shard name for binary reading; the returned object must support ``seek``/``read``.
OpenFile = Callable[[str], BinaryIO]


def open_local(name: str) -> BinaryIO:
    """The builtin ``open(name, "rb")``."""
    return open(name, "rb")


def open_shard(name: str) -> BinaryIO:
    """The default ``open_file``: a URL (``http(s)://``, ``s3://``, any fsspec protocol)
    through :func:`meshfeed.storage.open_url` (byte ranges, retries; credentials and endpoint
    from the environment), anything else with :func:`open_local`."""
    from meshfeed.storage import is_url, open_url

    if is_url(name):
        return open_url(name)  # type: ignore[return-value]
    return open_local(name)


def read_at(f: BinaryIO, offset: int, size: int, *, shard: str, what: str) -> bytes:
    """Exactly ``size`` bytes at ``offset`` of an open shard, else a :class:`SourceError`
    naming the shard and what was being read (a truncated or rewritten file)."""
    try:
        f.seek(offset)
        data = f.read(size)
    except OSError as exc:
        raise SourceError(f"cannot read {what} of shard {shard!r}: {exc}") from exc
    if len(data) != size:
        raise SourceError(
            f"shard {shard!r} ends early: {what} wants bytes [{offset}, {offset + size}) but "
            f"the file holds {offset + len(data)}; it is truncated or was rewritten, so "
            "rewrite it (and its index) from the source"
        )
    return data


def file_size(f: BinaryIO, *, shard: str) -> int:
    """The size in bytes of an open shard (seeks to its end)."""
    try:
        return int(f.seek(0, os.SEEK_END))
    except OSError as exc:
        raise SourceError(f"cannot read shard {shard!r}: {exc}") from exc


def shard_version(shard: str, open_file: OpenFile) -> str:
    """A cheap identity of a shard's content: for a local file meshfeed's usual one (size,
    mtime and a hash of its first and last 64 KiB); for another name the size and the same
    edge hash, read through ``open_file``."""
    if open_file in (open_local, open_shard) and os.path.exists(shard):
        return shard_identity(shard, None)
    try:
        with open_file(shard) as f:
            size = file_size(f, shard=shard)
            return edge_identity(
                size, lambda offset, n: read_at(f, offset, n, shard=shard, what="its edges")
            )
    except OSError as exc:
        raise SourceError(f"cannot read shard {shard!r}: {exc}") from exc


class HandleCache:
    """Open files by shard name, at most ``limit`` at once, per process: a forked worker
    inherits the parent's handles, whose file offset the two processes would share (a seek in
    one moves the other's reads), so a process opens its own (never pickled either)."""

    def __init__(self, open_file: OpenFile, limit: int = 16) -> None:
        self.open_file, self.limit = open_file, limit
        self._files: dict[str, Any] = {}
        self._pid = os.getpid()

    def get(self, shard: str) -> BinaryIO:
        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()  # the parent's stay open in the parent
        f = self._files.get(shard)
        if f is None:
            if len(self._files) >= self.limit:
                self.close()
            try:
                f = self._files[shard] = self.open_file(shard)
            except OSError as exc:
                raise SourceError(f"cannot open shard {shard!r}: {exc}") from exc
        return f

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
