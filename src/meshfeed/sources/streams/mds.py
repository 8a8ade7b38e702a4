"""MosaicML Streaming's MDS shards as a sharded stream, read from the format itself.

``mds_stream(root)`` reads ``root/index.json`` (format version 2) and returns a
:class:`~meshfeed.sources.ShardedStream` over its shards, with the row counts the index records
(nothing is counted). Rows are samples: dicts column -> value, read by index through
:class:`MDSReader` (``streaming`` is not needed)::

    from meshfeed import StreamLoader
    from meshfeed.sources.streams.mds import mds_stream

    loader = StreamLoader(mds_stream("/data/my-mds", shuffle_buffer=10_000), batch_size=32)

Column encodings and what a sample holds for them:

- ``int8`` .. ``int64``, ``uint8`` .. ``uint64``, ``float16`` .. ``float64``: a NumPy scalar;
  ``int``: a Python int; ``str_int`` / ``str_float`` / ``str_decimal``: int, float, Decimal;
- ``str``: str; ``bytes``: bytes; ``json``: the parsed value;
- ``ndarray[:dtype[:shape]]``: a writable NumPy array (dtype and shape from the encoding, else
  from each sample's header, as MDS writes them);
- image encodings (``pil``, ``jpeg``, ``png``, ``jpeg_array``, ``list[...]``): the encoded bytes
  as stored (decode them in your map or collate, e.g. ``PIL.Image.open(io.BytesIO(b))``; ``pil``
  is MDS's raw layout: uint32 width, height, mode length, mode, pixels);
- ``pkl`` is refused: unpickling runs arbitrary code; rewrite the column as ``json``/``bytes``.

Compressed shards (``zstd``, ``gz``, ``bz2``) are decompressed whole on first use and kept per
process (the last ``cache_shards`` of them); uncompressed shards are read by seeking, one read
per contiguous run of wanted rows. All I/O goes through ``open_file`` (see
:mod:`meshfeed.sources.streams.files`): URL roots (``http(s)://``, ``s3://``, any fsspec protocol)
are read by byte ranges through :func:`meshfeed.storage.open_url` by default; pass an
``open_file`` to read them another way.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
import posixpath
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshfeed.errors import ShardRowsError, SourceError
from meshfeed.sources.streams.files import HandleCache, OpenFile, file_size, open_shard, read_at
from meshfeed.sources.streams.files import shard_version as _file_version
from meshfeed.sources.streams.mds_encodings import decoder
from meshfeed.sources.streams.readers import rows_by_take
from meshfeed.sources.streams.stream import ShardedStream

__all__ = ["MDSReader", "mds_stream"]

_COMPRESSIONS = ("zstd", "gz", "bz2")


@dataclass(frozen=True, slots=True)
class _Shard:
    """What the index says about one shard file."""

    name: str  # the file the stream reads (the compressed one if compressed)
    samples: int
    columns: tuple[str, ...]
    encodings: tuple[str, ...]  # decoders are made per process (lambdas do not pickle)
    sizes: tuple[int | None, ...]
    compression: str | None
    raw_bytes: int
    recorded: str | None  # the index's size and hashes of that file, if it records hashes


def _join(root: str, name: str) -> str:
    return posixpath.join(root, name) if "://" in root else os.path.join(root, name)


def _parse_entry(obj: Any, i: int, index: str, root: str) -> _Shard:
    """Shard entry ``i`` of ``index``; a malformed entry (a field missing or of the wrong
    kind, not one encoding and size per column) is a :class:`SourceError` naming it. An entry
    of a format or encoding meshfeed does not read stays a ``ValueError`` saying so."""

    def damaged(why: str) -> SourceError:
        return SourceError(
            f"{index!r}: shard entry {i} is malformed ({why}); the index is damaged (write it "
            "again with the MDS writer)"
        )

    if not isinstance(obj, dict):
        raise damaged(f"{obj!r} is not a dict")
    lists = [obj.get(k) for k in ("column_names", "column_encodings", "column_sizes")]
    if not all(isinstance(v, list) for v in lists):
        raise damaged("column_names, column_encodings and column_sizes must be lists")
    if len({len(v) for v in lists}) > 1:  # type: ignore[arg-type]
        raise damaged(
            f"{len(lists[0])} column_names, {len(lists[1])} column_encodings and "  # type: ignore[arg-type]
            f"{len(lists[2])} column_sizes: one of each per column"  # type: ignore[arg-type]
        )
    try:
        return _parse_shard(obj, root)
    except (KeyError, TypeError, AttributeError) as exc:
        raise damaged(f"{type(exc).__name__}: {exc}") from exc
    except ValueError as exc:
        if str(exc).startswith("invalid literal"):  # a count that is no number
            raise damaged(str(exc)) from exc
        raise


def _parse_shard(obj: dict[str, Any], root: str) -> _Shard:
    where = f"shard {obj.get('raw_data', {}).get('basename')!r} of {root!r}"
    if obj.get("version") != 2 or obj.get("format") != "mds":
        raise ValueError(
            f"{where} has format {obj.get('format')!r} version {obj.get('version')!r}; "
            "meshfeed reads MDS version 2 ('format': 'mds') only"
        )
    compression = obj.get("compression") or None
    algo = compression.split(":")[0] if compression else None
    if algo is not None and algo not in _COMPRESSIONS:
        raise ValueError(
            f"{where} is compressed with {compression!r}; meshfeed reads {_COMPRESSIONS} "
            "(rewrite the shards with compression='zstd')"
        )
    names, encodings = obj["column_names"], obj["column_encodings"]
    for e, c in zip(encodings, names, strict=True):
        decoder(e, c)  # refuses pkl and unknown encodings up front
    stored = obj["zip_data"] if algo else obj["raw_data"]
    hashes = stored.get("hashes") or {}
    recorded = ",".join(f"{k}={v}" for k, v in sorted(hashes.items())) if hashes else None
    return _Shard(
        name=_join(root, stored["basename"]),
        samples=int(obj["samples"]),
        columns=tuple(names),
        encodings=tuple(encodings),
        sizes=tuple(int(s) if s else None for s in obj["column_sizes"]),
        compression=algo,
        raw_bytes=int(obj["raw_data"]["bytes"]),
        recorded=f"{stored['bytes']}:{recorded}" if recorded else None,
    )


def _decompress(algo: str, data: bytes, shard: _Shard) -> bytes:
    try:
        if algo == "zstd":
            try:
                import zstandard
            except ImportError as exc:
                raise ImportError(
                    f'shard {shard.name!r} is zstd-compressed; pip install "meshfeed[zstd]"'
                ) from exc
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=shard.raw_bytes)
        else:
            out = gzip.decompress(data) if algo == "gz" else bz2.decompress(data)
    except ImportError:
        raise
    except Exception as exc:  # each codec raises its own error type for damaged data
        raise SourceError(f"cannot decompress shard {shard.name!r} ({algo}): {exc}") from exc
    if len(out) != shard.raw_bytes:
        raise SourceError(
            f"shard {shard.name!r} decompresses to {len(out)} bytes, its index says "
            f"{shard.raw_bytes}: the shard or index.json is damaged or out of date"
        )
    return bytes(out)


def _check_offsets(shard: _Shard, head: bytes, offsets: np.ndarray, size: int) -> None:
    n = int(np.frombuffer(head, np.uint32)[0])
    first = 4 + 4 * (shard.samples + 1)
    if (
        n != shard.samples
        or (shard.samples and offsets[0] < first)
        or np.any(np.diff(offsets) < 0)
        or offsets[-1] != size
    ):
        raise SourceError(
            f"MDS shard {shard.name!r} is damaged or does not match index.json (header: {n} "
            f"samples ending at byte {int(offsets[-1])}; index: {shard.samples} samples, file: "
            f"{size} bytes); rewrite the shard and its index"
        )


class MDSReader:
    """Reads the shards of one MDS dataset by sample index (the ``ShardedStream`` reader
    protocol: ``take``, ``count``, ``version`` and ``reader(shard, start, stop)``).

    ``root``: the dataset directory (or URL) holding ``index.json``, or that file's path.
    ``shards`` are the shard files' names in index order and ``rows`` their sample counts.
    Picklable: open files and decompressed shards stay in the process that made them.
    """

    #: Shards may be URLs: this reader reads them itself (HTTP byte ranges through
    #: ``open_file``), so a ShardedStream does not route them through the shard cache.
    reads_urls = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        open_file: OpenFile | None = None,
        cache_shards: int = 4,
    ) -> None:
        root = os.fspath(root)
        index = root if root.endswith(".json") else _join(root, "index.json")
        self.root = posixpath.dirname(index) if "://" in index else os.path.dirname(index)
        self.open_file = open_file or open_shard
        self.cache_shards = max(1, int(cache_shards))
        try:
            with self.open_file(index) as f:
                obj = json.loads(f.read())
        except (OSError, ValueError) as exc:
            raise SourceError(f"cannot read MDS index {index!r}: {exc}") from exc
        if not isinstance(obj, dict) or obj.get("version") != 2 or "shards" not in obj:
            raise ValueError(f"{index!r} is not an MDS index.json of version 2")
        entries = obj["shards"]
        if not isinstance(entries, list):
            raise SourceError(
                f"{index!r} has 'shards': {entries!r}, not a list of shard entries; the index "
                "is damaged (write it again with the MDS writer)"
            )
        self._shards = {
            s.name: s for s in (_parse_entry(o, i, index, self.root) for i, o in enumerate(entries))
        }
        self.__setstate__(self.__getstate__())

    @property
    def shards(self) -> list[str]:
        return list(self._shards)

    @property
    def rows(self) -> list[int]:
        return [s.samples for s in self._shards.values()]

    def __getstate__(self) -> dict[str, Any]:
        keep = ("root", "open_file", "cache_shards", "_shards")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._handles = HandleCache(self.open_file)
        self._offsets: dict[str, np.ndarray] = {}
        self._unzipped: OrderedDict[str, bytes] = OrderedDict()

    # ------------------------------------------------------------------ the reader protocol
    def count(self, shard: Any) -> int:
        return self._info(shard).samples

    def version(self, shard: Any) -> str:
        info = self._info(shard)
        return info.recorded or _file_version(info.name, self.open_file)

    def __call__(self, shard: Any, start: int, stop: int | None) -> Iterator[dict[str, Any]]:
        n = self._info(shard).samples
        return rows_by_take(self.take, shard, start, n if stop is None else min(stop, n))

    def take(self, shard: Any, rows: np.ndarray | Sequence[int]) -> list[dict[str, Any]]:
        """The samples at these row indices of ``shard`` (any order, repeats allowed): one
        read per contiguous run of wanted rows."""
        info = self._info(shard)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= info.samples):
            raise ShardRowsError(
                f"rows out of range for MDS shard {info.name!r} of {info.samples} samples "
                f"(got values in [{rows.min()}, {rows.max()}]); if a stream asked for them, "
                "rows= overstates the shard"
            )
        offsets = self._layout(info)
        uniq = np.unique(rows)
        found: dict[int, dict[str, Any]] = {}
        for run in np.split(uniq, np.flatnonzero(np.diff(uniq) != 1) + 1) if uniq.size else []:
            a, b = int(run[0]), int(run[-1]) + 1
            lo, hi = int(offsets[a]), int(offsets[b])
            block = memoryview(bytearray(self._bytes(info, lo, hi)))  # writable arrays
            for r in range(a, b):
                found[r] = self._sample(info, block[offsets[r] - lo : offsets[r + 1] - lo], r)
        return [found[r] for r in rows.tolist()]

    # ------------------------------------------------------------------ internals
    def _info(self, shard: Any) -> _Shard:
        info = self._shards.get(os.fspath(shard))
        if info is None:
            raise KeyError(
                f"{shard!r} is not a shard of the MDS dataset at {self.root!r}; pass one of "
                f"reader.shards (e.g. {next(iter(self._shards), None)!r})"
            )
        return info

    def _unzip(self, info: _Shard) -> bytes:
        data = self._unzipped.get(info.name)
        if data is None:
            f = self._handles.get(info.name)
            raw = read_at(f, 0, file_size(f, shard=info.name), shard=info.name, what="the file")
            data = _decompress(info.compression or "", raw, info)
            while len(self._unzipped) >= self.cache_shards:
                self._unzipped.popitem(last=False)
            self._unzipped[info.name] = data
        self._unzipped.move_to_end(info.name)
        return data

    def _bytes(self, info: _Shard, lo: int, hi: int) -> bytes:
        if info.compression:
            return self._unzip(info)[lo:hi]
        f = self._handles.get(info.name)
        return read_at(f, lo, hi - lo, shard=info.name, what=f"bytes [{lo}, {hi})")

    def _layout(self, info: _Shard) -> np.ndarray:
        """The shard's sample offsets (its header), read and checked once per process."""
        offsets = self._offsets.get(info.name)
        if offsets is None:
            n = info.samples
            if info.compression:
                size = info.raw_bytes
                head = self._bytes(info, 0, 4 + 4 * (n + 1))
            else:
                size = file_size(self._handles.get(info.name), shard=info.name)
                head = self._bytes(info, 0, min(size, 4 + 4 * (n + 1)))
                if len(head) < 4 + 4 * (n + 1):
                    raise SourceError(f"MDS shard {info.name!r} is truncated ({size} bytes)")
            offsets = np.frombuffer(head, np.uint32, n + 1, 4).astype(np.int64)
            _check_offsets(info, head, offsets, size)
            self._offsets[info.name] = offsets
        return offsets

    def _sample(self, info: _Shard, m: memoryview, row: int) -> dict[str, Any]:
        nvar = sum(s is None for s in info.sizes)
        var = iter(np.frombuffer(m, np.uint32, nvar).tolist() if len(m) >= 4 * nvar else ())
        sizes = [s if s is not None else next(var, -1) for s in info.sizes]
        if min(sizes, default=0) < 0 or 4 * nvar + sum(sizes) != len(m):
            raise SourceError(
                f"sample {row} of MDS shard {info.name!r} is damaged: its column sizes do not "
                f"add up to its {len(m)} bytes"
            )
        at, out = 4 * nvar, {}
        for col, enc, n in zip(info.columns, info.encodings, sizes, strict=True):
            try:
                out[col] = decoder(enc, col)(m[at : at + n])
            except Exception as exc:  # the decoders are exact: a failure is damaged bytes
                raise SourceError(
                    f"column {col!r} ({enc}) of sample {row} of MDS shard {info.name!r} is "
                    f"damaged: {type(exc).__name__}: {exc}"
                ) from exc
            at += n
        return out


def mds_stream(
    root: str | os.PathLike[str],
    *,
    open_file: OpenFile | None = None,
    cache_shards: int = 4,
    **stream_kwargs: Any,
) -> ShardedStream:
    """A :class:`ShardedStream` over the MDS dataset at ``root`` (a directory or URL holding
    ``index.json``, or that file): its shards in index order, with the index's sample counts
    as ``rows=``. ``stream_kwargs`` go to ``ShardedStream`` (``shuffle_buffer``, ``seed``,
    ``samples_per_epoch``)."""
    reader = MDSReader(root, open_file=open_file, cache_shards=cache_shards)
    return ShardedStream(reader.shards, reader, rows=reader.rows, **stream_kwargs)
