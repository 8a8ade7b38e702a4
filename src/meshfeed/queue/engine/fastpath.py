"""The store's fast selection: a :class:`SequentialSampler`'s batch in O(runs), not O(samples).

The general path asks the sampler (``sampler.select(View(...))``), which checks every pending
sample's fields one by one. When the first ``batch_size`` pending samples all belong to a few
:class:`~meshfeed.queue.engine.records.Run` records (a put of chunks or scalar lists), checking each
run once gives the same answer. :func:`select_fast` returns that answer, or ``False`` when it
does not apply (another sampler, or a pending sample lacking a field: scan them one by one);
a rank-aware round over a sequential choice is the same choice, split by the round's rule;
``tests/queue/test_queue_fastpath.py`` compares the two on the same stores.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import islice
from typing import Literal

from meshfeed.queue.engine.ranges import Ranges
from meshfeed.queue.engine.records import Partition
from meshfeed.queue.request import GetRequest
from meshfeed.queue.rounds import Round
from meshfeed.queue.samplers import RankAwareSampler, SequentialSampler

__all__ = ["select_fast", "select_ranges", "select_runs"]

Key = Hashable


def select_fast(
    part: Partition, pending: dict[Key, None] | Ranges, request: GetRequest, need: tuple[str, ...]
) -> Sequence[list[Key]] | bool | None:
    """The batch the request's sampler would select from the ``pending`` samples (a task's,
    per sample or as ranges) with fields ``need`` (``request.need``), when a fast path knows it: ``False`` when none
    applies (ask the sampler), ``None``: wait. Serves a :class:`SequentialSampler`, and a
    :class:`RankAwareSampler` over one: its round is the first ``D * batch_size`` ready
    samples, split by the sampler's rule (a short last round of fewer than ``D`` samples is
    not handed out). The ids may be a ``range`` (:func:`select_ranges`)."""
    sampler = request.sampler
    if type(sampler) is SequentialSampler:
        return select_runs(part, pending, need, request.batch_size)
    if type(sampler) is not RankAwareSampler or type(sampler.inner) is not SequentialSampler:
        return False
    ranks = sampler.data_world_size
    chosen = select_runs(part, pending, need, request.batch_size * ranks)
    if not chosen or ranks == 1:
        return chosen
    ids = chosen[0]
    return Round(ids, ranks) if len(ids) >= ranks else None


def select_runs(
    part: Partition, pending: dict[Key, None] | Ranges, need: tuple[str, ...], batch_size: int
) -> list[list[Key]] | Literal[False] | None:
    """:class:`SequentialSampler`'s choice in O(runs) when the first pending samples are
    all ready (the common case); ``False``: some are not, scan them one by one."""
    if isinstance(pending, Ranges):
        return select_ranges(part, pending, need, batch_size)
    keys = list(islice(pending, batch_size))
    if not keys or (len(keys) < batch_size and not part.closed):
        return None  # fewer pending than a batch, so fewer ready: wait
    records = set(map(part.samples.__getitem__, keys))  # a few runs (or samples)
    return [keys] if all(record.has(need) for record in records) else False


def select_ranges(
    part: Partition, lazy: Ranges, need: tuple[str, ...], batch_size: int
) -> list[list[Key]] | Literal[False] | None:
    """:func:`select_runs` over a task kept as ranges, in O(runs): the first pending ids as
    one ``range`` (typed as the list it stands for); ``False`` also when they are not
    consecutive ints (the general path goes key by key)."""
    n = min(batch_size, lazy.count)
    if not n or (n < batch_size and not part.closed):
        return None
    head = lazy.head(n)
    if head is None:
        return False
    ids, spans = head
    samples = part.samples
    for span in spans:  # every id of a span belongs to the run of its first id
        if not samples[span.start].has(need):
            return False
    return [ids]  # type: ignore[list-item]
