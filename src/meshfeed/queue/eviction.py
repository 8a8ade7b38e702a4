"""Eviction: a partition drops a sample once nothing needs it any more.

A sample goes when every declared task consumed it and nothing keeps it: no shared plan pins
it, no loader holds it, no lease has it out. Each function returns how many samples it
dropped, so the core keeps its ``held`` / ``dropped`` counts.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from itertools import repeat

from meshfeed.queue.records import Partition, Run

__all__ = ["evict", "forget", "remove"]

Key = Hashable


def evict(part: Partition, keys: list[Key], tasks: tuple[str, ...] | None) -> int:
    """Drop those of ``keys`` nothing needs any more (``tasks``: the declared consumers;
    ``None``: samples stay until deleted)."""
    if not tasks:
        return 0
    if _all_done(part, keys, tasks):  # the common case, with set operations
        return remove(part, list(filter(part.samples.__contains__, keys)))
    return remove(part, [k for k in keys if _done(part, k, tasks)])


def _all_done(part: Partition, keys: list[Key], tasks: tuple[str, ...]) -> bool:
    """Whether every one of ``keys`` is done, checked for all at once: nothing is pinned,
    held or leased in the partition, and every task consumed them all."""
    consumed = part.consumed
    return (
        not part.cache  # so no sample is pinned
        and not part.held
        and not part.leased
        and all(t in consumed and consumed[t].issuperset(keys) for t in tasks)
    )


def _done(part: Partition, k: Key, tasks: tuple[str, ...]) -> bool:
    """Whether sample ``k`` is still stored, unpinned, neither held nor leased, and consumed
    by every task."""
    return (
        k in part.samples
        and part.samples[k].pins == 0
        and k not in part.held
        and k not in part.leased
        and all(k in part.consumed.get(t, ()) for t in tasks)
    )


def remove(part: Partition, keys: list[Key]) -> int:
    """Drop samples ``keys`` (all held, no repeats): a few C-level passes over them."""
    if not keys:
        return 0
    n = forget(part, keys)
    for index in (part.held, part.leased):
        if index:
            deque(map(index.pop, keys, repeat(None)), 0)
    for task, pending in part.pending.items():
        deque(map(pending.pop, keys, repeat(None)), 0)
        part.consumed[task].difference_update(keys)
    return n


def forget(part: Partition, keys: list[Key]) -> int:
    """Drop the records of samples ``keys`` (held, no repeats, in no index any more)."""
    if not keys:
        return 0
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
