"""The inputs of ``meshfeed convert`` (:mod:`meshfeed.sources.convert`), read a chunk of records
at a time: JSONL (optionally gzipped) lines, a Parquet column in record batches, the rows of a
``.npy`` integer array. A chunk knows where each of its records came from (``path:line`` or
``path row N``), for the messages that name a bad record, and how far into the input it reaches,
for the progress bar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.mapped import check_mapped

__all__ = ["CHUNK_BYTES", "CHUNK_RECORDS", "FORMATS"]

FORMATS = ("auto", "jsonl", "parquet", "npy")
#: Input bytes (JSONL) or records per work item; a few per worker keep every worker busy.
CHUNK_BYTES = 1 << 16
CHUNK_RECORDS = 1024


def _detect(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffixes = path.suffixes
    if ".jsonl" in suffixes or ".json" in suffixes:
        return "jsonl"
    if ".parquet" in suffixes:
        return "parquet"
    if ".npy" in suffixes:
        return "npy"
    raise ValueError(
        f"cannot tell the format of {path} from its name; pass --format one of "
        f"{', '.join(FORMATS[1:])}"
    )


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Consecutive records of one file: JSONL ``(line_no, raw line)`` or ``(row, value)``."""

    path: str
    fmt: str
    items: list[tuple[int, Any]]
    done_bytes: int  # how far into the file (in its size on disk) this chunk reaches

    def where(self, i: int) -> str:
        number = self.items[i][0]
        return f"{self.path}:{number}" if self.fmt == "jsonl" else f"{self.path} row {number}"


def _jsonl_chunks(path: Path) -> Iterator[_Chunk]:
    with open(path, "rb") as raw:
        stream: Any = raw
        if path.suffix == ".gz":
            import gzip

            stream = gzip.GzipFile(fileobj=raw)
        items: list[tuple[int, Any]] = []
        size = 0
        for line_no, line in enumerate(stream, 1):
            if line.strip():
                items.append((line_no, line))
                size += len(line)
            if size >= CHUNK_BYTES or len(items) >= CHUNK_RECORDS:
                yield _Chunk(str(path), "jsonl", items, raw.tell())
                items, size = [], 0
        if items:
            yield _Chunk(str(path), "jsonl", items, raw.tell())


def _parquet_chunks(path: Path, field: str) -> Iterator[_Chunk]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("converting Parquet needs pyarrow: pip install meshfeed[parquet]") from e
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise ValueError(
            f"{path} has no column {field!r} (columns: {pf.schema_arrow.names}); pass --field NAME"
        )
    total, size, row = max(1, pf.metadata.num_rows), path.stat().st_size, 0
    for batch in pf.iter_batches(columns=[field], batch_size=CHUNK_RECORDS):
        values = batch.column(0).to_pylist()
        items = list(enumerate(values, row))
        row += len(values)
        yield _Chunk(str(path), "parquet", items, size * row // total)


def _npy_chunks(path: Path) -> Iterator[_Chunk]:
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2):
        raise ValueError(
            f"{path} holds a {arr.ndim}-D {arr.dtype} array; .npy input must be a 2-D "
            "integer array (one document per row) or a 1-D one (one document)"
        )
    rows = arr[None, :] if arr.ndim == 1 else arr
    size, n = path.stat().st_size, max(1, rows.shape[0])
    for start in range(0, rows.shape[0], CHUNK_RECORDS):
        stop = min(start + CHUNK_RECORDS, rows.shape[0])
        # one size check, then one copy out of the map: a file truncated meanwhile is a
        # SourceError naming it, not SIGBUS in the middle of a row
        check_mapped(rows)
        block = np.array(rows[start:stop])
        items = [(r, block[r - start]) for r in range(start, stop)]
        yield _Chunk(str(path), "npy", items, size * stop // n)


def _file_chunks(path: Path, fmt: str, field: str) -> Iterator[_Chunk]:
    if fmt == "jsonl":
        return _jsonl_chunks(path)
    if fmt == "parquet":
        return _parquet_chunks(path, field)
    if fmt == "npy":
        return _npy_chunks(path)
    raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def _chunks(paths: list[Path], formats: list[str], field: str) -> Iterator[_Chunk]:
    """Every file's chunks in order; ``done_bytes`` counts from the start of the first file."""
    base = 0
    for path, fmt in zip(paths, formats, strict=True):
        for chunk in _file_chunks(path, fmt, field):
            yield _Chunk(chunk.path, chunk.fmt, chunk.items, base + chunk.done_bytes)
        base += path.stat().st_size


def _json_value(chunk: _Chunk, i: int, field: str) -> Any:
    try:
        value = json.loads(chunk.items[i][1])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{chunk.where(i)} is not valid JSON ({e})") from e
    if isinstance(value, dict):
        if field not in value:
            raise ValueError(
                f"{chunk.where(i)} has no field {field!r} (keys: {sorted(value)}); pass "
                "--field NAME"
            )
        value = value[field]
    return value
