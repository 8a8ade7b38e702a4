"""``meshfeed convert --to shards``: JSONL records -> meshfeed shards (:func:`write_shards`).

Each JSON line is one sample: an object becomes a dict sample (a list of numbers becomes an
``int64`` or ``float64`` array, ``str`` / ``int`` / ``float`` / ``bool`` stay as they are); any
other value is a bare sample. Nested objects and lists of non-numbers are refused by
``write_shards`` with the row and field named (serialise them into a ``str`` first).

    meshfeed convert data.jsonl --to shards -o out/shards --compression zstd
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.sources.shards_format import read_index
from meshfeed.sources.shards_write import write_shards

__all__ = ["convert_to_shards", "jsonl_samples"]


def _value(value: Any) -> Any:
    if isinstance(value, list) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        floats = any(isinstance(v, float) for v in value)
        return np.asarray(value, dtype=np.float64 if floats else np.int64)
    return value


def jsonl_samples(paths: Sequence[Path]) -> Iterator[Any]:
    """The samples of JSONL files (``.gz`` too), in order; a bad line names file and line."""
    for path in paths:
        if ".jsonl" not in path.suffixes and ".json" not in path.suffixes:
            raise ValueError(f"{path}: --to shards converts JSONL files (.jsonl, .jsonl.gz)")
        opener: Any = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no} is not valid JSON ({e})") from e
                if isinstance(record, dict):
                    yield {k: _value(v) for k, v in record.items()}
                else:
                    yield _value(record)


def convert_to_shards(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    compression: str | None = None,
    bytes_per_shard: int = 64 << 20,
    num_workers: int = 1,
) -> Path:
    """Write the JSONL ``inputs`` (in order) as shards into directory ``output``; the index."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no inputs given; pass at least one JSONL file")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input {p} does not exist")
    return write_shards(
        jsonl_samples(paths),
        output,
        bytes_per_shard=bytes_per_shard,
        compression=compression,
        num_workers=num_workers,
    )


def handler(args: argparse.Namespace) -> int:
    """``meshfeed convert ... --to shards``: write, then print what was written."""
    try:
        index_path = convert_to_shards(args.inputs, args.output, compression=args.compression)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"meshfeed convert: error: {e}", file=sys.stderr)
        return 2
    index = read_index(index_path)
    size = sum(s.bytes for s in index.shards)
    print(
        f"wrote {index_path}: {index.num_rows} samples in {len(index.shards)} shards, "
        f"{size} bytes, fields {[f.name for f in index.fields]}"
    )
    return 0
