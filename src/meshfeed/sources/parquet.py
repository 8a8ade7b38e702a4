"""Random access by global row index over Parquet files and Arrow tables (``pip install meshfeed[parquet]``).

:class:`ParquetSource` spans one or more Parquet files as one map-style dataset. Row ``i`` is
found arithmetically: ``searchsorted`` over the cumulative row-group sizes gives (file, row
group, offset). ``__getitems__`` groups a batch's indices by row group and reads each needed
row group once; a small LRU cache (``cache_row_groups``) keeps the last few, so memory is
bounded by that many decoded row groups regardless of the dataset size. Write files with
row groups of a few thousand rows for cheap random access.

:class:`ArrowSource` does the same over an in-memory ``pyarrow.Table`` or an Arrow IPC file
(memory-mapped, zero copy).

pyarrow is imported lazily, so importing this module never requires it.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.errors import SourceError
from meshfeed.order.distinct import distinct
from meshfeed.storage import (
    Ranged,
    RangedFile,
    ShardCache,
    StorageOptions,
    is_url,
    list_files,
    local_or_ranged,
    local_path_of,
)
from meshfeed.storage.ranged import check_ranged

__all__ = ["ArrowSource", "ParquetSource"]

Row = dict[str, Any]
#: A Parquet file: a local path, or a remote one read by ranges.
Source = Path | RangedFile


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "meshfeed's Parquet/Arrow sources need pyarrow; install the extra: "
            "pip install meshfeed[parquet]"
        ) from e
    return pyarrow


def _as_index_array(indices: Any, n: int) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise TypeError(
            f"indices must be a 1-D integer sequence (got shape {idx.shape}, dtype {idx.dtype})"
        )
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (int(idx.min()) < -n or int(idx.max()) >= n):
        raise IndexError(f"indices span [{int(idx.min())}, {int(idx.max())}], outside [0, {n})")
    return np.where(idx < 0, idx + n, idx)


def _check_types(path: Any, schema: Any, first_path: Any, first: Any, columns: Any) -> None:
    """Every one of ``columns`` has the same Arrow type in ``schema`` as in ``first`` (the first
    file's): a column that is int64 in one file and string in another would change the type of
    a batch mid-epoch, or fail its collation there."""
    differ = [
        f"{c!r}: {schema.field(c).type} here, {first.field(c).type} in {first_path}"
        for c in columns
        if _kind(schema.field(c).type) != _kind(first.field(c).type)
    ]
    if differ:
        raise ValueError(
            f"{path} has column(s) of another type than the first file's ({'; '.join(differ)}); "
            "give files of one schema (cast the column when writing them), or pick columns "
            "of one type with columns=[...]"
        )


def _kind(arrow_type: Any) -> str:
    """An Arrow type as the values it reads as: string and large_string (binary and
    large_binary) read alike, so files may differ there."""
    text = str(arrow_type)
    return {"large_string": "string", "large_binary": "binary"}.get(text, text)


def _describe(schema: Any) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"


def _expand(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    cache: Callable[[], ShardCache],
    ranged: Ranged,
) -> list[Source]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[Source] = []
    for item in items:
        if is_url(os.fspath(item)) and local_path_of(os.fspath(item)) is None:
            # a file or a folder of *.parquet files in object storage: cached whole and held,
            # or read by ranges
            urls = list_files(
                os.fspath(item), suffix=".parquet", storage_options=cache().storage_options
            )
            for url in urls:
                got = local_or_ranged(url, cache(), ranged)
                out.append(got if isinstance(got, RangedFile) else Path(got))
            continue
        p = Path(local_path_of(os.fspath(item)) or item)
        if p.is_dir():
            found = sorted(p.glob("*.parquet"))
            if not found:
                raise FileNotFoundError(f"directory {p} holds no *.parquet files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"Parquet path {p} does not exist")
    if not out:
        raise ValueError(
            f"no Parquet files given (got {paths=}); pass a file, a list or a directory"
        )
    return out


def _parquet_file(source: Source, **options: Any) -> Any:
    """A ``pyarrow.parquet.ParquetFile``: a path, or a remote file whose footer and row
    groups are read by ranged GETs (only the byte ranges pyarrow asks for)."""
    opened = source.open() if isinstance(source, RangedFile) else source
    return _pyarrow().parquet.ParquetFile(opened, **options)


def _size_and_tail(source: Source, n: int) -> tuple[int, bytes]:
    """The file's size and its last ``n`` bytes (one small ranged GET for a remote file)."""
    if isinstance(source, RangedFile):
        return len(source), source[max(0, len(source) - n) :]
    size = source.stat().st_size
    with open(source, "rb") as f:
        f.seek(max(0, size - n))
        return size, f.read()


class ParquetSource:
    """Map-style rows (``dict`` column -> Python value) over one or more Parquet files.

    Files are concatenated in the given order (a directory expands to its ``*.parquet`` files,
    sorted). ``columns`` selects columns (all by default). The object pickles without its open
    file handles and cache, so worker processes re-open the files.

    A URL (``s3://bucket/train/`` or a file's URL) is listed and each file downloaded whole
    into the node's shard cache at ``cache_dir`` (``storage_options`` go to fsspec); the
    local copies are held while this object lives, and worker processes read them. With
    ``ranged=True`` (or a :class:`~meshfeed.storage.RangeReads`), and by itself for a file
    larger than ``cache_limit``, a remote file is read by ranged GETs instead: its footer,
    then only the row groups (and columns) read, in blocks held in a bounded per-process
    LRU (:class:`~meshfeed.storage.RangedFile`) beside the ``cache_row_groups`` decoded ones;
    the same rows, but row groups read again after eviction are fetched again.

    >>> src = ParquetSource(["a.parquet", "b.parquet"], columns=["text"])  # doctest: +SKIP
    >>> src.__getitems__([0, 10_000, 1])  # doctest: +SKIP
    [{'text': ...}, {'text': ...}, {'text': ...}]
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        columns: Sequence[str] | None = None,
        cache_row_groups: int = 4,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        storage_options: StorageOptions | None = None,
        ranged: Ranged = None,
    ) -> None:
        if not isinstance(cache_row_groups, int) or cache_row_groups < 1:
            raise ValueError(f"cache_row_groups must be a positive int (got {cache_row_groups=})")
        check_ranged(ranged)
        pa = _pyarrow()
        self._shard_cache: ShardCache | None = None

        def shard_cache() -> ShardCache:
            if self._shard_cache is None:
                self._shard_cache = ShardCache(
                    cache_dir, cache_limit=cache_limit, storage_options=storage_options
                )
            return self._shard_cache

        self.paths = _expand(paths, shard_cache, ranged)
        self.columns = list(columns) if columns is not None else None
        self.cache_row_groups = cache_row_groups
        files, groups, rows, schemas = [], [], [], []
        for f, path in enumerate(self.paths):
            try:
                meta = _parquet_file(path).metadata
                schemas.append(meta.schema.to_arrow_schema())
            except (OSError, pa.ArrowException) as e:
                raise SourceError(
                    f"cannot open the Parquet file {path}: {e}; the footer is damaged or it is "
                    "not a Parquet file (re-export or remove it)"
                ) from e
            for g in range(meta.num_row_groups):
                files.append(f)
                groups.append(g)
                rows.append(meta.row_group(g).num_rows)
        if self.columns is None:
            # Rows of every file must have the same columns, or collate fails mid-epoch.
            for path, schema in zip(self.paths[1:], schemas[1:], strict=True):
                if schema.names != schemas[0].names:
                    raise ValueError(
                        f"{path} has columns {_describe(schema)}, but {self.paths[0]} has "
                        f"{_describe(schemas[0])}; give files of one schema, or pick columns "
                        "every file has with columns=[...]"
                    )
                _check_types(path, schema, self.paths[0], schemas[0], schema.names)
        else:
            # Every file, not just the first: a later file without a column would otherwise
            # fail only when one of its row groups is first read, mid-training.
            for path, schema in zip(self.paths, schemas, strict=True):
                names = set(schema.names)
                missing = [c for c in self.columns if c not in names]
                if missing:
                    raise ValueError(
                        f"columns {missing} are not in {path} (columns: {sorted(names)}); "
                        "pick columns every file has"
                    )
                _check_types(path, schema, self.paths[0], schemas[0], self.columns)
        self._file_of = np.asarray(files, np.int64)
        self._group_of = np.asarray(groups, np.int64)
        self._offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(np.asarray(rows, np.int64), out=self._offsets[1:])
        self._schema_text = str(schemas[0])
        self._handles: dict[int, Any] = {}
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self._fingerprint: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"], state["_cache"] = {}, OrderedDict()
        state["_shard_cache"] = None  # the local copies stay held by the original object
        return state

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def num_row_groups(self) -> int:
        return int(self._file_of.shape[0])

    @property
    def fingerprint(self) -> str:
        """Row-group layout, schema, file sizes and each file's footer hash (path independent)."""
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=12)
            h.update(self._offsets.tobytes())
            h.update(self._schema_text.encode())
            for path in self.paths:
                size, tail = _size_and_tail(path, 4096)
                h.update(size.to_bytes(8, "little"))
                h.update(tail)
            self._fingerprint = f"parquet:{len(self)}:{self.columns}:{h.hexdigest()}"
        return self._fingerprint

    def _row_group(self, g: int) -> Any:
        table = self._cache.get(g)
        if table is not None:
            self._cache.move_to_end(g)
            return table
        f = int(self._file_of[g])
        handle = self._handles.get(f)
        if handle is None:
            try:
                handle = self._handles[f] = _parquet_file(
                    self.paths[f], page_checksum_verification=True
                )
            except (OSError, _pyarrow().ArrowException) as e:
                raise SourceError(
                    f"cannot open the Parquet file {self.paths[f]}: {e}; it changed or was "
                    "damaged since the source was built"
                ) from e
        try:
            table = handle.read_row_group(int(self._group_of[g]), columns=self.columns)
        except (OSError, _pyarrow().ArrowException) as e:
            # a damaged file is not a bad sample: never let on_error substitute it
            raise SourceError(
                f"cannot read row group {int(self._group_of[g])} of {self.paths[f]} (rows "
                f"{int(self._offsets[g])}..{int(self._offsets[g + 1]) - 1}): {e}; the file is "
                "damaged, re-export it"
            ) from e
        self._cache[g] = table
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return table

    def __getitem__(self, i: int) -> Row:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        i %= n
        g = int(np.searchsorted(self._offsets, i, side="right")) - 1
        return self._row_group(g).slice(i - int(self._offsets[g]), 1).to_pylist()[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Row]:
        """Rows at ``indices`` in order; each needed row group is read (or fetched) once."""
        idx = _as_index_array(indices, len(self))
        groups = np.searchsorted(self._offsets, idx, side="right") - 1
        out: list[Row] = [{}] * idx.shape[0]
        for g in distinct(groups).tolist():
            where = np.flatnonzero(groups == g)
            local = idx[where] - self._offsets[g]
            rows = self._row_group(g).take(local).to_pylist()
            for pos, row in zip(where.tolist(), rows, strict=True):
                out[pos] = row
        return out


class ArrowSource:
    """Map-style rows over a ``pyarrow.Table`` or an Arrow IPC file (memory-mapped, zero copy).

    ``__getitems__`` is one vectorised ``take``. A table built in memory pickles with its data;
    pass a file path for worker processes to re-map it instead. A mapped file that changes
    size after opening (truncated or rewritten in place) is a :class:`SourceError` naming it
    at the next read (one ``fstat``, about 1 µs), not SIGBUS.
    """

    def __init__(self, table: Any, *, columns: Sequence[str] | None = None) -> None:
        pa = _pyarrow()
        self.path: Path | None = None
        self._mapped: Any = None  # the memory-mapped file under the table, if any
        if isinstance(table, (str, os.PathLike)):
            self.path = Path(table)
            self._mapped = pa.memory_map(os.fspath(table), "r")
            self._mapped_size = self._mapped.size()
            table = pa.ipc.open_file(self._mapped).read_all()
        if not isinstance(table, pa.Table):
            raise TypeError(
                f"table must be a pyarrow.Table or an Arrow IPC file path (got "
                f"{type(table).__name__}); convert with pyarrow.Table.from_pydict"
            )
        self.columns = list(columns) if columns is not None else None
        self.table = table.select(self.columns) if self.columns is not None else table

    def __reduce__(self) -> tuple[Any, ...]:
        if self.path is not None:
            return (_arrow_from_path, (self.path, self.columns))
        return (type(self), (self.table,))

    def __len__(self) -> int:
        return int(self.table.num_rows)

    @property
    def fingerprint(self) -> str:
        self.check_unchanged()  # it reads the first and last rows
        h = hashlib.blake2b(digest_size=12)
        h.update(str(self.table.schema).encode())
        n = len(self)
        for lo in (0, max(0, n - 8)):  # a cheap sample: schema, length and the first/last rows
            h.update(repr(self.table.slice(lo, 8).to_pylist()).encode())
        return f"arrow:{n}:{h.hexdigest()}"

    def check_unchanged(self) -> None:
        """Raise :class:`SourceError` naming the file if the mapped Arrow file no longer has
        the size it had when opened (nothing for an in-memory table)."""
        if self._mapped is None:
            return
        now = os.fstat(self._mapped.fileno()).st_size
        if now != self._mapped_size:
            raise SourceError(
                f"{self.path} changed size while open ({self._mapped_size} bytes when opened, "
                f"{now} now): it was truncated or rewritten in place under a running reader; "
                "write it under a new name or by rename, then reopen"
            )

    def __getitem__(self, i: int) -> Row:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        self.check_unchanged()
        return self.table.slice(i % n, 1).to_pylist()[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Row]:
        idx = _as_index_array(indices, len(self))
        self.check_unchanged()
        return self.table.take(idx).to_pylist()


def _arrow_from_path(path: Path, columns: list[str] | None) -> ArrowSource:
    return ArrowSource(path, columns=columns)
