"""Reading meshfeed shards by row: :class:`ShardFormatReader` (see :mod:`.shards_format`).

The reader is what a stream calls per shard: ``take(shard, rows)`` (rows in any order, repeats
allowed), ``count(shard)``, ``version(shard)`` and the range form ``reader(shard, start, stop)``.
A batch of rows of a ``fixed`` column is one fancy-index gather; a ``var`` column is sliced
through its offsets. Uncompressed shards are memory-mapped copy-on-write, so values are views
of the page cache (writable: a write touches a private copy, never the file). Compressed
shards decode only the blocks the rows need, into a per-reader LRU of decoded blocks
(``cache_bytes``), so a window of shards read in random order decodes each block about once.

Every fault in a file (missing, truncated, wrong magic, a header that disagrees with its index,
a damaged block, offsets that do not add up) raises :class:`~meshfeed.errors.SourceError`
naming the shard: never a numpy crash or silent garbage. Content hashes are checked only with
``verify=True`` (once per shard per process, on first open: it reads the whole file).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshfeed.errors import SourceError
from meshfeed.sources.shards_format import (
    INDEX_NAME,
    MAGIC,
    PREAMBLE,
    VERSION,
    FieldSpec,
    ShardEntry,
    ShardIndex,
    check_file,
    read_index,
)

__all__ = ["ShardFormatReader"]

_BlockKey = tuple[str, int, str, int]  # shard path, column, segment, block
#: Default bound of the decoded-block LRU (per reader and process): about 8 shards of 64 MiB
#: compressed at 2:1, i.e. a window of a few raw shards.
CACHE_BYTES = 512 << 20


class _Shard:
    """One open shard in this process: its map, header and columns."""

    def __init__(self, reader: ShardFormatReader, path: str, index: ShardIndex, entry: ShardEntry):
        self.path, self.entry, self.reader = path, entry, reader
        self.compressed = index.compression is not None
        written = reader._written.get(os.path.abspath(index.root))
        check_file(Path(path), entry, verify=reader.verify, written_ns=written)
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.base = entry.payload
        self._check_header()
        try:
            self.block_rows = int(entry.layout["block_rows"])
            self._check_segments()
            cols = entry.layout["columns"]
            if len(cols) != len(index.fields) or self.block_rows < 1:
                raise ValueError(f"{len(cols)} columns for {len(index.fields)} fields")
            self.columns = [
                (_FixedColumn if cols[i]["store"] == "fixed" else _VarColumn)(self, i, f, cols[i])
                for i, f in enumerate(index.fields)
            ]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise self.fail(f"its layout is malformed ({e!r})") from e

    def fail(self, what: str) -> SourceError:
        return SourceError(f"shard {self.path} is damaged: {what}; rewrite the dataset")

    def _check_header(self) -> None:
        if len(self.map) < PREAMBLE.size:
            raise self.fail("shorter than its preamble")
        magic, version, size = PREAMBLE.unpack_from(self.map, 0)
        if magic != MAGIC:
            raise self.fail(f"wrong magic {magic!r} (not a meshfeed shard)")
        if version != VERSION:
            raise self.fail(f"format version {version}, this meshfeed reads {VERSION}")
        if PREAMBLE.size + size > min(len(self.map), self.base):
            raise self.fail(f"header length {size} runs past its payload or the file")
        try:
            header = json.loads(self.map[PREAMBLE.size : PREAMBLE.size + size])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.fail(f"unreadable header ({e})") from e
        if header != self.entry.layout:
            raise self.fail("its header disagrees with its index.json entry")
        if self.entry.rows != header.get("rows"):
            raise self.fail("its row count disagrees with its index.json entry")

    def _check_segments(self) -> None:
        room = len(self.map) - self.base
        for col in self.entry.layout["columns"]:
            for seg in col["segments"].values():
                end = seg[0][0] if seg else 0
                for off, stored, raw in seg:
                    if off < 0 or stored < 0 or raw < 0 or off + stored > room:
                        raise self.fail(f"a block [{off}, {stored}] lies outside the file")
                    if not self.compressed and (stored != raw or off != end):
                        raise self.fail("uncompressed blocks that do not tile their segment")
                    end = off + stored

    def whole(self, segment: list[list[int]]) -> np.ndarray:
        """An uncompressed segment as one ``uint8`` view (its blocks tile it)."""
        start = self.base + (segment[0][0] if segment else 0)
        return np.frombuffer(self.map, np.uint8, sum(b[2] for b in segment), start)

    def block(self, col: int, name: str, b: int) -> np.ndarray:
        """Block ``b`` of a segment, raw (``uint8``): a view, or decoded through the LRU."""
        key = (self.path, col, name, b)
        hit = self.reader._cached(key)
        if hit is not None:
            return hit
        off, stored, raw = self.entry.layout["columns"][col]["segments"][name][b]
        if not self.compressed:
            return np.frombuffer(self.map, np.uint8, raw, self.base + off)
        start = self.base + off
        arr = np.empty(raw, np.uint8)  # decoded straight into a writable array
        try:
            got = _decode_into(memoryview(self.map)[start : start + stored], arr)
        except Exception as e:  # zstd raises ZstdError on a damaged or truncated frame
            raise self.fail(f"block {b} of {name!r} in column {col} does not decode ({e})") from e
        if got != raw:
            raise self.fail(f"block {b} of {name!r} in column {col} decodes to {got} bytes")
        self.reader._store(key, arr)
        return arr

    def prefetch(self, rows: np.ndarray) -> None:
        """Decode the data blocks ``rows`` need and the cache lacks, in the reader's threads
        (zstd drops the GIL, so a batch touching many blocks decodes them side by side)."""
        blocks = np.unique(rows // self.block_rows).tolist()
        cached = self.reader._blocks
        missing = [
            (c, b)
            for c in range(len(self.columns))
            for b in blocks
            if (self.path, c, "data", b) not in cached
        ]
        pool = self.reader._pool() if len(missing) > 1 else None
        if pool is not None:
            for _ in pool.map(lambda cb: self.block(cb[0], "data", cb[1]), missing):
                pass


class _FixedColumn:
    """Rows of one shape: ``[rows, *shape]`` in blocks of ``block_rows`` rows."""

    def __init__(self, shard: _Shard, col: int, spec: FieldSpec, layout: dict[str, Any]):
        self.shard, self.col, self.spec = shard, col, spec
        self.dtype = spec.storage_dtype
        self.shape = tuple(int(s) for s in layout["shape"])
        self.row_bytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        rows, per = shard.entry.rows, shard.block_rows
        data = layout["segments"]["data"]
        sizes = [min(per, rows - b * per) * self.row_bytes for b in range(len(data))]
        if sum(sizes) != rows * self.row_bytes or [d[2] for d in data] != sizes:
            raise shard.fail(f"column {spec.name!r} blocks do not hold {rows} rows")
        self.array = None
        if not shard.compressed:
            self.array = shard.whole(data).view(self.dtype).reshape(rows, *self.shape)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        if self.array is not None:
            return self.array[rows]
        per, block = self.shard.block_rows, self.shard.block
        out = np.empty((len(rows), *self.shape), self.dtype)
        decoded: dict[int, np.ndarray] = {}  # the blocks this call touches, typed
        for j, r in enumerate(rows.tolist()):
            b = r // per
            arr = decoded.get(b)
            if arr is None:
                arr = decoded[b] = block(self.col, "data", b).view(self.dtype)
                arr = decoded[b] = arr.reshape(-1, *self.shape)
            out[j] = arr[r - b * per]
        return out

    def values(self, rows: np.ndarray) -> list[Any]:
        arr = self.gather(rows)
        kind = self.spec.kind
        if kind in ("int", "float", "bool"):
            return list(arr.tolist())
        if kind == "tensor":
            t = torch.from_numpy(arr)
            if self.spec.dtype == "bfloat16":
                t = t.view(torch.bfloat16)
            return list(t.unbind(0))
        if kind == "ndarray" and not self.shape:
            return [arr[i, ...] for i in range(len(arr))]  # 0-d arrays, as written
        return list(arr)


class _VarColumn:
    """Rows of varying length: a flat ``data`` segment sliced through ``offsets``."""

    def __init__(self, shard: _Shard, col: int, spec: FieldSpec, layout: dict[str, Any]):
        self.shard, self.col, self.spec = shard, col, spec
        self.dtype = spec.storage_dtype
        rows, per = shard.entry.rows, shard.block_rows
        segs = layout["segments"]
        self.offsets = self._int64(segs["offsets"], "offsets", rows + 1)
        o = self.offsets
        if o[0] != 0 or bool(np.any(o[1:] < o[:-1])):
            raise shard.fail(f"column {spec.name!r} offsets are not increasing from 0")
        self.shapes: list[tuple[int, ...]] | None = None
        if "shapes" in segs:
            shapes = self._int64(segs["shapes"], "shapes", rows * spec.ndim).reshape(rows, -1)
            if bool(np.any(shapes < 0)) or not np.array_equal(shapes.prod(axis=1), np.diff(o)):
                raise shard.fail(f"column {spec.name!r} shapes disagree with its offsets")
            self.shapes = [tuple(s) for s in shapes.tolist()]
        data = segs["data"]
        ends = [int(o[min((b + 1) * per, rows)] - o[b * per]) for b in range(len(data))]
        if [d[2] for d in data] != [e * self.dtype.itemsize for e in ends] or sum(ends) != o[-1]:
            raise shard.fail(f"column {spec.name!r} data blocks disagree with its offsets")
        self.data = None if shard.compressed else shard.whole(data).view(self.dtype)

    def _int64(self, segment: list[list[int]], name: str, count: int) -> np.ndarray:
        raw = self.shard.block(self.col, name, 0) if segment else np.empty(0, np.uint8)
        if len(segment) != 1 or raw.nbytes != count * 8:
            raise self.shard.fail(f"column {self.spec.name!r} {name} are not {count} int64")
        return raw.view(np.int64).copy()

    def slices(self, rows: np.ndarray) -> list[np.ndarray]:
        starts = self.offsets[rows].tolist()
        ends = self.offsets[rows + 1].tolist()
        if self.data is not None:
            data = self.data
            out = [data[a:e] for a, e in zip(starts, ends, strict=True)]
        else:
            per, o, block = self.shard.block_rows, self.offsets, self.shard.block
            decoded: dict[int, tuple[int, np.ndarray]] = {}  # block -> (first element, data)
            out = []
            for r, a, e in zip(rows.tolist(), starts, ends, strict=True):
                b = r // per
                hit = decoded.get(b)
                if hit is None:
                    hit = decoded[b] = (
                        int(o[b * per]),
                        block(self.col, "data", b).view(self.dtype),
                    )
                base, blk = hit
                out.append(blk[a - base : e - base])
        if self.shapes is not None:
            shapes = self.shapes
            out = [a.reshape(shapes[r]) for a, r in zip(out, rows.tolist(), strict=True)]
        return out

    def values(self, rows: np.ndarray) -> list[Any]:
        parts = self.slices(rows)
        kind = self.spec.kind
        if kind == "str":
            try:
                return [p.tobytes().decode("utf-8") for p in parts]
            except UnicodeDecodeError as e:
                raise self.shard.fail(f"column {self.spec.name!r} holds invalid UTF-8") from e
        if kind == "bytes":
            return [p.tobytes() for p in parts]
        if kind == "tensor":
            if self.spec.dtype == "bfloat16":
                return [torch.from_numpy(p).view(torch.bfloat16) for p in parts]
            return [torch.from_numpy(p) for p in parts]
        return parts


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
    the blocks one batch needs side by side (1: decode in the calling thread only). ``verify=True`` hashes each shard on its first open in each process (reads the
    whole file: about 1 GB/s per core); by default only sizes, headers and offsets are checked.
    """

    def __init__(
        self,
        *,
        verify: bool = False,
        cache_bytes: int = CACHE_BYTES,
        max_open: int = 64,
        threads: int = 2,
    ) -> None:
        if cache_bytes < 0 or max_open < 1 or threads < 1:
            raise ValueError(
                "cache_bytes must be >= 0, max_open and threads >= 1 (got "
                f"{cache_bytes=}, {max_open=}, {threads=})"
            )
        self.verify, self.cache_bytes, self.max_open = verify, cache_bytes, max_open
        self.threads = threads
        self.index: ShardIndex | None = None
        self._indexes: dict[str, ShardIndex] = {}
        # A local dataset's index.json mtime: a shard changed after it is hashed on open.
        self._written: dict[str, int] = {}
        self._reset()

    def _reset(self) -> None:
        self._entries: dict[str, tuple[ShardIndex, ShardEntry]] = {}
        self._by_name: dict[str, dict[str, ShardEntry]] = {}  # per folder: file -> entry
        self._index_mtimes: dict[str, int] = {}
        self._open: OrderedDict[str, _Shard] = OrderedDict()
        self._blocks: OrderedDict[_BlockKey, np.ndarray] = OrderedDict()
        self._held = 0
        self._lock = threading.RLock()
        self._threads: cf.ThreadPoolExecutor | None = None

    @classmethod
    def from_index(cls, path: str | os.PathLike[str], **options: Any) -> ShardFormatReader:
        """A reader with ``path``'s index read and checked now; each shard's size (and with
        ``verify=True`` its hash) is checked when it is first opened, so a rank touches only
        the files it reads (#32); ``options`` as for the constructor."""
        reader = cls(**options)
        index = reader.index = read_index(path, check_files=False)
        root = os.path.abspath(index.root)
        reader._indexes[root] = index
        reader._written[root] = os.stat(Path(root) / INDEX_NAME).st_mtime_ns
        # Its own shards are found by the path it hands out, without a path walk per shard.
        paths = zip(index.paths, index.shards, strict=True)
        reader._entries.update((p, (index, e)) for p, e in paths)
        return reader

    @property
    def shards(self) -> list[str]:
        """The shard paths of :meth:`from_index`'s index, in order."""
        if self.index is None:
            raise ValueError("this reader has no index; build it with from_index(path)")
        return self.index.paths

    def __getstate__(self) -> dict[str, Any]:
        keep = ("verify", "cache_bytes", "max_open", "threads", "index", "_indexes", "_written")
        return {k: getattr(self, k) for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._reset()

    def _entry(self, shard: Any) -> tuple[ShardIndex, ShardEntry]:
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
                    by_name = self._by_name[folder] = {s.file: s for s in index.shards}
            entry = by_name.get(name)
            if entry is None:
                raise SourceError(f"shard {key} is not listed in {folder}/index.json")
            found = self._entries[key] = (index, entry)
        return found

    def _shard(self, shard: Any) -> _Shard:
        key = os.fspath(shard)
        with self._lock:
            opened = self._open.get(key)
            if opened is not None:
                self._open.move_to_end(key)
                return opened
            index, entry = self._entry(shard)
            opened = self._open[key] = _Shard(self, key, index, entry)
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)  # maps close once their views are gone
            return opened

    def _pool(self) -> cf.ThreadPoolExecutor | None:
        """The decode threads (made on first need, in the process that uses them)."""
        if self.threads < 2:
            return None
        with self._lock:
            if self._threads is None:
                self._threads = cf.ThreadPoolExecutor(self.threads, "meshfeed-shard-decode")
            return self._threads

    def _cached(self, key: _BlockKey) -> np.ndarray | None:
        # No lock on this path: get and move_to_end are single C calls under the GIL; a
        # block evicted by another thread in between is just decoded again.
        hit = self._blocks.get(key)
        if hit is not None:
            with contextlib.suppress(KeyError):
                self._blocks.move_to_end(key)
        return hit

    def _store(self, key: _BlockKey, arr: np.ndarray) -> None:
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = arr
            self._held += arr.nbytes
            while self._held > self.cache_bytes and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self._held -= old.nbytes

    def count(self, shard: Any) -> int:
        """Rows in ``shard``, from its index (no shard I/O)."""
        return self._entry(shard)[1].rows

    def modified(self, shard: Any) -> int:
        """When the dataset of ``shard`` was written: its ``index.json``'s mtime in ns (one
        ``stat`` per dataset, not per shard, #32; write_shards writes the index last, and a
        shard changed in place is refused when it is opened)."""
        index, _ = self._entry(shard)
        folder = os.path.abspath(index.root)
        mtime = self._index_mtimes.get(folder)
        if mtime is None:
            mtime = self._index_mtimes[folder] = os.stat(Path(folder) / INDEX_NAME).st_mtime_ns
        return mtime

    def version(self, shard: Any) -> str:
        """The shard's content hash as its index records it: ``"blake2b-128:<hex>"``."""
        return self.version_of_entry(self._entry(shard)[1])

    @staticmethod
    def version_of_entry(entry: ShardEntry) -> str:
        """:meth:`version` of an index entry."""
        return "blake2b-128:" + entry.hash

    def forget(self, shard: Any) -> None:
        """Drop this reader's map of ``shard`` (its cached copy is being released, and may be
        evicted: a map would keep its blocks on disk); values already read stay valid."""
        key = os.fspath(shard)
        with self._lock:
            self._open.pop(key, None)

    def take(self, shard: Any, rows: Any) -> list[Any]:
        """The samples at ``rows`` of ``shard``, in the order given (repeats allowed)."""
        opened = self._shard(shard)
        idx = np.asarray(rows)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise TypeError(f"rows must be a 1-D integer array (got {idx.dtype} {idx.shape})")
        idx = idx.astype(np.int64, copy=False)
        n = opened.entry.rows
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise IndexError(f"row {bad} is outside shard {os.fspath(shard)} ({n} rows)")
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
        step = max(1, int(self._entry(shard)[1].layout.get("block_rows", 256)))
        for lo in range(max(0, start_row), stop, step):
            yield from self.take(shard, np.arange(lo, min(lo + step, stop), dtype=np.int64))


def _decode_into(frame: bytes | memoryview, out: np.ndarray) -> int:
    """Decode one zstd frame into ``out``; the bytes written (checksum checked at the end)."""
    view, n = out.data, 0
    with _zstd().ZstdDecompressor().stream_reader(frame) as src:
        while n < len(view) and (k := src.readinto(view[n:])):
            n += k
        if src.read(1):
            return n + 1  # more data than the index records
    return n


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as e:
        raise ImportError(
            'compressed meshfeed shards need zstandard: pip install "meshfeed[zstd]"'
        ) from e
    return zstandard
