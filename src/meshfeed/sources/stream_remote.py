"""Streams whose shards are URLs: each shard read as a local file of the node's shard cache.

:class:`CachedReader` wraps any reader. A shard that is a URL (``s3://``, ``gs://``, any fsspec
protocol) is resolved through a :class:`~meshfeed.storage.ShardCache` to a local file,
downloaded once per node however many ranks and workers read it, and held while this process
reads it: at most ``keep`` shards per process, the least recently used released first, so the
cache may evict what no process reads any more. The wrapped reader then reads the local file
as it reads any file. A local path passes through untouched.

Download-ahead follows the stream's own order: when the loader plans its next steps (a block
of them at a time, in the main process), the stream hands the shards they read to
:meth:`CachedReader.plan`, which downloads them in the background (bounded by the cache
limit), so workers find them cached.

A shard's identity is its remote version (size and ETag / version id), asked once per process;
a shard rewritten in the bucket after a checkpoint is refused on resume, naming it (its local
copy is checked against the version too, so a stale copy is never read as the new object).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from meshfeed.sources.stream_readers import TakeReader, shard_identity, shard_mtime
from meshfeed.storage import ShardCache, is_url
from meshfeed.storage.retry import RetryPolicy
from meshfeed.storage.urls import remote_info

__all__ = ["CachedReader"]


class CachedReader:
    """``inner`` over URL shards through ``cache`` (see the module docstring). Picklable: a
    worker process gets the settings and opens its own holds."""

    def __init__(self, inner: Any, cache: ShardCache, *, shards: list[Any], keep: int = 4) -> None:
        self.inner, self.cache, self.keep = inner, cache, keep
        self.order = [str(s) for s in shards]
        self._held: OrderedDict[str, str] = OrderedDict()
        self._versions: dict[str, str] = {}
        self._modified: dict[str, int] = {}
        self._asked: set[str] = set()
        # Decided once: a runtime protocol check costs microseconds per batch.
        self._takes = isinstance(inner, TakeReader)

    def __getstate__(self) -> dict[str, Any]:
        # The versions travel: a worker expects the version the job started with (and asks
        # the bucket no second time).
        return {k: v for k, v in self.__dict__.items() if k not in ("_held", "_asked")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._held, self._asked = OrderedDict(), set()

    def _local(self, shard: Any) -> Any:
        if not (isinstance(shard, str) and is_url(shard)):
            return shard
        path = self._held.get(shard)
        if path is not None:
            self._held.move_to_end(shard)
            return path
        path = self.cache.local_path(shard, version=self.version(shard))
        self._held[shard] = path
        while len(self._held) > self.keep:
            old, _ = self._held.popitem(last=False)
            self.cache.release(old)
        return path

    def plan(self, shards: list[Any]) -> None:
        """The stream's order will read ``shards`` next: download them ahead in the
        background (each once; bounded by the cache limit)."""
        todo = [s for s in shards if isinstance(s, str) and is_url(s) and s not in self._asked]
        if todo:
            if len(self._asked) > 4 * len(self.order):
                self._asked.clear()
            self._asked.update(todo)
            self.cache.prefetch(todo)

    def version(self, shard: Any) -> str:
        if not (isinstance(shard, str) and is_url(shard)):
            return shard_identity(shard, None)
        if shard not in self._versions:
            self._ask(shard)
        return self._versions[shard]

    def modified(self, shard: Any) -> int:
        """When the object was last written, in ns since the epoch (0 where unknown): names
        a shard rewritten after a checkpoint."""
        if not (isinstance(shard, str) and is_url(shard)):
            return shard_mtime(shard)
        if shard not in self._modified:
            self._ask(shard)
        return self._modified[shard]

    def ask(self, shards: list[Any]) -> None:
        """Ask the bucket for the versions of all URL ``shards`` at once (concurrent metadata
        requests, instead of one after another as the stream first names each shard)."""
        todo = [s for s in dict.fromkeys(shards) if isinstance(s, str) and is_url(s)]
        todo = [s for s in todo if s not in self._versions]
        if len(todo) > 1:
            with ThreadPoolExecutor(min(16, len(todo)), thread_name_prefix="meshfeed-head") as ex:
                list(ex.map(self._ask, todo))

    def _ask(self, url: str) -> None:
        """One metadata request gives both the version and the modification time."""
        info = remote_info(url, self.cache.storage_options, retry=RetryPolicy(timeout=30.0))
        self._versions[url], self._modified[url] = info.version, info.modified

    def __call__(self, shard: Any, start: int, stop: int | None) -> Any:
        return self.inner(self._local(shard), start, stop)

    def take(self, shard: Any, rows: np.ndarray) -> list[Any]:
        local = self._local(shard)
        if self._takes:
            return list(self.inner.take(local, rows))
        lo, hi = int(rows.min()), int(rows.max()) + 1
        span = list(self.inner(local, lo, hi))
        return [span[r - lo] for r in rows.tolist()]

    def count(self, shard: Any) -> int:
        count = getattr(self.inner, "count", None)
        local = self._local(shard)
        if count is not None:
            return int(count(local))
        return sum(1 for _ in self.inner(local, 0, None))

    def close(self) -> None:
        """Release every shard this process holds."""
        while self._held:
            url, _ = self._held.popitem(last=False)
            self.cache.release(url)
