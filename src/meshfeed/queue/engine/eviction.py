"""Eviction: a partition drops a sample once nothing needs it any more.

A sample goes when every declared task consumed it and nothing keeps it: no shared plan pins
it, no loader holds it, no lease has it out. Each function returns how many samples it
dropped, so the core keeps its ``held`` / ``dropped`` counts.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from itertools import repeat

from meshfeed.queue.engine.records import Partition, Run

__all__ = ["evict", "forget", "remove"]

Key = Hashable


def evict(part: Partition, keys: list[Key] | range, tasks: tuple[str, ...] | None) -> int:
    """Drop those of ``keys`` nothing needs any more (``tasks``: the declared consumers;
    ``None``: samples stay until deleted): still stored, consumed by every task, and not
    pinned by a plan, held by a loader or leased. Set operations: no Python per sample."""
    if not tasks:
        return 0
    done = part.samples.keys() & keys
    for keep in (part.pinned, part.held, part.leased):
        if keep:
            done -= keep.keys()
    consumed = part.consumed
    for t in tasks:
        done = done & consumed[t] if t in consumed else set()
    if len(done) == len(keys):
        return remove(part, keys)
    return remove(part, list(filter(done.__contains__, keys)))


def remove(part: Partition, keys: list[Key] | range) -> int:
    """Drop samples ``keys`` (all held, no repeats): a few C-level passes over them."""
    if not keys:
        return 0
    n = forget(part, keys)
    for index in (part.held, part.leased, part.pinned):
        if index:
            deque(map(index.pop, keys, repeat(None)), 0)
    for task, pending in part.pending.items():
        deque(map(pending.pop, keys, repeat(None)), 0)
        part.consumed[task].difference_update(keys)
    return n


def forget(part: Partition, keys: list[Key] | range) -> int:
    """Drop the records of samples ``keys`` (held, no repeats, in no index any more)."""
    if not keys:
        return 0
    part.forget_spans(keys)
    records = list(map(part.samples.pop, keys))
    if part.book is not None:
        part.book.forget(keys)
    first = records[0]
    one = records.count(first) == len(records)  # one run: no counting per record
    counts = part.field_counts
    for record, n in ({first: len(records)} if one else Counter(records)).items():
        for f in record.names if type(record) is Run else record.fields:
            counts[f] -= n
    return len(keys)
