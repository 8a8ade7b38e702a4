"""Shared plans: one round planned once and read by several readers (replica peers, retries).

A rank-aware or length-balanced sampler's request names a key (task, stream, batch index).
:func:`lookup` is where such a request starts: it records how far the reader got, drops the
plans every reader has passed, and finds the plan already made for the key (peers must ask
alike: :func:`check_agreement`). Without one the core plans the round and :func:`record` caches
it, pinning its samples; :func:`read_shared` is another reader's (or a retry's) share of it. Each
function returns the samples the plans it dropped no longer pin, for the core to evict: the
request flows down, the answer comes back, and nothing here calls back into the core.

Cost per request: O(batch) plus O(log readers) to know whether every reader passed a plan
(:class:`~meshfeed.queue.rounds.Progress`); a round's ids are kept once (a
:class:`~meshfeed.queue.rounds.Round`), pinned and unpinned with C-level passes once per round.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from itertools import repeat
from typing import Any

from meshfeed.queue.engine.records import Entry, Partition, count_down, count_up
from meshfeed.queue.request import GetRequest
from meshfeed.queue.rounds import Progress, Round
from meshfeed.queue.samplers import Share

__all__ = [
    "check_agreement",
    "drop",
    "end_of_stream",
    "lookup",
    "passed",
    "pin",
    "read_shared",
    "record",
    "replan",
]

Key = Hashable
CacheKey = tuple[Any, ...]


def lookup(part: Partition, request: GetRequest, share: Share) -> tuple[Entry | None, list[Key]]:
    """The plan cached for the request's key (``None``: plan it), after acknowledging the
    reader's earlier batches; and the samples freed by the plans that this dropped."""
    _check_layout(part, request.task, share)
    if request.loader is not None:
        _check_start(part, request, share)
    freed = _acknowledge(part, request.task, share, request.prefetch)
    entry = part.cache.get((request.task, *share.key))
    if entry is not None:
        check_agreement(entry, request)
    return entry, freed


def read_shared(
    part: Partition, request: GetRequest, share: Share, entry: Entry
) -> tuple[bool, list[Key]]:
    """A replica peer, or a retry of the same batch index, reads ``entry`` (idempotent: the
    same batch again, never the next one): whether this reader read it before, and the
    samples freed if every reader has now read and passed it."""
    again = share.reader in entry.read
    entry.read.add(share.reader)
    freed: list[Key] = []
    if len(entry.read) >= entry.readers:  # readers that found the end meanwhile
        prefix = (request.task, *share.key[:-1])
        freed = drop(part, _finished(part, prefix, share.readers))
    return again, freed


def end_of_stream(part: Partition, task: str, share: Share, prefetch: int | None) -> list[Key]:
    """The reader found the end of the stream at the request's index: it acknowledges what any
    request for that index does, no more (its batches in flight are still to be returned, and
    a checkpoint taken meanwhile reads them again from their plans); the samples freed. A
    loader that returned everything then says so (:func:`passed`)."""
    return _acknowledge(part, task, share, prefetch)


def passed(part: Partition, task: str, share: Share) -> list[Key]:
    """The reader of ``share`` returned every batch below the share's index: it acknowledges
    them (without asking for that index); the samples freed."""
    return _acknowledge(part, task, share, 1)


def _check_layout(part: Partition, task: str, share: Share) -> None:
    """A reader of a layout that :func:`replan` replaced (a loader left running when its
    job resumed on another number of data ranks) asking for a moved batch, or a later one,
    is refused before it consumes anything: its plan would take samples no reader of the
    new layout ever reads."""
    layout = part.layouts.get(task)
    if layout is None or share.key[-1] < layout[0]:
        return
    start, kind, readers = layout
    if (share.key[0], share.readers) != (kind, readers):
        raise ValueError(
            f"batch {share.key[-1]} of task {task!r} was asked for by a reader of a layout of "
            f"{share.readers} readers, but the store moved the task's plans from batch {start} "
            f"on to a layout of {readers} readers (SampleStore.replan: a loader resumed or "
            "resized on another number of data ranks); this loader was replaced: shut it down "
            "(StoreLoader.shutdown) and read from the resumed one"
        )


def _check_start(part: Partition, request: GetRequest, share: Share) -> None:
    """A loader that starts the task at batch 0 (``from_start``) is refused, before it reads
    anything, when it would read as a reader another loader read as (a loader built again
    without the earlier one's state: it would get the plans still cached for the earlier
    batches, their samples again, out of order, mixed with new ones), or asks for a batch
    this reader already returned. A loader that loaded a state takes the reader over."""
    task, index = request.task, share.key[-1]
    prefix = (task, *share.key[:-1])
    key = (*prefix, share.reader)
    if not request.from_start:
        part.readers[key] = request.loader  # type: ignore[assignment]
        return
    first = part.readers.setdefault(key, request.loader)  # type: ignore[arg-type]
    done = part.asked.get(prefix, {}).get(share.reader)
    if first == request.loader and (done is None or index > done):
        return
    raise ValueError(
        f"batch {index} of task {task!r} was asked for by a StoreLoader that started at batch "
        f"0, as reader {share.reader} of {share.readers}, which another loader read as "
        "already: a StoreLoader built again without the earlier one's state would read the "
        "earlier batches again. Continue where the task is (build the loader, then "
        "load_state_dict(the earlier loader's state_dict()) before iterating), or read "
        "under a new task name"
    )


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
    part: Partition, request: GetRequest, share: Share, plan: Round, *, evicting: bool
) -> None:
    """Cache a new plan until every reader asked for a later index, so a retry gets this
    batch; its samples are pinned meanwhile (``evicting``: the store drops consumed samples;
    a store that never does has nothing to pin)."""
    entry = Entry(plan, request.fields, share.readers, request.batch_size, request.agree)
    entry.read.add(share.reader)
    part.cache[(request.task, *share.key)] = entry
    if evicting:
        pin(part, plan.ids)


def pin(part: Partition, keys: list[Key] | range) -> None:
    """One more plan names each of ``keys`` (a FIFO round's range: O(1), counted per sample
    when the pins are first read; else a C-level pass when none was pinned)."""
    if type(keys) is range:
        part.pin_range(keys)
    else:
        count_up(part.pinned, keys)


def drop(part: Partition, keys: list[CacheKey]) -> list[Key]:
    """Drop the plans ``keys``; the samples they pinned (still stored), to evict if done."""
    freed: list[Key] = []
    if not keys:  # nothing to read: the pins stay as they are kept (ranges)
        return freed
    pinned = part.pinned
    for key in keys:
        entry = part.cache.pop(key)
        if not pinned:  # a store that never evicts pins nothing
            continue
        ids = list(filter(part.samples.__contains__, entry.round.ids))
        if max(map(pinned.get, ids, repeat(0)), default=0) <= 1:  # named by this plan alone
            deque(map(pinned.pop, ids, repeat(None)), 0)
        else:
            count_down(pinned, ids)
        freed += ids
    return freed


def _acknowledge(part: Partition, task: str, share: Share, prefetch: int | None) -> list[Key]:
    """Record that a reader asked for batch ``index``; drop the plans every reader has now
    read and acknowledged; the samples they freed.

    A request for ``index`` acknowledges the reader's batches up to ``index - window``,
    where ``window`` is the loader's ``prefetch`` (1 when not given): with ``P`` batches in
    flight, out of order, a later index does not mean an earlier one arrived. So a retry of a
    batch not yet acknowledged, or a loader restored at it, gets the same batch, and the cache
    stays bounded."""
    prefix, index = (task, *share.key[:-1]), share.key[-1]
    upto = index - (prefetch or 1)
    asked = part.asked.setdefault(prefix, {})
    old = asked.get(share.reader)
    if old is not None and old >= upto:
        return []
    asked[share.reader] = upto
    progress = part.progress.get(prefix)
    if progress is not None and progress.readers == share.readers:
        progress.moved(asked, share.reader, old)
    return drop(part, _finished(part, prefix, share.readers))


def _finished(part: Partition, prefix: tuple[Any, ...], readers: int) -> list[CacheKey]:
    """The plans under ``prefix`` that every one of ``readers`` read and acknowledged.

    Only readers ``0 .. readers - 1`` count: after a resume on fewer data ranks the store's
    checkpoint still names the readers that are gone, whose positions never move again."""
    asked = part.asked.get(prefix, {})
    progress = part.progress.get(prefix)
    if progress is None or progress.readers != readers:
        progress = part.progress[prefix] = Progress(asked, readers)
    low = progress.low(asked)
    if low is None:
        return []
    return [
        key
        for key, entry in part.cache.items()
        if key[:-1] == prefix and key[-1] <= low and len(entry.read) >= entry.readers
    ]


def replan(
    part: Partition, task: str, start: int, sampler: Any, parts: int, unit: int
) -> list[Key]:
    """Move ``task``'s plans to a new data-parallel layout (a loader resumed, or resized, on
    another number of data ranks, continuing at batch ``start``); the samples freed.

    Plans below ``start`` were returned by every reader of the old layout: dropped. Each plan
    from ``start`` on keeps its samples, split into ``parts`` contiguous parts of whole
    ``unit``-sample units (:class:`~meshfeed.queue.rounds.Round`'s rule) under the key that
    ``sampler`` (the new layout's) gives its index, unread; the readers' positions start
    over. A plan already in the new layout is left as it is, so every rank may call this.
    A round with fewer units than ``parts`` (the stream's short last round) is refused by
    name before anything changes."""
    mine = [(key, e) for key, e in part.cache.items() if key[0] == task and type(key[-1]) is int]
    moves: list[tuple[CacheKey, CacheKey, Entry, Share]] = []
    for key, entry in mine:
        if key[-1] < start:
            continue
        share = sampler.share({"batch_index": key[-1], "stream": key[-2]})
        new = (task, *share.key)
        if new == key and entry.readers == share.readers and entry.round.parts == parts:
            continue
        units = -(-len(entry.round.ids) // unit)
        if units < parts or len(entry.round.ids) % unit:
            raise ValueError(
                f"batch {key[-1]} of task {task!r} (the stream's last, short round) has "
                f"{len(entry.round.ids)} sample(s), {units} unit(s) of {unit}: it cannot be "
                f"split among {parts} data ranks, each of which must get a part; resume on "
                f"at most {units} data ranks (e.g. the {entry.round.parts} it was planned for)"
            )
        moves.append((key, new, entry, share))
    freed = drop(part, [key for key, _ in mine if key[-1] < start])
    for key, _, _, _ in moves:
        del part.cache[key]
    for _, new, entry, share in moves:
        part.cache[new] = Entry(Round(entry.round.ids, parts, unit), entry.fields, share.readers)
    if moves:
        for prefix in [p for p in part.asked if p[0] == task]:
            del part.asked[prefix]
            part.progress.pop(prefix, None)
    probe = sampler.share({"batch_index": start})
    if probe is not None:
        part.layouts[task] = (start, probe.key[0], probe.readers)
    return freed
