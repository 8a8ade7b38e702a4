"""Reading meshfeed shards by row: :class:`ShardFormatReader` (see :mod:`.format`).

A batch of rows of a ``fixed`` column is one fancy-index gather; a ``var`` column is sliced
through its offsets. Uncompressed shards are memory-mapped read-only; every value a read returns
is memory of its own (a gather, or a copy of a variable-length row), never a view of the map or
of a cached block, so a sample edited in place changes no later read. Compressed
shards decode only the blocks the rows need, into a per-reader LRU of decoded blocks
(``cache_bytes``), so a window of shards read in random order decodes each block about once.
A stream that plans its reads (``plan``) has the shards it reads next brought into the page
cache in the background (``read_ahead`` bytes, :mod:`.readahead`).

Every fault in a file (missing, truncated, wrong magic, a header that disagrees with its index,
a damaged block, offsets that do not add up) raises :class:`~meshfeed.errors.SourceError`
naming the shard: never a numpy crash or silent garbage. Content hashes are checked with
``verify=True``, and for a shard modified after its ``index.json`` (see the class docstring).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.errors import ShardRowsError, SourceError
from meshfeed.sources.shards.format import INDEX_NAME, ShardIndex, read_index
from meshfeed.sources.shards.open_shard import BlockCache, OpenShard
from meshfeed.sources.shards.readahead import ReadAhead

__all__ = ["ShardFormatReader"]

#: Default bound of the decoded-block LRU (per reader and process): about 8 shards of 64 MiB
#: compressed at 2:1, i.e. a window of a few raw shards.
CACHE_BYTES = 512 << 20
#: Default of ``read_ahead``: bytes of planned shards brought into the page cache ahead of the
#: shard being opened (about a shuffle window of 16 MiB shards and the next one).
READ_AHEAD = 64 << 20


class ShardFormatReader:
    """Reads meshfeed shards by row index; give it to a stream as its reader.

    - ``take(shard, rows)``: the samples at ``rows`` (``int64``, any order, repeats allowed),
      in that order;
    - ``count(shard)``: rows in the shard (from the index, no I/O);
    - ``version(shard)``: ``"blake2b-128:<hex>"``, the content hash the index records;
    - ``reader(shard, start, stop)``: the range form, rows ``[start, stop)`` (``stop=None``: to
      the end), read a block at a time.

    A shard path finds its ``index.json`` in its own directory (read once per directory and
    process); :meth:`from_index` reads one up front. The reader pickles small: open maps and
    decoded blocks stay behind and are reopened lazily in the worker that unpickles it.
    ``cache_bytes`` bounds the decoded-block LRU of compressed shards: size it to the raw bytes
    of the rows a worker reads in random order at once (its window of shards); rows drawn
    uniformly from a window larger than the cache re-decode blocks (a window 7 % over the
    cache decoded 5x its bytes). ``max_open`` bounds the maps kept open; ``threads`` decode
    the blocks one batch needs side by side (1: decode in the calling thread only).
    ``verify=True`` hashes each shard on its first open in each process (reads the whole file:
    about 1 GB/s per core); by default only sizes, headers and offsets are checked, and the
    hash of a shard of :meth:`from_index`'s dataset modified after its ``index.json``.
    ``read_ahead``: where a stream plans the shards it reads (:meth:`plan`), opening one brings
    the next ``read_ahead`` bytes of planned shards into the page cache in background threads
    and waits until the opened one is there (:mod:`.readahead`; 0: off, pages are read by the
    faults of the map alone).
    """

    def __init__(
        self,
        *,
        verify: bool = False,
        cache_bytes: int = CACHE_BYTES,
        max_open: int = 64,
        threads: int = 2,
        read_ahead: int = READ_AHEAD,
    ) -> None:
        if cache_bytes < 0 or max_open < 1 or threads < 1 or read_ahead < 0:
            raise ValueError(
                "cache_bytes and read_ahead must be >= 0, max_open and threads >= 1 (got "
                f"{cache_bytes=}, {read_ahead=}, {max_open=}, {threads=})"
            )
        self.verify, self.cache_bytes, self.max_open = verify, cache_bytes, max_open
        self.threads, self.read_ahead = threads, read_ahead
        self.index: ShardIndex | None = None
        #: When :meth:`from_index`'s dataset was written (its index.json's mtime, ns).
        self.newest: int | None = None
        self._indexes: dict[str, ShardIndex] = {}
        # A local dataset's index.json mtime: a shard changed after it is hashed on open.
        self._written: dict[str, int] = {}
        self._reset()

    def _reset(self) -> None:
        self._entries: dict[str, tuple[ShardIndex, int]] = {}  # shard -> its index, position
        self._by_name: dict[str, dict[str, int]] = {}  # per folder: file -> position
        self._index_mtimes: dict[Path, int] = {}
        self._open: OrderedDict[str, OpenShard] = OrderedDict()
        self._blocks = BlockCache(self.cache_bytes, self.threads)
        self._ahead = ReadAhead(self._size, ahead_bytes=self.read_ahead)
        self._lock = threading.RLock()

    @classmethod
    def from_index(cls, path: str | os.PathLike[str], **options: Any) -> ShardFormatReader:
        """A reader with ``path``'s index read and checked now; each shard's size (and with
        ``verify=True`` its hash) is checked when it is first opened, so a rank touches only
        the files it reads (#32); ``options`` as for the constructor."""
        reader = cls(**options)
        index = reader.index = read_index(path, check_files=False)
        root = reader.add_index(index)
        reader._written[root] = os.stat(Path(root) / INDEX_NAME).st_mtime_ns
        reader.newest = reader._written[root]
        reader._own(index)
        return reader

    def _own(self, index: ShardIndex) -> None:
        # its own shards are found by the paths it hands out, without a path walk per shard
        self._entries.update(zip(index.paths, [(index, i) for i in range(len(index))], strict=True))

    def add_index(self, index: ShardIndex) -> str:
        """Read the shards of the folder of ``index`` by it (their ``index.json`` is read, or
        it is elsewhere, e.g. in object storage); returns that folder."""
        root = os.path.abspath(index.root)
        self._indexes[root] = index
        return root

    @property
    def shards(self) -> list[str]:
        """The shard paths of :meth:`from_index`'s index, in order."""
        if self.index is None:
            raise ValueError("this reader has no index; build it with from_index(path)")
        return self.index.paths

    def __getstate__(self) -> dict[str, Any]:
        keep = ("verify", "cache_bytes", "max_open", "threads", "read_ahead", "index")
        return {k: getattr(self, k) for k in (*keep, "_indexes", "_written", "newest")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()
        if self.index is not None:
            self._own(self.index)

    def _entry(self, shard: Any) -> tuple[ShardIndex, int]:
        """The index of ``shard`` and its position there (its folder's index read once)."""
        key = os.fspath(shard)
        found = self._entries.get(key)
        if found is None:
            path = os.path.abspath(key)
            folder, name = os.path.split(path)
            with self._lock:
                index = self._indexes.get(folder)
                if index is None:
                    index = self._indexes[folder] = read_index(folder)
                by_name = self._by_name.get(folder)
                if by_name is None:  # one dict per index, not a scan per shard (#32)
                    by_name = self._by_name[folder] = {f: i for i, f in enumerate(index.files)}
            i = by_name.get(name)
            if i is None:
                raise SourceError(f"shard {key} is not listed in {folder}/index.json")
            found = self._entries[key] = (index, i)
        return found

    def _shard(self, shard: Any) -> OpenShard:
        key = os.fspath(shard)
        with self._lock:
            opened = self._open.get(key)
            if opened is not None:
                self._open.move_to_end(key)
                return opened
            index, i = self._entry(shard)
            self._ahead.opened(key)
            opened = self._open[key] = OpenShard(
                key,
                index,
                index.entry(i),
                blocks=self._blocks,
                verify=self.verify,
                written_ns=self._written.get(os.path.abspath(index.root)),
            )
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)  # maps close once their views are gone
            return opened

    def _size(self, shard: str) -> int:
        index, i = self._entry(shard)
        return int(index.sizes[i])

    def plan(self, shards: list[Any]) -> None:
        """The stream reads ``shards`` next, in this order: as each is opened, the next
        ``read_ahead`` bytes of them are brought into the page cache in the background
        (:mod:`.readahead`)."""
        self._ahead.plan([os.fspath(s) for s in shards])

    def count(self, shard: Any) -> int:
        """Rows in ``shard``, from its index (no shard I/O)."""
        index, i = self._entry(shard)
        return int(index.rows[i])

    def modified(self, shard: Any) -> int:
        """When the dataset of ``shard`` was written: its ``index.json``'s mtime in ns (one
        ``stat`` per dataset, not per shard, #32; write_shards writes the index last, and a
        shard changed in place is refused when it is opened)."""
        index, _ = self._entry(shard)
        mtime = self._index_mtimes.get(index.root)
        if mtime is None:
            mtime = self._index_mtimes[index.root] = os.stat(index.root / INDEX_NAME).st_mtime_ns
        return mtime

    def version(self, shard: Any) -> str:
        """The shard's content hash as its index records it: ``"blake2b-128:<hex>"``."""
        index, i = self._entry(shard)
        return self.version_of_hash(index.hashes[i])

    @staticmethod
    def version_of_hash(content_hash: str) -> str:
        """:meth:`version` of a shard whose index records ``content_hash``."""
        return "blake2b-128:" + content_hash

    def forget(self, shard: Any) -> None:
        """Drop this reader's map of ``shard`` (its cached copy is being released, and may be
        evicted: a map would keep its blocks on disk); values already read stay valid."""
        key = os.fspath(shard)
        with self._lock:
            self._open.pop(key, None)

    def take(self, shard: Any, rows: Any) -> list[Any]:
        """The samples at ``rows`` of ``shard``, in the order given (repeats allowed)."""
        opened = self._shard(shard)
        opened.check_unchanged()
        idx = np.asarray(rows)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise TypeError(f"rows must be a 1-D integer array (got {idx.dtype} {idx.shape})")
        idx = idx.astype(np.int64, copy=False)
        n = opened.entry.rows
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise ShardRowsError(
                f"row {bad} is outside shard {os.fspath(shard)} ({n} rows); if a stream asked "
                "for it, rows= overstates the shard (ShardedStream.from_index reads the counts)"
            )
        if opened.compressed and idx.size > 1:
            opened.prefetch(idx)
        cols = [c.values(idx) for c in opened.columns]
        if len(cols) == 1 and self._entry(shard)[0].sample == "bare":
            return cols[0]
        names = [c.spec.name for c in opened.columns]
        return [dict(zip(names, vals, strict=True)) for vals in zip(*cols, strict=True)]

    def __call__(
        self, shard: Any, start_row: int = 0, stop_row: int | None = None
    ) -> Iterator[Any]:
        """Rows ``[start_row, stop_row)`` of ``shard`` in order (``None``: to the end)."""
        n = self.count(shard)
        stop = n if stop_row is None else min(stop_row, n)
        step = self._shard(shard).block_rows
        for lo in range(max(0, start_row), stop, step):
            yield from self.take(shard, np.arange(lo, min(lo + step, stop), dtype=np.int64))
