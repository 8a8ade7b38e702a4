"""Streams whose shards are URLs: each shard read as a local file of the node's shard cache.

:class:`CachedReader` wraps any reader. A shard that is a URL (``s3://``, ``gs://``, any fsspec
protocol) is resolved through a :class:`~meshfeed.storage.ShardCache` to a local file,
downloaded once per node however many ranks and workers read it, and held while this process
reads it: at most ``keep`` shards per process (16: a shuffle window's shards, read batch after
batch; releasing one of them would re-open it for the next batch), the least recently used
released first, so the cache may evict what no process reads any more. The wrapped reader then
reads the local file as it reads any file. A local path passes through untouched.

Download-ahead follows the stream's own order: when the loader plans its next steps (a block
of them at a time, in the main process), the stream hands the shards they read to
:meth:`CachedReader.plan`, which downloads them in the background, so workers find them
cached. Under a cache limit a download-ahead never evicts a shard downloaded ahead and not
read yet, nor one read in the last seconds: one that finds no room waits, in the stream's
order, until a shard is read to its end. The reader counts the rows it reads of each shard
(``count`` of the inner reader: from the index, no I/O); once a pass has read all of a shard's
rows it tells the cache (:meth:`~meshfeed.storage.ShardCache.finished`), which evicts that
shard first and downloads the waiting ones ahead: download and reading overlap through the
whole epoch, and no shard is downloaded twice (#29). Worker processes read only some rows of
each shard, so they count nothing: with workers a shard leaves the cache once it has been idle
for a few seconds, and download-ahead resumes as the stream plans its next steps.

A shard's identity is its content hash where a dataset index records one (``identities``,
from :meth:`ShardedStream.from_index`: no request per shard at all; the cache checks each copy
against it as it enters), else its remote version (size and ETag / version id), asked once per
job with one listing per folder (a HEAD only for what the listing lacks), in the process that
starts the job; workers get the answers with the reader. A shard rewritten in the bucket after
a checkpoint is refused on resume, naming it (its local copy is checked against the version
too, so a stale copy is never read as the new object).

With a ``cache_limit``, a reader that needs a shard while the cache is full of held ones first
releases its own holds (and the inner reader's maps of them), so the readers of a node never
need more than the limit at once.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import numpy as np

from meshfeed.sources.streams.readers import ReaderHooks, shard_identity, shard_mtime
from meshfeed.storage import ShardCache, is_url
from meshfeed.storage.retry import RetryPolicy
from meshfeed.storage.urls import remote_infos

__all__ = ["CachedReader"]


class CachedReader:
    """``inner`` over URL shards through ``cache`` (see the module docstring). Picklable: a
    worker process gets the settings and opens its own holds."""

    #: URL shards are resolved here; the stream must not wrap this reader again.
    reads_urls = True

    def __init__(
        self,
        inner: Any,
        cache: ShardCache,
        *,
        shards: list[Any],
        keep: int = 16,
        identities: dict[str, str] | None = None,
        newest: int | None = None,
    ) -> None:
        self.inner, self.cache, self.keep = inner, cache, keep
        self.order = [str(s) for s in shards]
        # content identities an index records (no request per shard), and its write time
        self._versions: dict[str, str] = dict(identities or {})
        self._by_index = bool(identities)
        self.newest = newest
        self._modified: dict[str, int] = {}
        self._rows: dict[str, int] = {}  # rows of each URL shard (the inner reader's count)
        # the process that built the reader keeps, between reads, the holds (and the inner
        # reader's maps) of shards it has not read to their end (see _done); a worker's copy
        # (unpickled, or inherited by a fork: another pid) holds nothing between reads
        self._pid: int | None = os.getpid()
        self._forget_holds()
        # Decided once: a runtime protocol check costs microseconds per batch.
        self._hooks = ReaderHooks.of(inner)

    def _forget_holds(self) -> None:
        self._held: OrderedDict[str, str] = OrderedDict()
        self._asked: set[str] = set()
        self._read: dict[str, int] = {}  # rows of each URL shard read in its current pass

    def __getstate__(self) -> dict[str, Any]:
        # The versions travel: a worker expects the version the job started with (and asks
        # the bucket no second time).
        skip = ("_held", "_asked", "_read")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = None  # a worker process's copy: hold nothing between reads
        self._forget_holds()

    def _lingers(self) -> bool:
        """Whether this is the building process's reader (see ``__init__``). A forked copy
        first forgets the parent's holds: they are the parent's (its cache closed their
        locks in this process), and keeping them between reads would keep shards from the
        cache's room that no process reads (workers waiting for room wait for each other)."""
        if self._pid is not None and self._pid != os.getpid():
            self._pid = None
            self._forget_holds()
        return self._pid is not None

    def _local(self, shard: Any) -> Any:
        if not (isinstance(shard, str) and is_url(shard)):
            return shard
        linger = self._lingers()  # first: a forked copy forgets the parent's holds
        path = self._held.get(shard)
        if path is not None:
            self._held.move_to_end(shard)
            return path
        version = None if self._by_index else self.version(shard)
        path = self.cache.local_path(
            shard, version=version, make_room=lambda: self._release(len(self._held))
        )
        self._held[shard] = path
        self._release(len(self._held) - self.keep)
        # under a limit, rows read are counted to tell the cache when a shard is done with;
        # not in a worker process, which reads only some of each shard's rows
        count = self._hooks.count
        limited = self.cache.cache_limit is not None and linger
        if limited and count is not None and shard not in self._rows:
            self._rows[shard] = int(count(path))
        return path

    def _release(self, n: int, shard: str | None = None) -> None:
        """Release the ``n`` least recently used holds (or the hold of ``shard``), and the
        inner reader's maps of them (a map would keep an evicted file's blocks on disk)."""
        # without a limit nothing is evicted: the inner reader keeps its maps (reopening a
        # shard per batch would cost more than the read)
        limited = self.cache.cache_limit is not None
        forget = self._hooks.forget if limited else None
        for _ in range(max(0, n)):
            if shard is None:
                old, local = self._held.popitem(last=False)
            elif shard in self._held:
                old, local = shard, self._held.pop(shard)
            else:
                return
            if forget is not None:
                forget(local)
            self.cache.release(old)

    def plan(self, shards: list[Any]) -> None:
        """The stream's order will read ``shards`` next: download them ahead in the
        background (each once; bounded by the cache limit)."""
        todo = [s for s in shards if isinstance(s, str) and is_url(s) and s not in self._asked]
        if todo:
            if len(self._asked) > 4 * len(self.order):
                self._asked.clear()
            self._asked.update(todo)
            versions = None if self._by_index else {s: self.version(s) for s in todo}
            self.cache.prefetch(todo, versions=versions)

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
        """Ask the bucket for the versions of all URL ``shards`` at once: one listing per
        folder (a metadata request only for what a listing lacks)."""
        todo = [s for s in dict.fromkeys(shards) if isinstance(s, str) and is_url(s)]
        todo = [s for s in todo if s not in self._versions]
        if todo:
            self._learn(todo)

    def _ask(self, url: str) -> None:
        # the first shard asked for: every shard of the stream at once (one listing per folder)
        self._learn([url, *(s for s in self.order if s not in self._modified and is_url(s))])

    def _learn(self, urls: list[str]) -> None:
        infos = remote_infos(
            urls, self.cache.storage_options, retry=RetryPolicy(timeout=self.cache.retry.timeout)
        )
        self.cache.remember(infos.values())
        for url, info in infos.items():
            self._modified[url] = info.modified
            if not self._by_index:
                self._versions[url] = info.version

    def __call__(self, shard: Any, start: int, stop: int | None) -> Any:
        n = 0
        try:
            for row in self.inner(self._local(shard), start, stop):
                n += 1
                yield row
        finally:
            self._done()
        self._progress(shard, n)

    def take(self, shard: Any, rows: np.ndarray) -> list[Any]:
        local = self._local(shard)
        try:
            if self._hooks.take is not None:
                out = list(self._hooks.take(local, rows))
            else:
                lo, hi = int(rows.min()), int(rows.max()) + 1
                span = list(self.inner(local, lo, hi))
                out = [span[r - lo] for r in rows.tolist()]
        finally:
            self._done()
        self._progress(shard, len(out))
        return out

    def _progress(self, shard: Any, n: int) -> None:
        """``n`` more rows of ``shard`` read: once a pass has read them all, the cache may
        evict it first and download the next shards ahead (the module docstring)."""
        if not (n and isinstance(shard, str) and is_url(shard) and self._lingers()):
            return  # a worker's copy reads only some rows of each shard: it counts nothing
        rows = self._rows.get(shard)
        if rows is None:  # no limit, or a reader that cannot count: nothing to tell the cache
            return
        read = self._read.get(shard, 0) + n
        if read < rows:
            self._read[shard] = read
            return
        self._read[shard] = read - rows  # rows read past the end belong to the next pass
        self._asked.discard(shard)  # its next pass downloads it ahead again
        self._release(1, shard)
        self.cache.finished(shard)

    def count(self, shard: Any) -> int:
        count = self._hooks.count
        local = self._local(shard)
        try:
            if count is not None:
                return int(count(local))
            return sum(1 for _ in self.inner(local, 0, None))
        finally:
            self._done()

    def _done(self) -> None:
        """After each read, under a ``cache_limit``, in a worker process: hold nothing between
        reads, so an idle worker (waiting for its next batch) never keeps another from the
        room it needs; its map goes too (an evicted file's blocks would stay on disk under
        it). The process that built the reader (no workers; a rank of torch.distributed)
        keeps the shards it has not read to their end: they are its window's, which every
        reader of the node reads at once, and a read per batch would otherwise re-hold and
        re-open each of them; it releases each once read to its end (or all of them when
        it needs room)."""
        if self.cache.cache_limit is not None and not (self._lingers() and self._rows):
            self._release(len(self._held))

    def close(self) -> None:
        """Release every shard this process holds."""
        self._lingers()  # a forked copy forgets the parent's holds first
        while self._held:
            url, _ = self._held.popitem(last=False)
            self.cache.release(url)
