"""Columnar storage: a put's tensor or array column stays one :class:`Chunk`.

A sample's field then holds a :class:`Cell` ``(chunk, row)`` instead of its own tensor, so a put
of ``n`` rows costs one reference per row, not ``n`` tensor objects (and, on Ray, one pickled
column, not ``n``). :func:`gather` builds a batch column from cells with one ``index_select``
/ ``take`` per run of cells from one chunk and one ``cat`` over the runs; when the rows are
contiguous in one chunk the result is a *view* of the put's column (no copy: the caller must not
write into it if the producer may still read its column). Fields of one sample may come from
different puts: each field's cells point into its own chunks.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import numpy as np

__all__ = ["Cell", "Chunk", "Gathered", "gather", "resolve"]


class Chunk:
    """One put's column (a tensor or array of shape ``[n, ...]``)."""

    __slots__ = ("data", "row_nbytes")

    def __init__(self, data: Any) -> None:
        self.data = data
        n = len(data)
        self.row_nbytes = int(data.nbytes if isinstance(data, np.ndarray) else _tbytes(data)) // n

    def __len__(self) -> int:
        return len(self.data)

    def __reduce__(self) -> Any:
        data = self.data
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(data, torch.Tensor):
            data = data.contiguous().clone() if data._base is not None else data.contiguous()
        elif isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data)  # a broadcast view would pickle its full size
        return (Chunk, (data,))


def _tbytes(t: Any) -> int:
    return int(t.element_size() * t.numel())


class Cell:
    """Row ``row`` of ``chunk``: one sample's value of one field."""

    __slots__ = ("chunk", "row")

    def __init__(self, chunk: Chunk, row: int) -> None:
        self.chunk, self.row = chunk, row

    def value(self) -> Any:
        return self.chunk.data[self.row]


class Gathered:
    """A batch column already assembled from cells (``store.collate`` passes it through)."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data


def resolve(value: Any) -> Any:
    """The plain value of a stored field value (a cell's row, else the value itself)."""
    return value.value() if type(value) is Cell else value


def gather(values: list[Any]) -> Any:
    """A batch column from the stored values of one field, in order.

    All cells of chunks of one kind, dtype and row shape: a :class:`Gathered` column (a view
    for one contiguous run of one chunk). Otherwise a list of plain values.
    """
    if not values or any(type(v) is not Cell for v in values):
        return [resolve(v) for v in values]
    first = values[0].chunk.data
    is_np = isinstance(first, np.ndarray)
    for v in values:
        d = v.chunk.data
        if isinstance(d, np.ndarray) != is_np or d.dtype != first.dtype:
            return [resolve(v) for v in values]
        if d.shape[1:] != first.shape[1:]:
            return [resolve(v) for v in values]
    runs: list[tuple[Chunk, list[int]]] = []
    for v in values:
        if runs and runs[-1][0] is v.chunk:
            runs[-1][1].append(v.row)
        else:
            runs.append((v.chunk, [v.row]))
    pieces = [_take(chunk.data, rows, is_np) for chunk, rows in runs]
    if len(pieces) == 1:
        return Gathered(pieces[0])
    if is_np:
        return Gathered(np.concatenate(pieces))
    import torch

    return Gathered(torch.cat(pieces))


def _take(data: Any, rows: list[int], is_np: bool) -> Any:
    lo = rows[0]
    if all(b - a == 1 for a, b in itertools.pairwise(rows)):
        return data[lo : lo + len(rows)]  # contiguous: a view
    if is_np:
        return data.take(rows, axis=0)
    import torch

    return data.index_select(0, torch.as_tensor(rows, device=data.device))
