"""Streams whose shards are URLs: each shard read as a local file of the node's shard cache.

:class:`CachedReader` wraps any reader. A shard that is a URL (``s3://``, ``gs://``, any fsspec
protocol) is resolved through a :class:`~meshfeed.storage.ShardCache` to a local file,
downloaded once per node however many ranks and workers read it, and held while this process
reads it: every process (the one that built the reader, each worker process) keeps the shards
it reads from one read to the next, and lets each go once the stream's order has returned all
its rows, once it has gone unread for a moment, or when the process needs room
(:mod:`meshfeed.sources.streams.holds`), so the cache may evict what no process reads any more.
The wrapped reader then reads the local file as it reads any file. A local path passes through
untouched.

Download-ahead follows the stream's own order: when the loader plans its next steps (a block
of them at a time, in the main process), the stream hands the shards they read to
:meth:`CachedReader.plan`, which downloads them in the background, so workers find them
cached. Under a cache limit a download-ahead never evicts a shard downloaded ahead and not
read yet, nor one a reader let go before reading it to its end: one that finds no room waits,
in the stream's order, until a shard is read to its end. As the loader returns batches, the
stream's order tells :meth:`CachedReader.finished` which shards have had all their rows
returned (however many worker processes read them: :mod:`meshfeed.sources.streams.order`); the
cache evicts those first and downloads the waiting ones ahead: download and reading overlap
through the whole epoch, and no shard is downloaded twice (#29).

A shard's identity is its content hash where a dataset index records one (``identities``,
from :meth:`ShardedStream.from_index`: no request per shard at all; the cache checks each copy
against it as it enters), else its remote version (size and ETag / version id), asked once per
job with one listing per folder (a HEAD only for what the listing lacks), in the process that
starts the job; workers get the answers with the reader. A shard rewritten in the bucket after
a checkpoint is refused on resume, naming it (its local copy is checked against the version
too, so a stale copy is never read as the new object).

With a ``cache_limit``, a reader that needs a shard while the cache is full of held ones first
lets go of its own idle holds (and the inner reader's maps of them), so the readers of a node
never need more than the limit at once.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from meshfeed.errors import ShardRowsError
from meshfeed.lifecycle import now_or_later
from meshfeed.sources.streams.holds import IDLE, Holds
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
        # Decided once: a runtime protocol check costs microseconds per batch.
        self._hooks = ReaderHooks.of(inner)
        self._fresh()

    def _fresh(self) -> None:
        """This process's own holds (none yet) and download-aheads asked. The holds are let
        go when this reader is closed (:meth:`close`) or collected: a reader left open, e.g. by
        a loop stopped early, keeps no entry of the cache from the readers after it."""
        old = getattr(self, "_closer", None)
        if old is not None:
            old.detach()  # a forked copy: the parent's holds are the parent's
        self._pid = os.getpid()
        limited = self.cache.cache_limit is not None
        # not a method of self: the holds must not keep this reader from being collected
        let_go = functools.partial(_let_go, self.cache, self._hooks.forget if limited else None)
        self._holds = Holds(let_go, keep=self.keep, idle=IDLE if limited else None)
        # Run by the collector where it frees the reader: the holds' and cache's locks then
        # wait until the collection ends (see now_or_later).
        self._closer = weakref.finalize(self, now_or_later, self._holds.close)
        self._asked: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        # The versions travel: a worker expects the version the job started with (and asks
        # the bucket no second time).
        skip = ("_holds", "_asked", "_closer")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    def _own(self) -> Holds:
        """This process's holds. A forked copy first forgets the parent's: they are the
        parent's (its cache closed their locks in this process), and kept they would keep
        shards from the cache's room that no process reads."""
        if self._pid != os.getpid():
            self._fresh()
        return self._holds

    def _local(self, shard: Any) -> Any:
        """The local path of ``shard``, held for a read until :meth:`_done`."""
        if not (isinstance(shard, str) and is_url(shard)):
            return shard
        holds = self._own()
        path = holds.use(shard)
        if path is None:
            version = None if self._by_index else self.version(shard)
            # the stream's order tells finished(): kept from download-aheads until then
            path = self.cache.local_path(
                shard, version=version, make_room=holds.let_go_idle, until_finished=True
            )
            holds.add(shard, path)
        return path

    def _done(self, shard: Any) -> None:
        if isinstance(shard, str) and is_url(shard):
            self._own().done(shard)

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

    def finished(self, shards: list[Any]) -> None:
        """The stream's order returned every row of ``shards``' current pass: let go of them,
        and the cache evicts them first (and downloads the waiting ones ahead)."""
        urls = [s for s in shards if isinstance(s, str) and is_url(s)]
        self._own().finish(urls)
        for url in urls:
            self._asked.discard(url)  # its next pass downloads it ahead again
            self.cache.finished(url)

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
        local = self._local(shard)
        try:
            yield from self.inner(local, start, stop)
        finally:
            now_or_later(self._done, shard)  # takes the cache's lock: see now_or_later

    def take(self, shard: Any, rows: np.ndarray) -> list[Any]:
        local = self._local(shard)
        try:
            if self._hooks.take is not None:
                return list(self._hooks.take(local, rows))
            lo, hi = int(rows.min()), int(rows.max()) + 1
            span = list(self.inner(local, lo, hi))
            if len(span) != hi - lo:  # never a row of another index in its place
                raise ShardRowsError(
                    f"shard {shard} holds {lo + len(span)} rows, but row {hi - 1} was asked "
                    "for: rows= overstates it, or its reader yields fewer rows than it counts"
                )
            return [span[r - lo] for r in rows.tolist()]
        finally:
            self._done(shard)

    def count(self, shard: Any) -> int:
        """The rows of ``shard``; a shard held for counting alone is let go at once (a
        stream counted and never read keeps nothing held)."""
        count = self._hooks.count
        url = shard if isinstance(shard, str) and is_url(shard) else None
        was_held = url is not None and url in self._own().urls()
        local = self._local(shard)
        try:
            if count is not None:
                return int(count(local))
            return sum(1 for _ in self.inner(local, 0, None))
        finally:
            self._done(shard)
            if url is not None and not was_held:
                self._own().finish([url])

    def close(self) -> None:
        """Let go of every shard this process holds, then close the inner reader where it has
        ``close`` (its open files; idempotent: reading again holds and opens anew)."""
        try:
            self._own().close()
        finally:
            if self._hooks.close is not None:
                self._hooks.close()


def _let_go(cache: ShardCache, forget: Callable[[Any], None] | None, url: str, local: str) -> None:
    """End this process's hold of ``url``, and (``forget``, under a limit) the inner reader's
    map of it (a map would keep an evicted file's blocks on disk); without a limit nothing is
    evicted, and the inner reader keeps its maps (re-opening costs more than a read)."""
    if forget is not None:
        forget(local)
    cache.release(url)
