"""Shared plans: one batch planned once and read by several readers (replica peers, retries).

A rank-aware or length-balanced sampler's request names a key (task, stream, batch index);
the first reader plans the batch and :func:`record` caches it, pinning its samples; the other
readers, and a retry of the same index, read the cached plan (peers must ask alike:
:func:`check_agreement`). A plan goes once every reader read it and asked for a later index
(:func:`acknowledge`, :func:`finished`); :func:`unpin` then frees its samples for eviction.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from meshfeed.queue.records import Entry, Partition
from meshfeed.queue.request import GetRequest
from meshfeed.queue.samplers import Share

__all__ = ["acknowledge", "check_agreement", "finished", "record", "unpin"]

Key = Hashable
CacheKey = tuple[Any, ...]


def check_agreement(entry: Entry, request: GetRequest) -> None:
    """Readers of one plan must ask for the same fields, batch size and prefetch."""
    fields, batch_size, agree = request.fields, request.batch_size, request.agree
    if entry.fields != fields:
        raise ValueError(
            f"replica members asked for different fields ({list(entry.fields)} vs "
            f"{list(fields)}) for the same batch; ask for the same fields"
        )
    if entry.batch_size is not None and (entry.batch_size, entry.agree) != (batch_size, agree):
        raise ValueError(
            f"readers of one shared batch asked with different settings "
            f"(batch_size={entry.batch_size}, {entry.agree} vs "
            f"batch_size={batch_size}, {agree}); replica peers must share "
            "batch_size, prefetch and sampler, or they end at different steps"
        )


def record(
    part: Partition, request: GetRequest, share: Share, parts: list[list[Key]], every: list[Key]
) -> None:
    """Cache a new plan until every reader asked for a later index, so a retry gets this
    batch; its samples are pinned meanwhile."""
    entry = Entry(parts, request.fields, share.readers, request.batch_size, request.agree)
    entry.read.add(share.reader)
    part.cache[(request.task, *share.key)] = entry
    for k in every:
        part.sample(k).pins += 1


def acknowledge(
    part: Partition, task: str, share: Share, prefetch: int | None, last: bool
) -> list[CacheKey]:
    """Record that a reader asked for batch ``index`` (``last``: it found the end); the plans
    every reader has now read and acknowledged, to drop.

    A request for ``index`` acknowledges the reader's batches up to ``index - window``,
    where ``window`` is the loader's ``prefetch`` (1 when not given): with ``P`` requests
    in flight, out of order, a later index does not mean an earlier one arrived. A reader
    that found the end acknowledges everything. So a retry of a batch not yet
    acknowledged gets the same batch, and the cache stays bounded."""
    prefix, index = (task, *share.key[:-1]), share.key[-1]
    window = prefetch or 1
    upto = (1 << 62) if last else index - window
    asked = part.asked.setdefault(prefix, {})
    if asked.get(share.reader, -1) >= upto:
        return []
    asked[share.reader] = upto
    return finished(part, prefix, share.readers)


def finished(part: Partition, prefix: tuple[Any, ...], readers: int) -> list[CacheKey]:
    """The plans under ``prefix`` that every one of ``readers`` read and acknowledged.

    Only readers ``0 .. readers - 1`` count: after a resume on fewer data ranks the store's
    checkpoint still names the readers that are gone, whose positions never move again."""
    asked = part.asked.get(prefix, {})
    current = [at for reader, at in asked.items() if reader < readers]
    if len(current) < readers:
        return []
    low = min(current)
    return [
        key
        for key, entry in part.cache.items()
        if key[:-1] == prefix and key[-1] <= low and len(entry.read) >= entry.readers
    ]


def unpin(part: Partition, key: CacheKey) -> list[Key]:
    """Drop the plan ``key``; the samples it pinned (still stored), to evict if done."""
    entry = part.cache.pop(key)
    every = [k for p in entry.parts for k in p if k in part.samples]
    for k in every:
        part.sample(k).pins -= 1
    return every
