"""A metric index: per-sample metric values, their sorted order, percentiles and a fingerprint.

Saved as a directory: ``values.npy`` (any numeric dtype), ``order.npy`` (int64 sample indices
sorted by value, ties by index), ``percentiles.npy`` (101 values: the value at 0, 1, ..., 100
percent, taken from the sorted values, so every percentile is an actual value) and
``meta.json`` (version, name, dtype, length, dataset fingerprint). :meth:`MetricIndex.load`
memory-maps the arrays, so a 10**9-sample index costs no RAM until read. An accumulated metric
(a token histogram) is saved the same way with ``accumulated.npy`` instead.

Both load from a URL too (``s3://bucket/metrics/seqlen``, any fsspec protocol), through the
node's shard cache (:class:`~meshfeed.storage.ShardCache`): ``meta.json`` first, then the files
it records, each downloaded once per node; a memory-mapped index holds its files in the cache
(never evicted) while it lives.

The fingerprint is the dataset length plus a hash of a fixed set of sampled items; loading an
index against another dataset raises ``ValueError`` instead of silently gating the wrong data.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.curriculum.index_files import META, VERSION, Folder, atomic_write, file_id
from meshfeed.mapped import check_mapped
from meshfeed.order.permutation import Permutation
from meshfeed.storage import ShardCache, StorageOptions
from meshfeed.storage.urls import local_only

__all__ = ["MetricIndex", "content_fingerprint", "load_accumulated"]

_SAMPLE_FILES = ("values.npy", "order.npy", "percentiles.npy")
_ACCUMULATED = "accumulated.npy"
_FINGERPRINT_ITEMS = 16
_URL_FIX = "for a URL use analyze(..., output_dir=URL), which uploads, or save locally and copy"
_STATE = ("name", "values", "order", "percentiles", "fingerprint")


#: Values hashed by their repr that is their content (any other object's repr may name its
#: address, which differs from process to process)
_PLAIN = (str, int, float, complex, bool, type(None), np.generic)


def _feed(h: Any, item: Any) -> bool:
    """Hash an item by content: arrays by dtype/shape/bytes, containers recursively. False
    when some part was hashed by the repr of an object that is not a plain value."""
    if hasattr(item, "detach") and hasattr(item, "cpu"):  # a torch tensor, without importing torch
        item = item.detach().cpu().numpy()
    if isinstance(item, np.ndarray):
        h.update(f"nd{item.dtype.str}{item.shape}".encode())
        h.update(np.ascontiguousarray(item).tobytes())
        return item.dtype.kind != "O"
    if isinstance(item, Mapping):
        h.update(b"map")
        plain = True
        for k in sorted(item, key=str):
            _feed(h, str(k))
            plain = _feed(h, item[k]) and plain
        return plain
    if isinstance(item, (list, tuple)):
        h.update(f"seq{len(item)}".encode())
        return all([_feed(h, x) for x in item])  # every element hashed, then all()
    if isinstance(item, (bytes, bytearray)):
        h.update(b"b" + bytes(item))
        return True
    h.update(f"{type(item).__name__}:{item!r}".encode())
    return isinstance(item, _PLAIN)


def content_fingerprint(dataset: Any, *, num_items: int = _FINGERPRINT_ITEMS) -> dict[str, Any]:
    """``{"length": n, "hash": hex}``: the length and a hash of ``num_items`` sampled items.

    The sampled indices are a fixed pseudo-random choice that depends only on the length, so
    two datasets with the same length and the same items there get the same fingerprint.
    """
    return _fingerprint(dataset, num_items)[0]


def _fingerprint(dataset: Any, num_items: int) -> tuple[dict[str, Any], bool]:
    """:func:`content_fingerprint`, and whether every item sampled was hashed by content."""
    n = len(dataset)
    h = hashlib.blake2b(digest_size=16)
    h.update(str(n).encode())
    plain = True
    if n:
        k = min(n, num_items)
        picks = Permutation(n, seed=0x0F1B)[np.arange(k)]
        for i in sorted(int(x) for x in picks):
            h.update(str(i).encode())
            plain = _feed(h, dataset[i]) and plain
    return {"length": n, "hash": h.hexdigest()}, plain


def stable_fingerprint(dataset: Any) -> dict[str, Any] | None:
    """:func:`content_fingerprint` of ``dataset`` where it is a stable fact of its content;
    None where it is not: a sampled item fails to read, holds an object hashed by its repr
    (which may name its address), or reads differently a second time (random augmentation).
    Reads the sampled items twice (32 items at most), never the whole dataset."""
    try:
        first, plain = _fingerprint(dataset, _FINGERPRINT_ITEMS)
        if not plain or _fingerprint(dataset, _FINGERPRINT_ITEMS)[0] != first:
            return None
    except Exception:  # a dataset's items may raise anything: no fingerprint, no check
        return None
    return first


def is_content_fingerprint(fingerprint: Any) -> bool:
    """Whether ``fingerprint`` is one :func:`content_fingerprint` makes (``meshfeed analyze``
    records it), rather than one given to :meth:`MetricIndex.from_values` by hand."""
    return (
        isinstance(fingerprint, Mapping)
        and set(fingerprint) == {"length", "hash"}
        and isinstance(fingerprint["hash"], str)
        and re.fullmatch(r"[0-9a-f]{32}", fingerprint["hash"]) is not None
    )


def check_fingerprint(expected: Mapping[str, Any], dataset: Any, *, what: str) -> None:
    """Raise ``ValueError`` when ``dataset`` does not match the fingerprint of ``what``."""
    got = content_fingerprint(dataset)
    if dict(expected) != got:
        raise ValueError(
            f"{what} was built for another dataset (index fingerprint {dict(expected)}, this "
            f"dataset {got}); rerun `meshfeed analyze` on this dataset or load the matching index"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricIndex:
    """Per-sample values of one metric plus the derived order, percentiles and fingerprint.

    ``values[i]`` is sample ``i``'s metric; ``order`` lists sample indices by increasing value
    (stable, ties by index); ``percentiles[p]`` is the value at ``p`` percent of ``order``.
    """

    name: str
    values: np.ndarray = field(repr=False)
    order: np.ndarray = field(repr=False)
    percentiles: np.ndarray = field(repr=False)
    fingerprint: dict[str, Any]
    # the shard cache holding the files of an index loaded from a URL (memory-mapped)
    _cache: ShardCache | None = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # the values and their facts, never the shard cache holding a URL index's files: the
        # receiving process has its own, and may not reach this one's cache_dir
        return {k: getattr(self, k) for k in _STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k in _STATE:
            object.__setattr__(self, k, state[k])
        object.__setattr__(self, "_cache", None)

    @classmethod
    def from_values(
        cls, name: str, values: np.ndarray, *, fingerprint: dict[str, Any]
    ) -> MetricIndex:
        """Build the index of ``values`` (sorts once: O(N log N))."""
        values = np.asarray(values)
        if values.ndim != 1 or values.dtype.kind not in "iuf":
            raise TypeError(
                f"metric {name!r} values must be a 1-D numeric array (got dtype {values.dtype}, "
                f"shape {values.shape})"
            )
        if values.dtype.kind == "f" and np.isnan(values).any():
            raise ValueError(f"metric {name!r} has NaN values; return a finite number per sample")
        if len(values) != fingerprint["length"]:
            raise ValueError(
                f"metric {name!r} has {len(values)} values for a dataset of "
                f"{fingerprint['length']} samples"
            )
        order = np.argsort(values, kind="stable").astype(np.int64)
        return cls(
            name=name,
            values=values,
            order=order,
            percentiles=percentile_table(values[order]),
            fingerprint=dict(fingerprint),
        )

    def __len__(self) -> int:
        return len(self.values)

    def check_unchanged(self) -> None:
        """Raise :class:`~meshfeed.errors.SourceError` naming the file if a memory-mapped
        ``values.npy`` / ``order.npy`` was truncated in place since :meth:`load` (reading it
        would kill the process with SIGBUS); about 1 µs per array, nothing for in-memory ones."""
        check_mapped(self.values, what=f"values of metric {self.name!r}")
        check_mapped(self.order, what=f"order of metric {self.name!r}")

    def sorted_values(self) -> np.ndarray:
        self.check_unchanged()
        return np.asarray(self.values[self.order])

    def percentile_count(self, percent: float | np.ndarray) -> np.ndarray:
        """How many samples the lowest ``percent`` percent is: ``floor(percent * N / 100)``."""
        p = np.clip(np.asarray(percent, dtype=np.float64), 0.0, 100.0)
        return np.floor(p * len(self) / 100.0 + 1e-9).astype(np.int64)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the index under ``path`` atomically: a reader sees the old or the new one.

        Each array goes to a unique temporary file that is renamed into place; ``meta.json``
        (renamed last) records each array's size and a hash of its ends, and :meth:`load`
        refuses a directory whose arrays do not match it (an interrupted save).
        """
        return _save(
            local_only(path, what="MetricIndex.save", fix=_URL_FIX),
            {
                "values.npy": self.values,
                "order.npy": self.order,
                "percentiles.npy": self.percentiles,
            },
            kind="sample",
            name=self.name,
            dtype=np.asarray(self.values).dtype.str,
            length=len(self),
            fingerprint=self.fingerprint,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        dataset: Any = None,
        mmap: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        storage_options: StorageOptions | None = None,
    ) -> MetricIndex:
        """Load a saved index (memory-mapped); with ``dataset``, refuse a mismatched one.

        Checks that the arrays are the ones ``meta.json`` recorded and agree with each other
        (lengths, dtype, percentiles of the sorted values); O(1) reads beyond the headers.
        ``path`` may be a URL (``s3://bucket/metrics/seqlen``): it is read through the shard
        cache at ``cache_dir`` (``cache_limit``, ``storage_options``: see
        :class:`~meshfeed.storage.ShardCache`), and the index holds its cached files while it
        lives.
        """
        folder = Folder(path, cache_dir=cache_dir, cache_limit=cache_limit, options=storage_options)
        try:
            index = cls._load(folder, dataset=dataset, mmap=mmap)
        except BaseException:
            folder.close()
            raise
        if mmap and folder.cache is not None:
            object.__setattr__(index, "_cache", folder.cache)  # holds the mapped files
        else:
            folder.close()
        return index

    @classmethod
    def _load(cls, folder: Folder, *, dataset: Any, mmap: bool) -> MetricIndex:
        meta = folder.meta()
        where = folder.where
        if meta.get("kind") != "sample":
            raise ValueError(
                f"{where} holds an accumulated metric ({meta.get('name')!r}), not per-sample "
                "values; load it with load_accumulated()"
            )
        if dataset is not None:
            check_fingerprint(meta["fingerprint"], dataset, what=f"metric index {where}")
        src = folder.files(meta, _SAMPLE_FILES)
        index = cls(
            name=meta["name"],
            values=np.load(src / "values.npy", mmap_mode="r" if mmap else None),
            order=np.load(src / "order.npy", mmap_mode="r" if mmap else None),
            percentiles=np.load(src / "percentiles.npy"),
            fingerprint=meta["fingerprint"],
        )
        _check_consistent(index, where, meta)
        return index


def _check_consistent(index: MetricIndex, src: str, meta: dict[str, Any]) -> None:
    n = len(index.values)
    problem = None
    if n != meta.get("length") or index.order.shape != (n,):
        problem = f"{n} values, {index.order.shape[0]} order entries, length {meta.get('length')}"
    elif np.asarray(index.values).dtype.str != meta.get("dtype"):
        problem = f"values of dtype {np.asarray(index.values).dtype.str}, meta {meta.get('dtype')}"
    elif index.percentiles.shape != (101,):
        problem = f"{index.percentiles.shape[0]} percentiles instead of 101"
    elif n:
        # 101 reads, not N: the percentile ranks of the order must point at the recorded values
        picks = np.asarray(index.order[np.minimum(np.arange(101) * n // 100, n - 1)])
        if int(picks.min()) < 0 or int(picks.max()) >= n:
            problem = "order entries outside the sample range"
        elif not np.array_equal(np.asarray(index.values[picks]), index.percentiles):
            problem = "percentiles that are not those of the values in their order"
    if problem is not None:
        raise ValueError(
            f"the metric index {src} is inconsistent ({problem}); it was damaged or saved "
            "partially: rerun `meshfeed analyze`"
        )


def percentile_table(sorted_values: np.ndarray) -> np.ndarray:
    """The value at 0..100 percent of an ascending array (nearest lower rank, an actual value)."""
    n = len(sorted_values)
    if n == 0:
        return np.zeros(101, dtype=sorted_values.dtype)
    ranks = np.minimum(np.arange(101) * n // 100, n - 1)
    return np.asarray(sorted_values[ranks])


def save_accumulated(
    path: str | os.PathLike[str], name: str, array: np.ndarray, fp: dict[str, Any]
) -> Path:
    """Write an accumulated metric under ``path`` atomically, as :meth:`MetricIndex.save` does
    (``meta.json`` last, recording the array file)."""
    out = local_only(path, what="save_accumulated", fix=_URL_FIX)
    return _save(out, {_ACCUMULATED: array}, kind="accumulated", name=name, fingerprint=fp)


def _save(out: Path, arrays: dict[str, Any], **meta: Any) -> Path:
    """Write each array of ``arrays`` under ``out`` atomically, then ``meta.json`` (``meta``
    plus the version and each file's record) last, atomically too."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, array in arrays.items():
        atomic_write(out / name, lambda f, a=array: np.save(f, np.asarray(a)))
        files[name] = file_id(out / name)
    text = json.dumps({"version": VERSION, **meta, "files": files}, indent=1, sort_keys=True)
    atomic_write(out / META, lambda f: f.write(text.encode()))
    return out


def load_accumulated(
    path: str | os.PathLike[str],
    *,
    dataset: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    storage_options: StorageOptions | None = None,
) -> np.ndarray:
    """Load an accumulated metric (e.g. the token histogram) saved by the analyzer.

    ``path`` may be a URL, read through the shard cache as in :meth:`MetricIndex.load`.
    """
    folder = Folder(path, cache_dir=cache_dir, cache_limit=cache_limit, options=storage_options)
    try:
        meta = folder.meta()
        if meta.get("kind") != "accumulated":
            raise ValueError(
                f"{folder.where} holds per-sample values; load it with MetricIndex.load()"
            )
        if dataset is not None:
            check_fingerprint(
                meta["fingerprint"], dataset, what=f"accumulated metric {folder.where}"
            )
        return np.load(folder.files(meta, (_ACCUMULATED,)) / _ACCUMULATED)
    finally:
        folder.close()
