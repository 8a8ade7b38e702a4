"""Encoding meshfeed shards: samples cut into shards, each shard encoded into one file, then
the dataset's index (the format is in :mod:`.format`; :func:`.write.write_shards` is the
public door).

The parent process cuts the stream into shards (by rows and/or bytes), so the shards do not
depend on ``num_workers``; workers (a thread, or processes) encode whole shards: columns, zstd
blocks, the hash, the file. The bytes are a function of the samples and the options alone: no
timestamps, JSON with sorted keys, a fixed zstd level, single-threaded frames.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.sources.shards.format import (
    ALIGN,
    INDEX_NAME,
    MAGIC,
    PREAMBLE,
    VERSION,
    FieldSpec,
    ShardIndex,
    compact_json,
    write_index,
)
from meshfeed.sources.shards.samples import Schema, chunks

__all__ = ["Options", "encode_dataset", "fsync_dir", "zstd_level"]

#: ``compression="zstd"``'s level. Level 1 compressed token and pixel blocks 5-9x faster than
#: level 3 here, to within 2 % of its size (bench_shards); "zstd:3" etc. pick another level.
ZSTD_LEVEL = 1
_BLOCK_BYTES = 1 << 20  # automatic block_rows: about this many raw bytes per block


@dataclass(frozen=True, kw_only=True, slots=True)
class _Task:
    """One shard to encode, as sent to a worker."""

    path: str
    fields: tuple[FieldSpec, ...]
    columns: list[list[Any]]
    compression: str | None
    block_rows: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class _Column:
    """A column ready to lay out: one array (scalars), or one byte buffer per row."""

    layout: dict[str, Any]
    array: np.ndarray | None = None
    rows: list[Any] | None = None  # bytes-like, one per row (never concatenated: no copy)
    lengths: np.ndarray | None = None  # elements per row (var)
    shapes: np.ndarray | None = None  # per-row shapes (var, ndim >= 2)
    itemsize: int = 1

    @property
    def nbytes(self) -> int:
        return self.array.nbytes if self.array is not None else sum(map(len, self.rows or []))


def _column(spec: FieldSpec, values: list[Any]) -> _Column:
    if spec.kind in ("int", "float", "bool"):
        try:
            array = np.asarray(values, dtype=spec.dtype)
        except OverflowError as e:
            raise TypeError(f"field {spec.name!r}: an int outside int64 ({e})") from e
        return _Column(layout={"store": "fixed", "shape": []}, array=array)
    if spec.kind in ("str", "bytes"):
        lengths = np.fromiter(map(len, values), np.int64, len(values))
        return _Column(layout={"store": "var"}, rows=values, lengths=lengths)
    first = values[0].shape
    if not first:  # 0-d arrays and numpy scalars: one small array
        return _Column(layout={"store": "fixed", "shape": []}, array=np.stack(values))
    # C-contiguous, ndim >= 1; memoryview cannot cast an empty array (a zero in its shape)
    rows = [memoryview(v).cast("B") if v.size else b"" for v in values]
    if all(v.shape == first for v in values):
        return _Column(layout={"store": "fixed", "shape": list(first)}, rows=rows)
    return _Column(
        layout={"store": "var"},
        rows=rows,
        lengths=np.fromiter((v.size for v in values), np.int64, len(values)),
        shapes=None if spec.ndim == 1 else np.asarray([v.shape for v in values], np.int64),
        itemsize=values[0].itemsize,
    )


class _Payload:
    """Segments appended at aligned offsets, compressed per block when asked."""

    def __init__(self, compression: str | None) -> None:
        self.parts: list[bytes | memoryview] = []
        self.size = 0
        self.cctx = None
        level = zstd_level(compression)
        if level is not None:
            from meshfeed.sources.shards.open_shard import zstd_module

            self.cctx = zstd_module().ZstdCompressor(level=level, write_checksum=True)

    def _block(self, raw: memoryview) -> list[int]:
        stored: bytes | memoryview = raw if self.cctx is None else self.cctx.compress(raw)
        block = [self.size, len(stored), len(raw)]
        self.parts.append(stored)
        self.size += len(stored)
        return block

    def _align(self) -> None:
        pad = -self.size % ALIGN
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad

    def segment(self, raw: np.ndarray, cuts: list[int]) -> list[list[int]]:
        """Blocks of ``raw`` cut at byte offsets ``cuts`` (0 .. its length), back to back
        from the next aligned offset (so uncompressed blocks tile one aligned segment)."""
        self._align()
        view = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).data
        return [self._block(view[a:b]) for a, b in itertools.pairwise(cuts)]

    def rows(self, rows: list[Any], starts: list[int]) -> list[list[int]]:
        """Blocks of the row buffers ``rows[a:b]`` for consecutive ``a, b`` of ``starts``.

        Rows are joined a block at a time (one copy of about a block, never of the shard)."""
        self._align()
        return [self._block(memoryview(b"".join(rows[a:b]))) for a, b in itertools.pairwise(starts)]


def _encode(task: _Task) -> dict[str, Any]:
    """Write one shard file (fsynced) and return its index entry."""
    rows = len(task.columns[0])
    encoded = [_column(f, v) for f, v in zip(task.fields, task.columns, strict=True)]
    per = task.block_rows
    if per is None:
        per = max(1, min(rows, _BLOCK_BYTES * rows // max(1, sum(c.nbytes for c in encoded))))
    starts = [*range(0, rows, per), rows]
    payload = _Payload(task.compression)
    columns = []
    for col in encoded:
        segments: dict[str, list[list[int]]] = {}
        if col.lengths is not None:
            offsets = np.zeros(rows + 1, np.int64)
            np.cumsum(col.lengths, out=offsets[1:])
            segments["offsets"] = payload.segment(offsets, [0, offsets.nbytes])
            if col.shapes is not None:
                segments["shapes"] = payload.segment(col.shapes, [0, col.shapes.nbytes])
        if col.array is not None:
            row_bytes = col.array.nbytes // rows
            segments["data"] = payload.segment(col.array, [r * row_bytes for r in starts])
        else:
            segments["data"] = payload.rows(col.rows or [], starts)
        columns.append({**col.layout, "segments": segments})
    layout = {"rows": rows, "block_rows": per, "columns": columns}
    text = compact_json(layout)  # the header; the index repeats it as text
    header = text.encode()
    head = PREAMBLE.pack(MAGIC, VERSION, len(header)) + header
    head += b"\0" * (-len(head) % ALIGN)
    digest = hashlib.blake2b(digest_size=16)
    with open(task.path, "wb") as f:
        for part in [head, *payload.parts]:
            digest.update(part)
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    return {
        "file": os.path.basename(task.path),
        "rows": rows,
        "bytes": len(head) + payload.size,
        "hash": digest.hexdigest(),
        "payload": len(head),
        "layout": text,
    }


def zstd_level(compression: str | None) -> int | None:
    """The zstd level of ``None`` / ``"zstd"`` / ``"zstd:N"`` (``None``: uncompressed)."""
    if compression is None:
        return None
    name, _, level = compression.partition(":") if isinstance(compression, str) else ("", "", "")
    if name == "zstd" and not level:
        return ZSTD_LEVEL
    if name == "zstd" and level.isdigit() and 1 <= int(level) <= 22:
        return int(level)
    raise ValueError(
        f"compression must be None, 'zstd' (level {ZSTD_LEVEL}) or 'zstd:N' with N in 1..22 "
        f"(got {compression!r})"
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _done(
    future: cf.Future[dict[str, Any]], tmp: Path, on_shard: Callable[[Path], None] | None
) -> dict[str, Any]:
    """The index entry of a written shard, handed to ``on_shard`` first (in shard order)."""
    entry = future.result()
    if on_shard is not None:
        on_shard(tmp / entry["file"])
    return entry


def _encode_all(
    cut: Iterator[tuple[Schema, list[list[Any]]]],
    tmp: Path,
    o: Options,
    on_shard: Callable[[Path], None] | None,
) -> tuple[Schema | None, list[dict[str, Any]]]:
    schema: Schema | None = None
    entries: list[dict[str, Any]] = []

    def tasks() -> Iterator[_Task]:
        nonlocal schema
        for n, (schema, columns) in enumerate(cut):
            yield _Task(
                path=str(tmp / f"{o.stem}-{n:05d}.mfs"),
                fields=tuple(schema.fields),
                columns=columns,
                compression=o.compression,
                block_rows=o.block_rows,
            )

    pool: cf.Executor
    if o.num_workers == 1:
        # One encoder thread: zstd, blake2b and the file write release the GIL, so a shard is
        # encoded while the next one is cut from the samples; nothing is pickled.
        pool = cf.ThreadPoolExecutor(1, thread_name_prefix="meshfeed-shards")
    else:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        pool = cf.ProcessPoolExecutor(o.num_workers, mp_context=mp.get_context(method))
    with pool:
        pending: list[cf.Future[dict[str, Any]]] = []
        try:
            for task in tasks():
                pending.append(pool.submit(_encode, task))
                while len(pending) > max(2, 2 * o.num_workers) - 1:  # bound shards in memory
                    entries.append(_done(pending.pop(0), tmp, on_shard))
            entries.extend(_done(f, tmp, on_shard) for f in pending)
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    return schema, entries


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """write_shards' options, checked."""

    rows_per_shard: int | None
    bytes_per_shard: int | None
    compression: str | None
    block_rows: int | None
    num_workers: int
    stem: str = "shard"  # shard files are STEM-00000.mfs, ...


def encode_dataset(
    samples: Iterable[Any], tmp: Path, o: Options, on_shard: Callable[[Path], None] | None
) -> None:
    """Every shard, then ``index.json``, into the folder ``tmp`` (each file fsynced)."""
    cut = chunks(samples, o.rows_per_shard, o.bytes_per_shard)
    schema, entries = _encode_all(cut, tmp, o, on_shard)
    if schema is None:  # chunks() raises first on no samples; kept for the type
        raise ValueError("no samples to write")
    index = ShardIndex(
        root=tmp,
        sample="bare" if schema.bare else "dict",
        fields=tuple(schema.fields),
        compression=None if o.compression is None else "zstd",
        files=[e["file"] for e in entries],
        rows=np.asarray([e["rows"] for e in entries], np.int64),
        sizes=np.asarray([e["bytes"] for e in entries], np.int64),
        hashes=[e["hash"] for e in entries],
        payloads=np.asarray([e["payload"] for e in entries], np.int64),
        layouts=[e["layout"] for e in entries],
    )
    write_index(index, tmp / INDEX_NAME)
    fsync_dir(tmp)
