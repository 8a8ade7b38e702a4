"""One download of the shard cache: a single streamed GET, checked against the server's size and
MD5, and the refusal of a file that could never fit the cache."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from meshfeed.errors import SourceError
from meshfeed.storage._layout import checksum
from meshfeed.storage.urls import RemoteInfo


class TooLargeForCache(SourceError):
    """A file larger than ``cache_limit`` itself: it can never be cached whole within the limit."""

    def __init__(self, url: str, size: int, limit: int) -> None:
        super().__init__(
            f"{url} is {size} bytes, more than cache_limit={limit}: it cannot be cached whole "
            "within the limit; raise cache_limit, or read it by ranges (TokenCorpus, "
            "TokenWindows and ParquetSource do so by themselves unless ranged=False)"
        )
        self.url, self.size, self.limit = url, size, limit


class Incomplete(ConnectionError):
    """A download that ended short or whose bytes disagree with the server's: retried."""


def one_request(fs: Any) -> dict[str, Any]:
    """get_file arguments for one streamed GET per file (s3fs would split big files)."""
    get = getattr(fs, "_get_file", None)
    try:
        takes = get is not None and "max_concurrency" in inspect.signature(get).parameters
    except (TypeError, ValueError):
        takes = False
    return {"max_concurrency": 1} if takes else {}


def get_checked(fs: Any, path: str, tmp: Path, info: RemoteInfo, **kwargs: Any) -> dict[str, Any]:
    """Download ``path`` to ``tmp`` and check it; the entry's sidecar (raises :class:`Incomplete`)."""
    url = info.url
    fs.get_file(path, str(tmp), **kwargs)
    got = tmp.stat().st_size
    if got != info.size:
        raise Incomplete(f"downloaded {got} of {info.size} bytes of {url}")
    digest = checksum(tmp, md5=info.md5 is not None)
    if info.md5 is not None and digest != f"md5:{info.md5}":
        raise Incomplete(f"the download of {url} has {digest}, its ETag {info.md5}")
    return {"url": url, "size": got, "version": info.version, "checksum": digest}
