"""One open meshfeed shard file: its map, header check and columns (:class:`OpenShard`), and
the bounded LRU of decoded blocks its reads share (:class:`BlockCache`).

:class:`~meshfeed.sources.shards.read.ShardFormatReader` opens a shard here on its first read
in a process. Opening checks the file against its index entry (size, with ``verify`` or a
newer mtime the hash), the preamble, the header (equal to the index's layout) and that every
block lies inside the file; any fault is a :class:`~meshfeed.errors.SourceError` naming the
shard. Uncompressed columns are read-only views of the file's map; compressed blocks are
decoded through the cache and kept read-only. Every value handed out is the caller's own memory
(a gather, or a copy of a variable-length row), so editing a sample in place never changes what
a later read of that row returns, in any reader of this process.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshfeed.errors import SourceError
from meshfeed.sources.shards.format import (
    MAGIC,
    PREAMBLE,
    VERSION,
    FieldSpec,
    ShardEntry,
    ShardIndex,
    check_file,
    shard_file_hash,
)

__all__ = ["BlockCache", "OpenShard", "zstd_module"]

_BlockKey = tuple[str, int, str, int]  # shard path, column, segment, block


class BlockCache:
    """Decoded blocks of compressed shards, least recently used evicted past ``cache_bytes``
    (one block is always kept), and the ``threads`` that decode a batch's blocks side by side
    (made on first need, in the process that uses them; 1: decode in the calling thread)."""

    def __init__(self, cache_bytes: int, threads: int) -> None:
        self.cache_bytes, self.threads = cache_bytes, threads
        self._blocks: OrderedDict[_BlockKey, np.ndarray] = OrderedDict()
        self._held = 0
        self._fresh()

    def _fresh(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._threads: cf.ThreadPoolExecutor | None = None

    def _check_fork(self) -> None:
        # A forked worker inherits the parent's pool without its threads: work submitted
        # there would wait forever (an idle thread the pool counts is not in this process),
        # and the lock may have been held at the fork. It starts its own.
        if self._pid != os.getpid():
            self._fresh()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def held(self) -> int:
        """Bytes of the decoded blocks held."""
        return self._held

    def __contains__(self, key: _BlockKey) -> bool:
        return key in self._blocks

    def get(self, key: _BlockKey) -> np.ndarray | None:
        # No lock on this path: get and move_to_end are single C calls under the GIL; a
        # block evicted by another thread in between is just decoded again.
        hit = self._blocks.get(key)
        if hit is not None:
            with contextlib.suppress(KeyError):
                self._blocks.move_to_end(key)
        return hit

    def put(self, key: _BlockKey, arr: np.ndarray) -> None:
        self._check_fork()
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = arr
            self._held += arr.nbytes
            while self._held > self.cache_bytes and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self._held -= old.nbytes

    def pool(self) -> cf.ThreadPoolExecutor | None:
        if self.threads < 2:
            return None
        self._check_fork()
        with self._lock:
            if self._threads is None:
                self._threads = cf.ThreadPoolExecutor(self.threads, "meshfeed-shard-decode")
            return self._threads


class OpenShard:
    """One open shard in this process: its map, header and columns."""

    def __init__(
        self,
        path: str,
        index: ShardIndex,
        entry: ShardEntry,
        *,
        blocks: BlockCache,
        verify: bool,
        written_ns: int | None,
    ) -> None:
        self.path, self.entry, self.blocks = path, entry, blocks
        self.compressed = index.compression is not None
        check_file(Path(path), entry, verify=verify, written_ns=written_ns)
        try:
            with open(path, "rb") as f:
                # read-only: a view of it that reached a caller could not change later reads
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                st = os.fstat(f.fileno())
        except OSError as e:  # unreadable (permissions, I/O): never a bad sample to substitute
            raise SourceError(f"cannot read shard {path}: {e}") from e
        #: The mapped file: each read checks it is unchanged (one stat of the path)
        self._identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
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

    def check_unchanged(self) -> None:
        """Raise :class:`SourceError` if the mapped file changed since it was opened: a
        shorter file would end the process (SIGBUS) at the first read past its end, one
        written in place would serve other rows. A new mtime with the same size and content
        hash (``touch``) is accepted; so is a file deleted, or replaced by a rename, since:
        the map reads the file it opened, whole."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise SourceError(f"cannot read shard {self.path}: {e}") from e
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if now == self._identity or now[:2] != self._identity[:2]:
            return
        if st.st_size != self._identity[2] or shard_file_hash(Path(self.path)) != self.entry.hash:
            then = self._identity[2]
            how = (
                f"{then} bytes when opened, {st.st_size} now"
                if st.st_size != then
                else "its size kept, its content hash changed"
            )
            raise SourceError(
                f"shard {self.path} changed while open ({how}): it was truncated or written "
                "in place; write a dataset under a new folder, or replace it with "
                "write_shards(..., overwrite=True), which renames new files in, then build "
                "the stream again"
            )
        self._identity = now

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
        """Block ``b`` of a segment, raw (``uint8``, read-only: shared by every read of it): a
        view of the map, or decoded through the LRU."""
        key = (self.path, col, name, b)
        hit = self.blocks.get(key)
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
        arr.flags.writeable = False  # cached for every later read: never a caller's to edit
        self.blocks.put(key, arr)
        return arr

    def prefetch(self, rows: np.ndarray) -> None:
        """Decode the data blocks ``rows`` need and the cache lacks, in the reader's threads
        (zstd drops the GIL, so a batch touching many blocks decodes them side by side)."""
        blocks = np.unique(rows // self.block_rows).tolist()
        cached = self.blocks
        missing = [
            (c, b)
            for c in range(len(self.columns))
            for b in blocks
            if (self.path, c, "data", b) not in cached
        ]
        pool = cached.pool() if len(missing) > 1 else None
        if pool is not None:
            for _ in pool.map(lambda cb: self.block(cb[0], "data", cb[1]), missing):
                pass


class _FixedColumn:
    """Rows of one shape: ``[rows, *shape]`` in blocks of ``block_rows`` rows. A read gathers
    its rows into a new array (the values it returns are views of that array alone)."""

    def __init__(self, shard: OpenShard, col: int, spec: FieldSpec, layout: dict[str, Any]):
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
        total = self.shard.entry.rows
        out = np.empty((len(rows), *self.shape), self.dtype)
        decoded: dict[int, np.ndarray] = {}  # the blocks this call touches, typed
        for j, r in enumerate(rows.tolist()):
            b = r // per
            arr = decoded.get(b)
            if arr is None:
                arr = block(self.col, "data", b).view(self.dtype)
                # the block's row count, not -1: rows of no elements (a 0 in the shape) too
                arr = decoded[b] = arr.reshape(min(per, total - b * per), *self.shape)
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
    """Rows of varying length: a flat ``data`` segment sliced through ``offsets``. Array and
    tensor values are copies of their slices (a slice is a view of the map or of a cached
    block, shared by every read of the row)."""

    def __init__(self, shard: OpenShard, col: int, spec: FieldSpec, layout: dict[str, Any]):
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
        """The rows' read-only views of the map or of cached blocks (see :meth:`values`)."""
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
        parts = [p.copy() for p in parts]  # the caller's own memory, as torch's loader hands out
        if kind == "tensor":
            if self.spec.dtype == "bfloat16":
                return [torch.from_numpy(p).view(torch.bfloat16) for p in parts]
            return [torch.from_numpy(p) for p in parts]
        return parts


def _decode_into(frame: bytes | memoryview, out: np.ndarray) -> int:
    """Decode one zstd frame into ``out``; the bytes written (checksum checked at the end)."""
    view, n = out.data, 0
    with zstd_module().ZstdDecompressor().stream_reader(frame) as src:
        while n < len(view) and (k := src.readinto(view[n:])):
            n += k
        if src.read(1):
            return n + 1  # more data than the index records
    return n


def zstd_module() -> Any:
    try:
        import zstandard
    except ImportError as e:
        raise ImportError(
            'compressed meshfeed shards need zstandard: pip install "meshfeed[zstd]"'
        ) from e
    return zstandard
