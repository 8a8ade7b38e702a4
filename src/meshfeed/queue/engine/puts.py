"""Adding samples to a partition: validation of a put to given ids, and the two layouts.

A put of new samples whose columns are all chunks or scalar lists is stored as one
:class:`~meshfeed.queue.engine.records.Run` under its ids (:func:`put_run`); anything else (fields
added to existing samples, groups, other values) as a :class:`~meshfeed.queue.engine.records.Sample`
per sample (:func:`put_samples`). :meth:`StoreCore.try_put <meshfeed.queue.engine.core.StoreCore.try_put>`
chooses, after :func:`check_put` validated a put that touches existing samples.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from meshfeed.queue.engine.columns import Cell, Chunk, RemoteChunk
from meshfeed.queue.engine.records import SCALAR_TYPES, Partition, Ref, Run, Sample, nbytes_of

__all__ = ["check_put", "put_run", "put_samples", "run_columns"]

Key = Hashable


def run_columns(rows: Mapping[str, Any]) -> bool:
    """Whether a put's columns can be stored as one :class:`Run`: chunks and scalar lists."""
    for column in rows.values():
        t = type(column)
        if t is not Chunk and not (t is list and set(map(type, column)) <= SCALAR_TYPES):
            return False
    return True


def put_run(part: Partition, rows: Mapping[str, Any], ids: list[Key], n: int) -> None:
    """New samples with every column a chunk or scalars: one :class:`Run` for all."""
    first = ids[0]
    start = first if isinstance(first, int) else 0
    consecutive = type(first) is int and ids == list(range(start, start + n))
    # A list column is copied (the caller may reuse it); a chunk is the caller's column.
    columns = {f: c if type(c) is Chunk else list(c) for f, c in rows.items()}
    run = Run(columns, None if consecutive else ids, start)
    part.samples.update(dict.fromkeys(ids, run))
    part.add_run(ids, consecutive=consecutive)
    top = ids[-1] if consecutive else max((k for k in ids if type(k) is int), default=-1)
    if top >= part.next_id:  # type: ignore[operator]
        part.next_id = top + 1  # type: ignore[operator]


def put_samples(
    part: Partition,
    rows: Mapping[str, list[Any]],
    ids: list[Key],
    groups: list[Hashable] | None,
) -> None:
    """The general put: a :class:`Sample` per sample, fields added to existing ones."""
    part.not_runs()  # a sample of its own: the fast path's ranges no longer describe them
    samples = part.samples
    columns = list(rows.items())
    pendings = list(part.pending.values())
    next_id = part.next_id
    for i, k in enumerate(ids):
        sample = samples.get(k)
        group = None if groups is None else groups[i]
        if sample is None:
            sample = samples[k] = Sample(group)
            for pending in pendings:
                pending[k] = None
            if type(k) is int and k >= next_id:
                next_id = k + 1
        else:
            sample = part.sample(k)
            if group is not None:
                sample.group = group
        fields = sample.fields
        for f, column in columns:
            if type(column) is Chunk:  # a row of the put's column, not a copy of it
                fields[f] = Cell(column, i)
                sample.nbytes += column.row_nbytes
                continue
            if type(column) is RemoteChunk:  # a row of a column in Ray's object store
                fields[f] = Cell(column, i)
                sample.remote += column.row_nbytes
                continue
            value = column[i]
            fields[f] = value
            if type(value) in SCALAR_TYPES:  # the common small sample: no size probing
                sample.nbytes += 8
                continue
            sample.nbytes += nbytes_of(value)
            if isinstance(value, Ref):
                sample.remote += value.nbytes
    part.next_id = next_id


def check_put(
    partition: str,
    part: Partition,
    rows: Mapping[str, list[Any]],
    ids: list[Key],
    groups: list[Hashable] | None,
) -> int:
    """Validate a put to given ids before changing anything; the number of new ids."""
    n_new = 0
    for i, k in enumerate(ids):
        sample = part.samples.get(k)
        if sample is None:
            n_new += 1
            continue
        again = sorted(f for f in rows if f in sample.fields)
        if again:
            raise ValueError(
                f"sample {k!r} of partition {partition!r} already has fields {again}; "
                "each field of a sample is produced once (delete the sample to redo it)"
            )
        group = None if groups is None else groups[i]
        if group is not None and sample.group is not None and sample.group != group:
            raise ValueError(
                f"sample {k!r} was put with group {sample.group!r}, now with {group!r}; "
                "a sample belongs to one group"
            )
    return n_new
