"""Samples for meshfeed shards: what a field may hold, the schema, and the cut into shards.

The first sample fixes the fields (names, kinds, dtypes, ranks); every later one is checked
against it in the writing process, so a bad sample is refused by row and field before any
shard holding it is written, and shards are cut the same way whatever the worker count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from meshfeed.sources.shards.format import FieldSpec

__all__ = ["Schema", "chunks"]

_SCALARS: dict[type, tuple[str, str]] = {
    bool: ("bool", "bool"),
    int: ("int", "int64"),
    float: ("float", "float64"),
}
_SUPPORTED = (
    "torch tensors, numpy arrays and scalars of numeric dtype, int, float, bool, str and bytes"
)


def _refuse(name: str, row: int, what: str) -> TypeError:
    return TypeError(f"row {row} field {name!r}: {what}")


def _normalize(name: str, row: int, value: Any) -> tuple[str, str, int, Any]:
    """``(kind, dtype, ndim, payload)``: payload is an ndarray, bytes or a Python scalar."""
    t = type(value)
    if t is np.ndarray and value.flags.c_contiguous and value.dtype.byteorder != ">":
        return "ndarray", _numeric(name, row, value.dtype), value.ndim, value  # the common case
    if t in _SCALARS:
        kind, dtype = _SCALARS[t]
        return kind, dtype, 0, value
    if isinstance(value, str):
        try:
            return "str", "uint8", 1, value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _refuse(name, row, f"str is not encodable as UTF-8 ({e})") from e
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", "uint8", 1, bytes(value)
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            return "tensor", "bfloat16", tensor.ndim, tensor.view(torch.uint16).numpy()
        try:
            arr = tensor.numpy()
        except TypeError as e:
            raise _refuse(name, row, f"tensor of dtype {tensor.dtype} has no numpy dtype") from e
        return "tensor", _numeric(name, row, arr.dtype), arr.ndim, arr
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)  # (ascontiguousarray would make a 0-d array 1-d)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        kind = "ndarray" if isinstance(value, np.ndarray) else "npscalar"
        return kind, _numeric(name, row, arr.dtype), arr.ndim, arr
    raise _refuse(
        name,
        row,
        f"{t.__module__}.{t.__qualname__} is not supported; shards hold {_SUPPORTED} "
        "(nothing is pickled, so shards are safe to read): convert it, e.g. json.dumps a "
        "nested object into a str field",
    )


_NAMES: dict[np.dtype[Any], str] = {}  # dtype.name is slow (Python) and asked per value


def _numeric(name: str, row: int, dtype: np.dtype[Any]) -> str:
    known = _NAMES.get(dtype)
    if known is not None:
        return known
    if dtype.kind not in "biufc":
        raise _refuse(name, row, f"dtype {dtype} is not numeric; store text as str fields")
    _NAMES[dtype] = dtype.name
    return dtype.name


def _nbytes(payload: Any) -> int:
    if isinstance(payload, np.ndarray):
        return payload.nbytes
    return len(payload) if isinstance(payload, bytes) else 8


class Schema:
    """The fields of the first sample; every later one must match them."""

    def __init__(self, sample: Any) -> None:
        self.bare = not isinstance(sample, dict)
        names = [""] if self.bare else list(sample)
        if not names:
            raise ValueError(
                "row 0 is a dict with no fields: a sample needs at least one field; give each "
                "sample a field, e.g. {'x': value}, or write bare values"
            )
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"row 0: sample keys must be str (got {n!r}); rename the field")
        self.names, self._keys = names, set(names)
        self.fields = [
            FieldSpec(name=n, kind=k, dtype=d, ndim=nd)
            for n, (k, d, nd, _) in zip(names, self._row(0, sample, first=True), strict=True)
        ]

    def _row(
        self, row: int, sample: Any, *, first: bool = False
    ) -> list[tuple[str, str, int, Any]]:
        if self.bare:
            if isinstance(sample, dict):
                raise TypeError(f"row {row} is a dict but row 0 was a bare value")
            return [_normalize("", row, sample)]
        if not isinstance(sample, dict) or (not first and sample.keys() != self._keys):
            got = sorted(sample) if isinstance(sample, dict) else type(sample).__name__
            raise TypeError(
                f"row {row} has fields {got}, but row 0 had {sorted(self.names)}: every sample "
                "needs the same fields"
            )
        return [_normalize(n, row, sample[n]) for n in self.names]

    def check(self, row: int, sample: Any) -> tuple[list[Any], int]:
        """The row's payloads and byte size; a field of another kind/dtype/rank is refused."""
        out, size = [], 0
        for spec, (kind, dtype, ndim, payload) in zip(
            self.fields, self._row(row, sample), strict=True
        ):
            if (kind, dtype, ndim) != (spec.kind, spec.dtype, spec.ndim):
                raise TypeError(
                    f"row {row} field {spec.name!r} is {kind} {dtype} of {ndim} dims, but row 0 "
                    f"had {spec.kind} {spec.dtype} of {spec.ndim} dims: cast it to match"
                )
            out.append(payload)
            size += _nbytes(payload)
        return out, size


def chunks(
    samples: Iterable[Any], rows_per_shard: int | None, bytes_per_shard: int | None
) -> Iterator[tuple[Schema, list[list[Any]]]]:
    """Cut the samples into shards (columns of payloads), checking each against the schema."""
    schema: Schema | None = None
    columns: list[list[Any]] = []
    size = rows = 0
    for i, sample in enumerate(samples):
        if schema is None:
            schema = Schema(sample)
            columns = [[] for _ in schema.fields]
        payloads, nbytes = schema.check(i, sample)
        for col, p in zip(columns, payloads, strict=True):
            col.append(p)
        rows, size = rows + 1, size + nbytes
        if (rows_per_shard is not None and rows >= rows_per_shard) or (
            bytes_per_shard is not None and size >= bytes_per_shard
        ):
            yield schema, columns
            columns = [[] for _ in schema.fields]
            size = rows = 0
    if schema is None:
        raise ValueError("no samples to write; write_shards needs at least one sample")
    if rows:
        yield schema, columns
