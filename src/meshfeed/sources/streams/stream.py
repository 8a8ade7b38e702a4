"""Sharded streams: shards read in order, planned like map-style data.

A :class:`ShardedStream` is a list of shards (file paths, or zero-arg callables returning an
iterable) and a reader (see :mod:`meshfeed.sources.streams.readers`). It is a map-style source
with its own order: row ``i`` is the ``i``-th row of the shards back to back, and the order of
an epoch (:class:`StreamOrder`) is a pure function of ``(seed, epoch, position)`` that keeps
reads local:

1. the shards are permuted per pass (``shuffle``);
2. the rows of the shards in that order, back to back, are cut into windows of
   ``shuffle_buffer`` rows, and each window is permuted (a Feistel permutation keyed by seed,
   pass and window: the arithmetic counterpart of a shuffle buffer of that size, with no rows
   held);
3. ``samples_per_epoch`` (default: every row) cuts epochs out of the endless sequence of
   passes, so an epoch can be shorter or longer than the data.

So the loader walks a stream exactly as it walks map-style data: every data rank takes its
slice of each global batch, every row is served once per pass across data ranks and workers,
the ranks stop together by construction, a checkpoint is an epoch and a position (a few hundred
bytes), and it resumes on another data-parallel size or worker count. A bad row is retried,
skipped or substituted like a bad sample (``on_error``); a damaged file is a
:class:`~meshfeed.errors.SourceError`.

A rank reads ``batch_size`` rows per step from one window of ``shuffle_buffer`` rows (one or two
shards): by index where the reader has ``take`` (the default reader over files, memory-mapped
formats), else forward through one open iterator per shard (a callable shard of the default
reader too, once per pass from its start), keeping the rows read while a later step of their
window may ask for them (at most a window's), so a window is read once (on each data rank).
Without ``shuffle_buffer`` the rows of a step are one contiguous run. Row counts come from
``rows=``, the reader's ``count``, or one pass over each shard when the stream is first
measured, each shard within the measuring loader's ``timeout``
(:mod:`meshfeed.sources.streams.count`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from meshfeed.protocols import UrlReader
from meshfeed.sources.streams.count import count_rows
from meshfeed.sources.streams.order import StreamOrder
from meshfeed.sources.streams.readers import (
    DefaultReader,
    Reader,
    ReaderHooks,
    RowCursor,
    callable_identity,
    shard_identity,
    shard_mtime,
    shard_name,
)

__all__ = ["ShardedStream", "StreamOrder"]


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low} (got {name}={value!r})")
    return int(value)


def _check_shards(shards: object) -> None:
    """``shards`` is a non-empty sequence (not a string) of paths or zero-arg callables."""
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence) or not shards:
        raise ValueError(
            f"shards must be a non-empty list of file paths or zero-arg callables (got {shards!r})"
        )
    for s in shards:
        if not (callable(s) or isinstance(s, (str, os.PathLike))):
            raise TypeError(f"shard {s!r} is neither a path nor a zero-arg callable")


def _is_row_count(r: object) -> bool:
    """``r`` is an int (not a bool) in ``[0, 2**40)``."""
    return not isinstance(r, bool) and isinstance(r, (int, np.integer)) and bool(0 <= r < 2**40)


def _check_rows(rows: Sequence[int], shards: Sequence[Any]) -> list[int]:
    """The given row counts as ints, refused unless one valid count per shard."""
    if len(rows) != len(shards) or not all(_is_row_count(r) for r in rows):
        raise ValueError(
            f"rows must give one int row count in [0, 2**40) per shard ({len(shards)} "
            f"shards, got {list(rows)[:8]!r}); omit rows= to have them counted, and "
            "split larger shards"
        )
    return [int(r) for r in rows]


class ShardedStream:
    """Shards plus a reader, read as a map-style source (see the module docstring).

    ``shuffle_buffer``: rows per shuffle window (0 or 1: rows in shard order; the shards are
    still permuted when the loader shuffles). ``seed`` keys the shard and window permutations
    together with the loader's seed. ``rows``: row counts per shard, if known (else counted).
    ``samples_per_epoch``: rows per epoch (default: every row once); fewer or more rows than
    the shards hold walk on through the endless sequence of reshuffled passes.

    Shards may be URLs (``s3://``, ``gs://``, any fsspec protocol; ``pip install
    "meshfeed[remote]"``): each is downloaded once per node into the shard cache at
    ``cache_dir`` (default ``$MESHFEED_CACHE_DIR`` or ``~/.cache/meshfeed/shards``), bounded by
    ``cache_limit`` bytes, with ``storage_options`` passed to fsspec (endpoint, credentials);
    see :mod:`meshfeed.sources.streams.remote`.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        reader: Reader | None = None,
        *,
        shuffle_buffer: int = 0,
        seed: int = 0,
        rows: Sequence[int] | None = None,
        samples_per_epoch: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        _check_shards(shards)
        if reader is not None and not callable(reader):
            raise TypeError(
                f"reader={reader!r} is not callable; pass reader(shard, start_row, stop_row)"
            )
        self.shuffle_buffer = _check_int("shuffle_buffer", shuffle_buffer, 0)
        self.seed = _check_int("seed", seed, 0)
        if samples_per_epoch is not None:
            samples_per_epoch = _check_int("samples_per_epoch", samples_per_epoch, 1)
        self.samples_per_epoch = samples_per_epoch
        self._given_rows: list[int] | None = None if rows is None else _check_rows(rows, shards)
        self.shards = list(shards)
        self.reader: Any = _remote(
            reader or DefaultReader(), self.shards, cache_dir, cache_limit, storage_options
        )
        self._cursors: dict[int, RowCursor] = {}
        self._hooks = ReaderHooks.of(self.reader)  # decided once, never probed per batch
        self._reads_callables = isinstance(self.reader, DefaultReader)

    @classmethod
    def from_index(
        cls,
        path: str | os.PathLike[str],
        *,
        verify: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        **stream: Any,
    ) -> ShardedStream:
        """The stream of a meshfeed shard dataset (:func:`~meshfeed.sources.write_shards`):
        ``path`` is its ``index.json`` or folder, local or a URL. Row counts and content
        hashes come from the index (nothing is counted or hashed up front); a URL dataset's
        shards are downloaded once per node into the shard cache as the stream reaches them.
        For a URL, the ``index.json``'s version is the job's one identity check (one metadata
        request; a cached index of another version is replaced); each shard is then known by
        the size and hash its index records: no request per shard, and each copy is hashed
        once as it enters the cache (a shard that does not match its index is refused by
        name). ``verify``: every shard is hashed once more (a local one when the stream opens it;
        a URL's cached copy on its first use in a process, downloaded again if it was damaged
        in the cache). ``stream``: ``shuffle_buffer``, ``seed``, ``samples_per_epoch``."""
        from meshfeed.sources.shards.format import INDEX_NAME, read_index
        from meshfeed.sources.shards.read import ShardFormatReader
        from meshfeed.sources.streams.remote import CachedReader
        from meshfeed.storage import ShardCache, is_url

        where = os.fspath(path)
        if not is_url(where):
            reader = ShardFormatReader.from_index(where, verify=verify)
            rows = reader.index.rows.tolist()  # type: ignore[union-attr]
            return cls(reader.shards, reader, rows=rows, **stream)
        base = where.removesuffix(INDEX_NAME).rstrip("/")
        # verify: each cached copy is hashed on its first use in this process, and one that
        # does not match is downloaded again (the cache's "checksum" check), rather than
        # refused on every later job as a damaged dataset (the bucket's copy is fine)
        cache = ShardCache(
            cache_dir,
            cache_limit=cache_limit,
            storage_options=storage_options,
            verify="checksum" if verify else "size",
        )
        index_url = f"{base}/{INDEX_NAME}"
        info = cache.identify(index_url)
        with cache.hold(index_url) as local_index:
            index = read_index(local_index, check_files=False)
        reader = ShardFormatReader(verify=False)  # the cache verifies (above)
        # the cache keeps the files of one URL folder in one local folder: the shards land
        # beside this index, where the reader looks for it
        reader.add_index(index)
        shards = [f"{base}/{f}" for f in index.files]
        for url, h, size in zip(shards, index.hashes, index.sizes.tolist(), strict=True):
            cache.expect(url, digest=f"blake2b:{h}", size=size)
        cached = CachedReader(
            reader,
            cache,
            shards=shards,
            identities={
                u: reader.version_of_hash(h) for u, h in zip(shards, index.hashes, strict=True)
            },
            newest=None if info is None else info.modified,
        )
        return cls(shards, cached, rows=index.rows.tolist(), **stream)

    # ------------------------------------------------------------------ sizes
    @cached_property
    def rows(self) -> list[int]:
        """Rows per shard: as given, else the reader's ``count``, else one pass per shard."""
        if self._given_rows is not None:
            return self._given_rows
        count = self._hooks.count
        if count is None:
            reader = self.reader

            def count(shard: Any) -> int:
                return sum(1 for _ in reader(shard, 0, None))

        # each shard within the loader's timeout: a stalled reader must not hang the job (#28)
        return count_rows(count, self.shards)

    @cached_property
    def _starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)

    @property
    def num_rows(self) -> int:
        return int(self._starts[-1])

    def __len__(self) -> int:
        return self.num_rows

    # ------------------------------------------------------------------ reading
    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, row)`` arrays of stream row indices."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_rows):
            raise IndexError(
                f"row index out of range for a stream of {self.num_rows} rows (got values in "
                f"[{idx.min()}, {idx.max()}])"
            )
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        return shard, idx - self._starts[shard]

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The rows at these indices: per shard, one ``take`` or one read per contiguous run."""
        shard, row = self.locate(np.asarray(indices, dtype=np.int64))
        out: list[Any] = [None] * len(shard)
        if len(shard) and (shard == shard[0]).all():
            groups = [(int(shard[0]), np.arange(len(shard)))]
        else:
            groups = [(int(s), np.flatnonzero(shard == s)) for s in dict.fromkeys(shard.tolist())]
        for s, where in groups:
            for i, item in zip(where.tolist(), self._take(s, row[where]), strict=True):
                out[i] = item
        return out

    def _take(self, s: int, rows: np.ndarray) -> list[Any]:
        shard = self.shards[s]
        # The default reader reads a callable shard forward from its start: read here, where
        # the shuffle window is known, so a window's rows are kept until its steps ask for them.
        forward = self._reads_callables and callable(shard)
        if self._hooks.take is not None and not forward:
            return list(self._hooks.take(shard, rows))
        cursor = self._cursors.get(s)
        if cursor is None:
            cursor = self._cursors[s] = RowCursor(
                self.reader, shard, seeks=not forward, window=self.shuffle_buffer
            )
        return cursor.take(rows)

    def close(self) -> None:
        """Release what this process holds of the shards (URL shards held in the node's
        cache); reading again re-opens them."""
        if self._hooks.close is not None:
            self._hooks.close()
        self._cursors.clear()

    def __getstate__(self) -> dict[str, Any]:
        # open iterators stay in the process that opened them
        return {**self.__dict__, "_cursors": {}}

    # ------------------------------------------------------------------ order
    def make_order(
        self, *, dataset_length: int, global_batch_size: int, seed: int, shuffle: bool = True
    ) -> StreamOrder:
        """The order a loader walks (see :class:`StreamOrder`)."""
        plan, finished = self._hooks.plan, self._hooks.finished
        return StreamOrder(
            self.rows,
            seed=seed,
            stream_seed=self.seed,
            shuffle=shuffle,
            window=self.shuffle_buffer,
            samples_per_epoch=self.samples_per_epoch,
            on_plan=None if plan is None else lambda ids: plan([self.shards[i] for i in ids]),
            on_done=None
            if finished is None
            else lambda ids: finished([self.shards[i] for i in ids]),
        )

    # ------------------------------------------------------------------ identity
    @cached_property
    def _identities(self) -> list[str]:
        if self._hooks.ask is not None:  # URL shards: every shard's metadata in one round
            self._hooks.ask(self.shards)
        return [shard_identity(s, self._hooks.version) for s in self.shards]

    @property
    def fingerprint(self) -> str:
        """The shards' names and content identities, the reader's name and the row counts,
        hashed; the newest shard's mtime follows, to name a rewritten shard on resume.

        Computed once per stream object, like the identities it hashes (one pass over the
        shards: at 10,000 shards every extra pass shows at start, #32); a shard changed
        later is refused when it is read (its size, or its hash with ``verify``)."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        import hashlib

        names = [shard_name(s) for s in self.shards]
        reader = callable_identity(
            type(self.reader) if isinstance(self.reader, DefaultReader) else self.reader
        )
        h = hashlib.blake2b(
            json.dumps([names, self._identities, self.rows, reader]).encode(), digest_size=10
        )
        newest = self._hooks.newest  # a URL dataset index's write time
        if newest is None:
            newest = max(self._modified(s) for s in self.shards)
        return f"stream:{len(self.shards)}:{h.hexdigest()}:{newest}"

    def _modified(self, shard: Any) -> int:
        modified = self._hooks.modified
        return int(modified(shard)) if modified is not None else shard_mtime(shard)

    def explain_fingerprint(self, old: str) -> str:
        """Why ``old`` (a checkpoint's fingerprint) differs from this stream's: the shards
        written after it (by mtime), or what else changed."""
        parts = old.split(":")
        if len(parts) != 4 or parts[0] != "stream":
            return "the checkpoint is not from a ShardedStream"
        if int(parts[1]) != len(self.shards):
            return f"the checkpoint's stream had {parts[1]} shards, this one has {len(self.shards)}"
        try:
            newest = int(parts[3])
        except ValueError:
            return "the checkpoint's stream fingerprint is malformed"
        changed = [shard_name(s) for s in self.shards if self._modified(s) > newest]
        if changed:
            shown = ", ".join(changed[:4]) + (
                f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            )
            return f"shard(s) {shown} changed after the checkpoint was written"
        return "a shard's content, a shard name, the reader or the row counts changed"


def _remote(
    reader: Any,
    shards: list[Any],
    cache_dir: Any,
    cache_limit: int | None,
    storage_options: Mapping[str, Any] | None,
) -> Any:
    """``reader``, wrapped to read URL shards through the node's shard cache when any shard
    is a URL (see :mod:`meshfeed.sources.streams.remote`), unless the reader declares
    ``reads_urls = True`` (it reads them itself, e.g. by byte ranges)."""
    from meshfeed.storage import ShardCache, is_url

    if isinstance(reader, UrlReader) and reader.reads_urls:  # it reads URLs itself (ranges)
        return reader
    if not any(isinstance(s, str) and is_url(s) for s in shards):
        if cache_dir is not None or storage_options is not None:
            raise ValueError(
                "cache_dir= / storage_options= are for shards given as URLs (s3://, gs://, ...); "
                "these shards are local: leave both out"
            )
        return reader
    from meshfeed.sources.streams.remote import CachedReader

    cache = ShardCache(cache_dir, cache_limit=cache_limit, storage_options=storage_options)
    return CachedReader(reader, cache, shards=shards)
