"""``meshfeed convert --to shards``: JSONL records -> meshfeed shards (:func:`write_shards`).

Each JSON line is one sample: an object becomes a dict sample, any other value a bare sample.
``str`` / ``int`` / ``float`` / ``bool`` stay as they are (a field holding ints and floats is
stored as float); a list of numbers becomes an array: of floats if any row of its field holds a
float, else of the narrowest integer type of at least 16 bits that holds every row's values
(``uint16``, ``int16``, ``int32``, ...: token ids below 65,536 take 2 bytes each, not 8), and
a list of booleans a ``bool`` array. The inputs are read twice: once to check every record and find each
field's type, once to write. Anything else (``null``, nested objects or lists, lists mixing
kinds, fields that differ between records) is refused naming the file and line (serialise it
into a ``str`` first); a broken ``.gz`` or too deep JSON names the file as well.

    meshfeed convert data.jsonl --to shards -o out/shards --compression zstd --rows-per-shard 4096
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.errors import SourceError
from meshfeed.sources.converters.inputs import input_paths, jsonl_lines, parse_json
from meshfeed.sources.shards.format import INDEX_NAME, ShardIndex, read_index
from meshfeed.sources.shards.write import replaced_files, write_shards
from meshfeed.storage import ShardCache, StorageOptions
from meshfeed.storage.output import upload_target

__all__ = ["convert_to_shards", "jsonl_samples"]

_INT64 = np.iinfo(np.int64)
#: Narrowest first, from 16 bits: torch takes a uint8 tensor used as an index for a boolean
#: mask (silently other rows); int32 before uint32 (as narrow, and embeddings take it).
_INT_TYPES = tuple(np.dtype(t) for t in ("uint16", "int16", "int32", "uint32", "int64"))
_SCALARS = {str: "str", int: "int", float: "float", bool: "bool"}
_LISTS = {frozenset({int}): "ints", frozenset({float}): "floats", frozenset({int, float}): "floats"}


@dataclass(slots=True)
class _Field:
    """What the rows of one field hold: a kind, and the range of an integer list's values."""

    kind: str = ""  # str int float bool ints floats bools; "" while only empty lists were seen
    is_list: bool = False
    lo: int = 0
    hi: int = -1  # lo > hi: no integer seen yet

    def dtype(self) -> np.dtype[Any] | None:
        """The array dtype of a list field (None for a scalar field)."""
        if not self.is_list:
            return None
        if self.kind == "floats":
            return np.dtype(np.float64)
        if self.kind == "bools":
            return np.dtype(np.bool_)
        if self.lo > self.hi:
            return _INT_TYPES[0]
        return next(
            d for d in _INT_TYPES if np.iinfo(d).min <= self.lo and self.hi <= np.iinfo(d).max
        )


def _refused(where: str, name: str, what: str) -> ValueError:
    field = f" field {name!r}" if name else ""
    return ValueError(
        f"{where}{field}: {what}; shards take str, int, float, bool and flat lists of numbers "
        "or of booleans: serialise anything else into a str"
    )


def _merge(field: _Field, value: Any, where: str, name: str) -> None:
    """Fold one row's ``value`` into ``field``; a value the field cannot hold is refused."""
    if isinstance(value, list):
        kinds = frozenset(map(type, value))
        kind = "bools" if kinds == {bool} else _LISTS.get(kinds, "" if not value else "?")
        if kind == "?":
            bad = next(v for v in value if type(v) not in (int, float))
            raise _refused(where, name, f"a list holding {type(bad).__name__} {bad!r:.40}")
        if kind == "ints":
            lo, hi = min(value), max(value)
            if lo < _INT64.min or hi > _INT64.max:
                raise _refused(where, name, f"an int outside int64 ({lo}..{hi})")
            field.lo, field.hi = min(lo, field.lo), max(hi, field.hi)
        is_list = True
    elif type(value) in _SCALARS:
        kind, is_list = _SCALARS[type(value)], False
        if kind == "int" and not _INT64.min <= value <= _INT64.max:
            raise _refused(where, name, f"an int outside int64 ({value})")
    else:
        raise _refused(where, name, f"{type(value).__name__} {value!r:.40} is not supported")
    if field.kind and (is_list != field.is_list):
        raise _refused(where, name, "a list where earlier rows hold a scalar, or the reverse")
    field.is_list = is_list
    if kind and kind != field.kind:
        field.kind = _join(field.kind, kind, where, name)


def _join(old: str, new: str, where: str, name: str) -> str:
    if not old:
        return new
    numbers = {"int": "float", "float": "float", "ints": "floats", "floats": "floats"}
    if old in numbers and new in numbers and numbers[old] == numbers[new]:
        return numbers[old]
    raise _refused(where, name, f"{new} where earlier rows hold {old}")


def _records(paths: Sequence[Path]) -> Iterator[tuple[str, Any]]:
    """``(path:line, record)`` of every non-blank line of the JSONL files, in order."""
    for path in paths:
        if ".jsonl" not in path.suffixes and ".json" not in path.suffixes:
            raise ValueError(f"{path}: --to shards converts JSONL files (.jsonl, .jsonl.gz)")
        for line_no, line, _ in jsonl_lines(path):
            if line.strip():
                where = f"{path}:{line_no}"
                yield where, parse_json(line, where)


def _scan(paths: Sequence[Path]) -> _Samples:
    """The samples of ``paths``, each field typed over all of their records."""
    fields: dict[str, _Field] | None = None
    first, bare = "", False
    for where, record in _records(paths):
        names = list(record) if isinstance(record, dict) else None
        if fields is None:
            first = where
            fields = {n: _Field() for n in (names if names is not None else [""])}
            bare = names is None
        if bare != (names is None) or (names is not None and set(names) != set(fields)):
            had = "none (a bare value)" if bare else sorted(fields)
            raise ValueError(
                f"{where} has fields {'none (a bare value)' if names is None else sorted(names)}"
                f", but {first} had {had}: every record needs the same fields"
            )
        for n, field in fields.items():
            _merge(field, record[n] if names is not None else record, where, n)
    if fields is None:
        raise ValueError(f"no records in {', '.join(map(str, paths))}; give non-empty JSONL files")
    return _Samples(paths, fields, bare)


@dataclass(slots=True)
class _Samples:
    """The samples of the JSONL files, typed by the scan; remembers the record last read."""

    paths: Sequence[Path]
    fields: dict[str, _Field]
    bare: bool
    where: str = ""

    def _value(self, field: _Field, value: Any) -> Any:
        dtype = field.dtype()
        if dtype is not None:
            return np.asarray(value, dtype=dtype)
        return float(value) if field.kind == "float" else value

    def __iter__(self) -> Iterator[Any]:
        for where, record in _records(self.paths):
            self.where = where
            if self.bare:
                yield self._value(self.fields[""], record)
            else:
                yield {n: self._value(f, record[n]) for n, f in self.fields.items()}


def jsonl_samples(paths: Sequence[Path]) -> Iterator[Any]:
    """The samples of JSONL files (``.gz`` too), in order; reads the files twice (a bad record
    is refused naming file and line before any sample is returned)."""
    return iter(_scan(paths))


def _check_not_replaced(paths: Sequence[Path], output: str | os.PathLike[str]) -> None:
    """Refuse an input that replacing the dataset at ``output`` would delete."""
    if upload_target(output) is not None or not (Path(output) / INDEX_NAME).is_file():
        return  # inputs are local files: a URL prefix holds none of them
    out = Path(output)
    replaced = {(out / name).resolve(): name for name in replaced_files(out)}
    for p in paths:
        if p.resolve() in replaced:
            raise ValueError(
                f"input {p} is {replaced[p.resolve()]} of the shard dataset in {out}, which "
                "overwrite replaces (its files are deleted once the new dataset is in place); "
                f"move the input out of {out}, or write into another directory"
            )


def convert_to_shards(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    compression: str | None = None,
    rows_per_shard: int | None = None,
    bytes_per_shard: int | None = 64 << 20,
    num_workers: int = 1,
    overwrite: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    storage_options: StorageOptions | None = None,
) -> Path | str:
    """Write the JSONL ``inputs`` (in order) as shards into ``output`` (a folder or a URL
    prefix, see :func:`write_shards`); return the path or URL of ``index.json``."""
    paths = input_paths(inputs)
    if overwrite:
        _check_not_replaced(paths, output)
    samples = _scan(paths)
    try:
        return write_shards(
            samples,
            output,
            rows_per_shard=rows_per_shard,
            bytes_per_shard=bytes_per_shard,
            compression=compression,
            num_workers=num_workers,
            overwrite=overwrite,
            cache_dir=cache_dir,
            storage_options=storage_options,
        )
    except (TypeError, ValueError) as e:
        if samples.where and str(e).startswith("row "):  # a sample refused as it was read
            raise ValueError(f"{samples.where}: {e}") from e
        raise


def handler(args: argparse.Namespace) -> int:
    """``meshfeed convert ... --to shards``: write, then print what was written."""
    try:  # --rows-per-shard / --bytes-per-shard are positive: argparse checked them
        index_path = convert_to_shards(
            args.inputs,
            args.output,
            compression=args.compression,
            rows_per_shard=args.rows_per_shard,
            bytes_per_shard=args.bytes_per_shard or (None if args.rows_per_shard else 64 << 20),
            num_workers=args.num_workers,
            overwrite=args.overwrite,
            cache_dir=args.cache_dir,
        )
        index = _read_written(index_path, args.cache_dir)
    except FileExistsError as e:
        if e.filename is not None:  # a name the new shards would take (with --overwrite)
            print(f"meshfeed convert: error: {e.strerror}", file=sys.stderr)
            return 2
        print(
            f"meshfeed convert: error: {args.output} already holds data; pass --overwrite to "
            "replace a shard dataset there (one with an index.json), or choose another -o",
            file=sys.stderr,
        )
        return 2
    except (ValueError, TypeError, OSError, ImportError, SourceError) as e:
        print(f"meshfeed convert: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    size = int(index.sizes.sum())
    arrays = ("ndarray", "tensor")
    dtypes = ", ".join(
        f"{f.name or 'sample'}: {f'{f.dtype} array' if f.kind in arrays else f.kind}"
        for f in index.fields
    )
    print(
        f"wrote {index_path}: {index.num_rows} samples in {len(index)} shards, "
        f"{size} bytes, fields {dtypes}"
    )
    if len(index) == 1 and index.num_rows > 1 and not args.quiet:
        print(
            "meshfeed convert: one shard holds every sample; for several data ranks or workers "
            "pass --rows-per-shard N or --bytes-per-shard B so each reads its own shards",
            file=sys.stderr,
        )
    return 0


def _read_written(index_path: Path | str, cache_dir: str | None) -> ShardIndex:
    url = upload_target(index_path)
    if url is None:
        return read_index(index_path)
    with ShardCache(cache_dir).hold(url) as path:  # the writer left index.json there: no download
        return read_index(path, check_files=False)
