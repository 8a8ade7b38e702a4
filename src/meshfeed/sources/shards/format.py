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

``index.json`` holds ``format``, ``version`` (:data:`INDEX_VERSION`), ``sample`` (``"dict"``
or ``"bare"``), ``fields`` (name, kind, dtype, ndim, in the order of the first sample),
``compression`` and ``shards``: one list per column, each with an item per shard: ``file``,
``rows``, ``bytes``, ``hash`` (blake2b-128 of the file bytes, hex), ``payload`` and ``layout``
(the shard's header as its compact JSON text, repeated so a reader can plan ranged reads from
the index alone, and parsed only for the shards a reader opens). So opening a dataset of 10,000
shards parses a few lists, not 10,000 objects (#32). Version 1 (``shards`` a list of objects
with the same keys, ``layout`` an object) is still read. Nothing is pickled: reading a shard
never runs code from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.errors import SourceError

__all__ = [
    "ALIGN",
    "FORMAT",
    "INDEX_NAME",
    "INDEX_VERSION",
    "KINDS",
    "MAGIC",
    "PREAMBLE",
    "VERSION",
    "FieldSpec",
    "ShardEntry",
    "ShardIndex",
    "check_file",
    "compact_json",
    "file_hash",
    "parse_index",
    "read_index",
    "write_index",
]

MAGIC = b"MFSHARD\x00"
FORMAT = "meshfeed-shards"
VERSION = 1  # of the shard file
#: Of ``index.json``: 2 holds the shards by column (#32); version 1 (a list of objects) is read.
INDEX_VERSION = 2
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


def shard_file_hash(path: Path) -> str:
    """:func:`file_hash` of a shard, an unreadable one refused as :class:`SourceError`."""
    try:
        return file_hash(path)
    except OSError as e:
        raise SourceError(f"cannot read shard {path}: {e}") from e


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
        return asdict(self)

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
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ShardIndex:
    """A validated ``index.json``: the schema and every shard, in order, held by column.

    ``root`` is the dataset directory; :attr:`paths` are the shard files, ready to pass to
    ``ShardedStream(shards=...)`` with a :class:`~meshfeed.sources.shards.read.ShardFormatReader`.
    Per shard, ``files``, ``rows``, ``sizes`` (bytes), ``hashes``, ``payloads`` and ``layouts``
    are columns (numbers as ``int64`` arrays), so an index of 10,000 shards loads as a few
    arrays, not 10,000 objects (#32); a shard's layout is parsed by :meth:`entry`, when a
    reader opens that shard. :attr:`shards` builds every :class:`ShardEntry` (O(shards)).
    """

    root: Path
    sample: str
    fields: tuple[FieldSpec, ...]
    compression: str | None
    files: list[str]
    rows: np.ndarray
    sizes: np.ndarray
    hashes: list[str]
    payloads: np.ndarray
    layouts: list[Any]  # per shard its layout, or (version 2) its compact JSON text

    def __len__(self) -> int:
        return len(self.files)

    def entry(self, i: int) -> ShardEntry:
        """Shard ``i`` as an entry, its layout parsed (a malformed one names the shard)."""
        layout = self.layouts[i]
        if isinstance(layout, str):
            try:
                layout = json.loads(layout)
            except json.JSONDecodeError as e:
                raise SourceError(
                    f"{self.root / INDEX_NAME} is not a valid meshfeed shard index: the layout "
                    f"of shard {self.files[i]} is not JSON ({e}); rewrite the dataset"
                ) from e
        if not isinstance(layout, dict):
            _need(False, self.root / INDEX_NAME, f"the layout of {self.files[i]} is no object")
        return ShardEntry(
            file=self.files[i],
            rows=int(self.rows[i]),
            bytes=int(self.sizes[i]),
            hash=self.hashes[i],
            payload=int(self.payloads[i]),
            layout=layout,
        )

    @property
    def shards(self) -> tuple[ShardEntry, ...]:
        """Every shard as a :class:`ShardEntry` (parses every layout: for a few shards)."""
        return tuple(self.entry(i) for i in range(len(self.files)))

    @property
    def paths(self) -> list[str]:
        root = os.fspath(self.root)  # one concatenation per shard: 10,000 shards in ~1 ms
        return [f"{root}/{f}" for f in self.files]

    @property
    def num_rows(self) -> int:
        return int(self.rows.sum())

    def to_json(self) -> dict[str, Any]:
        """The index as ``index.json`` holds it (:data:`INDEX_VERSION`: one list per column,
        each layout as its compact JSON text)."""
        return {
            "format": FORMAT,
            "version": INDEX_VERSION,
            "sample": self.sample,
            "fields": [f.to_json() for f in self.fields],
            "compression": self.compression,
            "shards": {
                "file": list(self.files),
                "rows": self.rows.tolist(),
                "bytes": self.sizes.tolist(),
                "hash": list(self.hashes),
                "payload": self.payloads.tolist(),
                "layout": [compact_json(x) if isinstance(x, dict) else x for x in self.layouts],
            },
        }


def compact_json(value: Any) -> str:
    """``value`` as the format writes JSON: sorted keys, no spaces (a shard header's bytes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def write_index(index: ShardIndex, path: str | os.PathLike[str]) -> None:
    """Write ``index`` to ``path`` (an ``index.json``), fsynced."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(compact_json(index.to_json()))
        f.flush()
        os.fsync(f.fileno())


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
    """One shard entry of a version-1 index (a list of objects)."""
    if not isinstance(raw, dict):  # the message (a repr) only when it is needed
        _need(False, where, f"shard entry {raw!r} is not an object")
    try:
        return ShardEntry(
            file=str(raw["file"]),
            rows=int(raw["rows"]),
            bytes=int(raw["bytes"]),
            hash=str(raw["hash"]),
            payload=int(raw["payload"]),
            layout=dict(raw["layout"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(f"{where} is not a valid meshfeed shard index: shard {e}") from e


_COLUMNS = ("file", "rows", "bytes", "hash", "payload", "layout")  # ShardEntry's fields


def _columns_v1(raw: Any, where: Path) -> dict[str, list[Any]]:
    _need(isinstance(raw, list), where, "version 1 lists its shards as a list of objects")
    entries = [_parse_shard(s, where) for s in raw]
    return {name: [getattr(e, name) for e in entries] for name in _COLUMNS}


def _columns_v2(raw: Any, where: Path) -> dict[str, list[Any]]:
    """The shard columns of a version-2 index, each checked in one pass."""
    _need(isinstance(raw, dict), where, "version 2 holds its shards as an object of columns")
    cols = {k: raw.get(k) for k in _COLUMNS}
    _need(
        all(isinstance(c, list) for c in cols.values()),
        where,
        f"shards needs the columns {list(_COLUMNS)}, each a list",
    )
    n = len(cols["file"])
    _need(
        all(len(c) == n for c in cols.values()),
        where,
        f"its shard columns differ in length ({ {k: len(c) for k, c in cols.items()} })",
    )
    for name in ("hash", "layout"):
        bad = next((x for x in cols[name] if not isinstance(x, str)), None)
        _need(bad is None, where, f"shard {name} {bad!r} is not a string")
    return cols


def _counts(values: list[Any], name: str, where: Path) -> np.ndarray:
    """A column of non-negative ints as ``int64`` (one vectorised check)."""
    arr = np.asarray(values) if values else np.zeros(0, np.int64)
    ok = arr.ndim == 1 and arr.dtype.kind in "iu" and not (arr.size and int(arr.min()) < 0)
    _need(ok, where, f"shard {name} must be non-negative ints (got {values[:4]!r}...)")
    return arr.astype(np.int64, copy=False)


def _check_names(files: list[Any], where: Path) -> None:
    bad = next(
        (f for f in files if not isinstance(f, str) or "/" in f or f in ("", ".", "..")), None
    )
    _need(
        bad is None,
        where,
        f"shard file name {bad!r} must be a plain name inside the dataset directory",
    )


def parse_index(raw: Any, where: Path) -> ShardIndex:
    """The :class:`ShardIndex` of an ``index.json``'s parsed JSON (``where``: its path, for
    messages and the root); any fault raises :class:`~meshfeed.errors.SourceError`."""
    _need(isinstance(raw, dict), where, "not a JSON object")
    _need(raw.get("format") == FORMAT, where, f"format is {raw.get('format')!r}")
    version = raw.get("version")
    _need(
        version in (1, INDEX_VERSION),
        where,
        f"version {version!r}; this meshfeed reads versions 1 and {INDEX_VERSION} (a newer "
        "meshfeed wrote it: upgrade meshfeed, or rewrite the shards with this one)",
    )
    _need(raw.get("sample") in ("dict", "bare"), where, f"sample {raw.get('sample')!r}")
    _need(raw.get("compression") in (None, "zstd"), where, "unknown compression")
    fields = tuple(_parse_field(f, where) for f in raw.get("fields") or [])
    _need(bool(fields), where, "no fields")
    read = _columns_v1 if version == 1 else _columns_v2
    cols = read(raw.get("shards") or ([] if version == 1 else {}), where)
    _check_names(cols["file"], where)
    return ShardIndex(
        root=where.parent,
        sample=raw["sample"],
        fields=fields,
        compression=raw["compression"],
        files=cols["file"],
        rows=_counts(cols["rows"], "rows", where),
        sizes=_counts(cols["bytes"], "bytes", where),
        hashes=[str(h) for h in cols["hash"]],
        payloads=_counts(cols["payload"], "payload", where),
        layouts=cols["layout"],
    )


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
    index = parse_index(raw, index_path)
    for i in range(len(index)) if check_files else ():
        check_file(index.root / index.files[i], index.entry(i), verify=verify)
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
    except OSError as e:  # unreadable: never a bad sample to substitute
        raise SourceError(f"cannot read shard {path}: {e}") from e
    if st.st_size != entry.bytes:
        raise SourceError(
            f"shard {path} has {st.st_size} bytes but its index.json records {entry.bytes}: "
            "the file is truncated or was replaced; rewrite the dataset"
        )
    changed = written_ns is not None and st.st_mtime_ns > written_ns
    if (verify or changed) and (got := shard_file_hash(path)) != entry.hash:
        raise SourceError(
            f"shard {path} has content hash {got} but its index.json records {entry.hash}: "
            "the file is damaged; rewrite the dataset"
        )
