"""A store loader's walk: the shared loop of every door, from the first batch not returned.

The loop is ``DataLoader``'s: tasks (batch indices) -> the loader's service (in-process, one
thread ahead, or worker processes: :mod:`meshfeed.services`) running the
:class:`~meshfeed.queue.loading.fetch.StoreFetcher` -> each batch settled (``on_error``, and
the ranks' agreement on it) -> :mod:`meshfeed.delivery` (pinned / on the device, timed) ->
returned, counted as returned only then. What is particular to a store:

- The stream's end is found, not known: a request answers "ended" (``ids is None``); no later
  index is requested, and the requests in flight are drained (one may still hold a batch
  planned before the end).
- A walk's requests share one token: when the walk ends early (an error, ``shutdown()``), the
  requests still waiting in the store are cancelled and wake at once, consuming nothing. The
  store keeps the plan of every batch requested, so the next walk asks again from the first
  batch not returned and gets the same batches.
- A batch the loop could not return (``collate_fn`` kept failing, or another rank's part of
  the round did) is kept first in line (``loader._held``): the next walk collates it again, or
  returns it, without fetching it again.

The functions take the loader as a weak proxy: the walk is held by the loader (a store loader
is its own iterator), and a strong reference back would make a cycle, so a dropped loader
would be shut down by the garbage collector at any moment (possibly inside the store's lock).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import uuid
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

from meshfeed.dist import is_distributed
from meshfeed.errors import CollectiveError, RankError
from meshfeed.queue.loading.errors import CollateError, round_failed
from meshfeed.queue.loading.fetch import StoreEvents, StoreTask

if TYPE_CHECKING:
    from meshfeed.queue.loading.loader import StoreLoader

__all__ = ["walk"]

Result = tuple[Any, StoreEvents]
#: What a batch dropped by ``on_error="skip"`` becomes on its way to the loop.
SKIPPED: Any = object()


def walk(loader: StoreLoader) -> Generator[Any, None, None]:
    """The loader's batches from the first not returned (module docstring)."""
    layout, store, start = loader._layout, loader.store, loader._returned
    token, halt = uuid.uuid4().hex, threading.Event()
    loader._walking = (token, halt)  # what shutdown() stops from any thread
    held, loader._held = loader._held, None
    first: list[Result] = []
    raw = None
    if held is not None and held[1].batch is not None:  # collate it again, in the service
        raw = held[1].batch
    elif held is not None:  # made already: returned first, agreed again by every rank
        first, start = [held], start + 1
    if loader._door is not None:
        loader._door.gate.open(token, start)
    made: Iterator[Any] = loader.service.map(_tasks(loader, start, token, raw, halt))
    results: Iterator[Result] = itertools.chain(first, made)
    delivered = loader.delivery.stage(_settled(loader, results))
    try:
        while True:
            loader._grant()  # on the loop's thread, before each batch: the same on every rank
            try:
                item, events = next(delivered)
            except StopIteration:
                return
            loader._returned = events.index + 1
            loader._forget(events.index)
            if item is SKIPPED:  # dropped by on_error="skip": passed, not returned
                continue
            loader._counts["batches"] += 1
            loader._counts["samples"] += len(events.ids or ())
            loader._counts["redelivered"] += events.index < loader._redeliver
            yield item
            loader._check_layout(layout)
    finally:
        # An early end: the requests still waiting wake now (the plans stay in the store).
        halt.set()
        with contextlib.suppress(Exception):  # the store may be gone (a killed Ray actor)
            store.cancel(token)
        delivered.close()


def _tasks(
    loader: StoreLoader, start: int, token: str, raw: Any, halt: threading.Event
) -> Iterator[StoreTask]:
    """Batch indices from ``start`` until the end is seen, each once the loop granted it
    (with the policy version it was granted with)."""
    index = start
    while loader._end_at is None or index < loader._end_at:
        if not loader._granted_to(index, halt):
            return
        loader._requested = max(loader._requested, index + 1)
        batch = raw if index == start else None
        yield StoreTask.make(index, loader._version_args(index), token, batch)
        index += 1


def _settled(loader: StoreLoader, results: Iterator[Result]) -> Iterator[Result]:
    """Each batch with ``on_error`` applied and, where a process group runs, agreed on."""
    agree = loader.on_error == "raise" and is_distributed()
    try:
        for item, events in results:
            if events.ids is None:  # ended: later requests end too; the in-flight ones drain
                if loader._end_at is None or events.index < loader._end_at:
                    loader._end_at = events.index
                continue
            if loader._end_at is not None and events.index > loader._end_at:
                loader._end_at = None  # a batch after an "ended": ask on past it next time
            if loader.on_error == "skip":
                if _skipped(loader, events):
                    item = SKIPPED  # passed in order, so the loop counts it where it was
            elif events.error is not None or agree:
                _agreed(loader, item, events, agree)
            yield item, events
    finally:
        if isinstance(results, Generator):
            results.close()


def _skipped(loader: StoreLoader, events: StoreEvents) -> bool:
    """``on_error="skip"``: whether the batch is dropped, agreed by every rank (a round one
    rank could not collate is dropped by all of them); counted and warned."""
    failed = events.error is not None
    rank = round_failed(failed, loader.wait_timeout)
    if rank is None:
        return False
    ids = events.ids or []
    first = loader._skips.record(events.index, ids, events.error if failed else None, rank)
    loader._note_bad_samples(len(ids), first)
    return True


def _agreed(loader: StoreLoader, item: Any, events: StoreEvents, agree: bool) -> None:
    """``on_error="raise"``: a batch whose ``collate_fn`` kept failing raises
    :class:`CollateError`; with a process group every rank agrees on every batch (one
    ``all_reduce`` of one int), and the others raise :class:`RankError` at the same batch.
    Either way the batch stays first in line, so none waits in its next collective."""
    if events.error is not None:
        loader._held = (None, events)
        if agree:
            with contextlib.suppress(CollectiveError):  # a dead peer must not hide ours
                round_failed(True, loader.wait_timeout)
        raise _collate_error(loader, events)
    failed = round_failed(False, loader.wait_timeout)
    if failed is not None:
        loader._held = (item, events)  # returned once the ranks go on
        raise RankError(
            f"rank {failed} could not collate its part of batch {events.index} of task "
            f"{loader.task!r} (this is rank {loader.rank}); see that rank's error. Every rank "
            "stops here so that none waits in its next collective",
            rank=failed,
            step=events.index,
        )


def _collate_error(loader: StoreLoader, events: StoreEvents) -> CollateError:
    ids = list(events.ids or [])
    shown = f"{ids[:20]} ... ({len(ids)} samples)" if len(ids) > 20 else f"{ids}"
    error = CollateError(
        f"collate_fn failed {loader.collate_retries + 1} times on batch {events.index} of "
        f"task {loader.task!r} (sample ids {shown}): {events.error!r}. The batch is kept: "
        "next() retries collate_fn on it and state_dict() records it, so a restored loader "
        "re-delivers it; fix collate_fn (or the samples) and call next() again",
        index=events.index,
        ids=ids,
    )
    error.__cause__ = events.error
    return error
