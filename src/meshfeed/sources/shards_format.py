"""The meshfeed shard format: constants, the field schema and the index file, read and checked.

A dataset is a directory with shard files ``shard-00000.mfs``, ... and ``index.json``
(written last: a directory without it is not a dataset). Each shard file is:

- a preamble: magic ``b"MFSHARD\\x00"``, ``<I`` format version, ``<I`` header length;
- the header: compact JSON with sorted keys, the shard's layout (rows, block rows, per column
  its storage and segments);
- the payload, from the first 64-byte boundary after the header: the segments of every column,
  each starting on a 64-byte boundary (so uncompressed arrays are aligned views).

A column is stored ``fixed`` (one array ``[rows, *shape]``: a batch of rows is one fancy-index
gather) when every row of the shard has the same shape, else ``var`` (a flat ``data`` segment of
elements plus ``offsets`` ``int64[rows + 1]`` in elements and, for arrays of two or more
dimensions, ``shapes`` ``int64[rows, ndim]``). ``str`` and ``bytes`` are ``var`` columns of
``uint8``. Every segment is a list of blocks ``[offset, stored bytes, raw bytes]``, offsets
relative to the payload start (recorded per shard in the index as ``payload``): a ``data`` block
holds ``block_rows`` rows, ``offsets`` and ``shapes`` are one block each. With
``compression="zstd"`` each block is one zstd frame with a checksum; without, blocks tile the
segment and the reader maps it without decoding.

``index.json`` holds ``format``, ``version``, ``sample`` (``"dict"`` or ``"bare"``), ``fields``
(name, kind, dtype, ndim, in the order of the first sample), ``compression`` and per shard its
``file``, ``rows``, ``bytes``, ``hash`` (blake2b-128 of the file bytes, hex), ``payload`` and
``layout`` (the shard's header, repeated so a reader can plan ranged reads from the index
alone). Nothing is pickled: reading a shard never runs code from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.errors import SourceError

__all__ = [
    "ALIGN",
    "FORMAT",
    "INDEX_NAME",
    "KINDS",
    "MAGIC",
    "PREAMBLE",
    "VERSION",
    "FieldSpec",
    "ShardEntry",
    "ShardIndex",
    "check_file",
    "file_hash",
    "read_index",
]

MAGIC = b"MFSHARD\x00"
FORMAT = "meshfeed-shards"
VERSION = 1
PREAMBLE = struct.Struct("<8sII")  # magic, format version, header length
ALIGN = 64
INDEX_NAME = "index.json"
#: What a field holds; the reader gives back the same Python type.
KINDS = ("tensor", "ndarray", "npscalar", "int", "float", "bool", "str", "bytes")
_HASH_CHUNK = 8 << 20


def file_hash(path: str | os.PathLike[str]) -> str:
    """blake2b-128 of a file's bytes, hex (reads the whole file: about 1 GB/s per core)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldSpec:
    """One field of every sample: its name, kind (one of :data:`KINDS`), dtype and ndim.

    ``dtype`` is the stored numpy dtype name (``"bfloat16"`` for bfloat16 tensors, stored as
    ``uint16`` bits); ``ndim`` is the array rank (0 for scalars, 1 for ``str`` / ``bytes``).
    """

    name: str
    kind: str
    dtype: str
    ndim: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype, "ndim": self.ndim}

    @property
    def storage_dtype(self) -> np.dtype[Any]:
        return np.dtype(np.uint16) if self.dtype == "bfloat16" else np.dtype(self.dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry:
    """One shard as the index records it."""

    file: str
    rows: int
    bytes: int
    hash: str
    payload: int
    layout: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "rows": self.rows,
            "bytes": self.bytes,
            "hash": self.hash,
            "payload": self.payload,
            "layout": self.layout,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardIndex:
    """A validated ``index.json``: the schema and every shard, in order.

    ``root`` is the dataset directory; :attr:`paths` are the shard files, ready to pass to
    ``ShardedStream(shards=...)`` with a :class:`~meshfeed.sources.shards_read.ShardFormatReader`.
    """

    root: Path
    sample: str
    fields: tuple[FieldSpec, ...]
    compression: str | None
    shards: tuple[ShardEntry, ...]

    @property
    def paths(self) -> list[str]:
        root = str(self.root)  # os.path.join: a Path per shard costs ~20 us at 10,000 shards
        return [os.path.join(root, s.file) for s in self.shards]

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "sample": self.sample,
            "fields": [f.to_json() for f in self.fields],
            "compression": self.compression,
            "shards": [s.to_json() for s in self.shards],
        }


def _need(cond: bool, where: Path, what: str) -> None:
    if not cond:
        raise SourceError(f"{where} is not a valid meshfeed shard index: {what}")


def _parse_field(raw: Any, where: Path) -> FieldSpec:
    _need(isinstance(raw, dict), where, f"field entry {raw!r} is not an object")
    try:
        spec = FieldSpec(
            name=str(raw["name"]), kind=raw["kind"], dtype=raw["dtype"], ndim=int(raw["ndim"])
        )
        np.dtype(spec.storage_dtype)
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(
            f"{where} is not a valid meshfeed shard index: field {raw!r} ({e})"
        ) from e
    _need(spec.kind in KINDS, where, f"field {spec.name!r} has unknown kind {spec.kind!r}")
    return spec


def _parse_shard(raw: Any, where: Path) -> ShardEntry:
    if not isinstance(raw, dict):  # the message (a repr) only when it is needed: 10,000 shards
        _need(False, where, f"shard entry {raw!r} is not an object")
    try:
        entry = ShardEntry(
            file=str(raw["file"]),
            rows=int(raw["rows"]),
            bytes=int(raw["bytes"]),
            hash=str(raw["hash"]),
            payload=int(raw["payload"]),
            layout=dict(raw["layout"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(f"{where} is not a valid meshfeed shard index: shard {e}") from e
    if "/" in entry.file or entry.file in ("", ".", ".."):
        _need(
            False,
            where,
            f"shard file name {entry.file!r} must be a plain name inside the dataset directory",
        )
    return entry


def read_index(
    path: str | os.PathLike[str], *, verify: bool = False, check_files: bool = True
) -> ShardIndex:
    """Read and check ``index.json`` (``path`` is the file or its dataset directory).

    Checks the format name and version, the schema, and that every shard file exists with the
    recorded size (one ``stat`` per shard). ``verify=True`` also hashes every shard now (reads
    every byte: about 1 GB/s per core); a reader can instead verify each shard on first open.
    Any fault raises :class:`~meshfeed.errors.SourceError` naming the file.
    ``check_files=False`` reads the index alone (its shards are elsewhere, e.g. still in object
    storage; the reader checks each shard when it opens it).
    """
    p = Path(path)
    index_path = p / INDEX_NAME if p.is_dir() else p
    try:
        raw = json.loads(index_path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise SourceError(
            f"{index_path} does not exist: not a meshfeed shard dataset, or its write did not "
            "finish (index.json is written last); write it with meshfeed.sources.write_shards"
        ) from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{index_path} is not a readable meshfeed shard index ({e})") from e
    _need(isinstance(raw, dict), index_path, "not a JSON object")
    _need(raw.get("format") == FORMAT, index_path, f"format is {raw.get('format')!r}")
    _need(
        raw.get("version") == VERSION,
        index_path,
        f"version {raw.get('version')!r}; this meshfeed reads version {VERSION} (a newer "
        "meshfeed wrote it: upgrade meshfeed, or rewrite the shards with this one)",
    )
    _need(raw.get("sample") in ("dict", "bare"), index_path, f"sample {raw.get('sample')!r}")
    _need(raw.get("compression") in (None, "zstd"), index_path, "unknown compression")
    fields = tuple(_parse_field(f, index_path) for f in raw.get("fields") or [])
    _need(bool(fields), index_path, "no fields")
    shards = tuple(_parse_shard(s, index_path) for s in raw.get("shards") or [])
    index = ShardIndex(
        root=index_path.parent,
        sample=raw["sample"],
        fields=fields,
        compression=raw["compression"],
        shards=shards,
    )
    for entry in shards if check_files else ():
        check_file(index.root / entry.file, entry, verify=verify)
    return index


def check_file(
    path: Path, entry: ShardEntry, *, verify: bool, written_ns: int | None = None
) -> None:
    """Refuse a missing shard, one of another size, or (``verify``) one of another hash.

    ``written_ns``: when the shard's ``index.json`` was written. ``write_shards`` writes the
    index last, so a shard modified after it (changed in place, same size) is hashed here
    even without ``verify``: one read of a suspect file, none of the others."""
    try:
        st = path.stat()
    except FileNotFoundError as e:
        raise SourceError(f"shard {path} is missing (listed in its index.json)") from e
    if st.st_size != entry.bytes:
        raise SourceError(
            f"shard {path} has {st.st_size} bytes but its index.json records {entry.bytes}: "
            "the file is truncated or was replaced; rewrite the dataset"
        )
    changed = written_ns is not None and st.st_mtime_ns > written_ns
    if (verify or changed) and (got := file_hash(path)) != entry.hash:
        raise SourceError(
            f"shard {path} has content hash {got} but its index.json records {entry.hash}: "
            "the file is damaged; rewrite the dataset"
        )
