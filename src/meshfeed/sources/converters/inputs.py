"""The inputs of ``meshfeed convert`` (:mod:`meshfeed.sources.converters.convert`), read a chunk of records
at a time: JSONL (optionally gzipped) lines, a Parquet column in record batches, the rows of a
``.npy`` integer array. A chunk knows where each of its records came from (``path:line`` or
``path row N``), for the messages that name a bad record, and how far into the input it reaches,
for the progress bar.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from meshfeed.mapped import check_mapped
from meshfeed.storage.urls import local_only

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_RECORDS",
    "FORMATS",
    "input_paths",
    "jsonl_lines",
    "parse_json",
    "token_ids",
]

FORMATS = ("auto", "jsonl", "parquet", "npy")
#: Input bytes (JSONL) or records per work item; a few per worker keep every worker busy.
CHUNK_BYTES = 1 << 16
CHUNK_RECORDS = 1024


def input_paths(inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The input files of a conversion, each checked to exist; a URL is refused by name."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not items:
        raise ValueError("no inputs given; pass at least one JSONL, Parquet or .npy file")
    paths = [
        local_only(p, what="meshfeed convert", fix="download the input first, then convert it")
        for p in items
    ]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input {p} does not exist")
    return paths


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


_GZIP_MAGIC = b"\x1f\x8b"
#: What a broken gzip stream raises: gzip.BadGzipFile (an OSError), zlib.error, EOFError.
_GZIP_ERRORS = (OSError, EOFError, zlib.error)


def _is_gzip(raw: BinaryIO) -> bool:
    """Whether the file is gzip-compressed: by its first bytes, whatever its name says."""
    head = raw.read(2)
    raw.seek(0)
    return head == _GZIP_MAGIC


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes, int]]:
    """``(line number, line, bytes of the file read so far)`` of a JSONL file, gzipped or not.

    A truncated or corrupt gzip stream, or a ``.gz`` name on a file that is not gzip, raises
    ``ValueError`` naming the file and the last line read, never a bare ``EOFError``.
    """
    with open(path, "rb") as raw:
        gz = _is_gzip(raw)
        if path.suffix == ".gz" and not gz:
            raise ValueError(
                f"{path} is named .gz but is not gzip-compressed; rename it without .gz or "
                "compress it with gzip"
            )
        stream: Any = gzip.GzipFile(fileobj=raw) if gz else raw
        line_no = 0
        try:
            for line_no, line in enumerate(stream, 1):
                yield line_no, line, raw.tell()
        except _GZIP_ERRORS as e:
            if not gz:
                raise
            raise ValueError(
                f"{path}: the gzip stream is broken after line {line_no} ({type(e).__name__}: "
                f"{e}); the file is truncated or corrupt: copy or compress it again"
            ) from e


def _jsonl_chunks(path: Path) -> Iterator[_Chunk]:
    items: list[tuple[int, Any]] = []
    size = done = 0
    for line_no, line, done in jsonl_lines(path):
        if line.strip():
            items.append((line_no, line))
            size += len(line)
        if size >= CHUNK_BYTES or len(items) >= CHUNK_RECORDS:
            yield _Chunk(str(path), "jsonl", items, done)
            items, size = [], 0
    if items:
        yield _Chunk(str(path), "jsonl", items, done)


def _parquet_chunks(path: Path, field: str) -> Iterator[_Chunk]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("converting Parquet needs pyarrow: pip install meshfeed[parquet]") from e
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path} is not a readable Parquet file ({e}); check or rewrite it") from e
    if field not in pf.schema_arrow.names:
        raise ValueError(
            f"{path} has no column {field!r} (columns: {pf.schema_arrow.names}); pass --field NAME"
        )
    total, size, row = max(1, pf.metadata.num_rows), path.stat().st_size, 0
    batches = pf.iter_batches(columns=[field], batch_size=CHUNK_RECORDS)
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as e:  # a corrupt page: the rows after `row`
            raise ValueError(f"{path} row {row}: a corrupt Parquet page ({e})") from e
        if batch is None:
            return
        values = batch.column(0).to_pylist()
        items = list(enumerate(values, row))
        row += len(values)
        yield _Chunk(str(path), "parquet", items, size * row // total)


def _npy_chunks(path: Path) -> Iterator[_Chunk]:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # a bad header, objects, a short file
        raise ValueError(
            f"{path} is not a readable .npy integer array ({e}); save it with np.save from an "
            "integer array"
        ) from e
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
    return _npy_chunks(path)  # convert() refused any other format, _detect() resolved "auto"


def _chunks(paths: list[Path], formats: list[str], field: str) -> Iterator[_Chunk]:
    """Every file's chunks in order; ``done_bytes`` counts from the start of the first file."""
    base = 0
    for path, fmt in zip(paths, formats, strict=True):
        for chunk in _file_chunks(path, fmt, field):
            yield _Chunk(chunk.path, chunk.fmt, chunk.items, base + chunk.done_bytes)
        base += path.stat().st_size


def parse_json(line: bytes | str, where: str) -> Any:
    """One JSON value; bad JSON, bad UTF-8 and too deep nesting raise ``ValueError`` at ``where``."""
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} is not valid JSON ({e})") from e
    except RecursionError:
        raise ValueError(
            f"{where} nests lists or objects deeper than the JSON reader allows (about "
            f"{sys.getrecursionlimit()} levels); flatten the record"
        ) from None


def _json_value(chunk: _Chunk, i: int, field: str) -> Any:
    value = parse_json(chunk.items[i][1], chunk.where(i))
    if isinstance(value, dict):
        if field not in value:
            raise ValueError(
                f"{chunk.where(i)} has no field {field!r} (keys: {sorted(value)}); pass "
                "--field NAME"
            )
        value = value[field]
    return value


def token_ids(value: list[Any], where: str) -> np.ndarray:
    """A document's token ids from a list of ints (JSON, Parquet); anything else is refused.

    ``true`` / ``false``, floats, strings, ``null`` and nested (or ragged) lists are refused
    by name: numpy would silently read ``true`` as 1.
    """
    kinds = set(map(type, value))
    if kinds - {int}:
        bad = next(v for v in value if type(v) is not int)
        raise ValueError(
            f"{where}: a document holds {type(bad).__name__} {bad!r:.40}; token ids are a flat "
            "list of integers (no booleans, floats, strings, nulls or nested lists): fix the "
            "record, or give text with --tokenizer"
        )
    ids = np.asarray(value) if value else np.zeros(0, np.int64)
    if ids.dtype == object:  # ints beyond int64
        raise ValueError(
            f"{where}: a token id lies outside int64 (max {max(value)}, min {min(value)}); "
            "fix the record"
        )
    return ids
