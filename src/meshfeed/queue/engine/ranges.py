"""A task's pending and consumed samples as ranges of ids, while consumption is first-in first-out (#32).

A put of ``n`` samples with fresh consecutive int ids is one
:class:`~meshfeed.queue.engine.records.Run`; a FIFO round (a :class:`SequentialSampler`, or a
rank-aware sampler over one) over such samples takes the task's first pending ids, which are a
range. :class:`Ranges` keeps a task's pending ids as the ranges of the runs still pending (in
production order) and its consumed ids as ranges, so creating a task, planning a round,
consuming it and counting it cost O(runs), not O(samples in the store or in the round).

It is only an encoding: the partition turns it into the explicit per-sample ``dict`` / ``set``
(:meth:`Ranges.pending_keys`, :meth:`Ranges.consumed_keys`) the moment anything but the FIFO
path touches the task (a filter, stale samples, a lease returned, eviction, a checkpoint, a
sample changed or removed out of order), and the task stays explicit from then on; see
:class:`~meshfeed.queue.engine.records.Partition`. So every other path sees exactly what it
saw before, and ``tests/queue/test_queue_ranges.py`` compares the two encodings.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from itertools import chain

__all__ = ["Ranges", "trim_head"]

Key = Hashable


def trim_head(spans: deque[range], n: int) -> range | None:
    """Remove the first ``n`` ids of ``spans``; them as one range, or ``None`` (nothing
    removed) when there are fewer or they are not consecutive ints."""
    if n <= 0 or not spans:
        return range(0) if n == 0 else None
    head = spans[0]
    start = head.start
    if len(head) >= n:  # the common case: within the first run
        if len(head) == n:
            spans.popleft()
        else:
            spans[0] = head[n:]
        return range(start, start + n)
    need, at = n, start
    for span in spans:  # O(runs touched)
        if span.start != at:
            return None
        if len(span) >= need:
            break
        need -= len(span)
        at = span.stop
    else:
        return None
    need = n
    while need:
        span = spans[0]
        if len(span) <= need:
            spans.popleft()
            need -= len(span)
        else:
            spans[0] = span[need:]
            need = 0
    return range(start, start + n)


class Ranges:
    """One task's pending ids (ranges in production order, one or more per run) and consumed
    ids (ranges), with their counts. Only FIFO moves are made here: :meth:`head` and
    :meth:`take` at the front, :meth:`add` at the back."""

    __slots__ = ("consumed", "count", "done", "pending")

    def __init__(self, pending: list[range]) -> None:
        self.pending: deque[range] = deque(r for r in pending if r)
        self.count = sum(map(len, self.pending))
        self.consumed: list[range] = []
        self.done = 0  # ids in ``consumed``

    def __len__(self) -> int:
        return self.count

    def add(self, ids: range) -> None:
        """New pending ids (a new run, after every id already here; never merged with the
        run before: the fast path checks each run's fields once, by its first id)."""
        if ids:
            self.pending.append(ids)
            self.count += len(ids)

    def head(self, n: int) -> tuple[range, list[range]] | None:
        """The first ``n`` pending ids as one range, and the runs' spans they lie in (one
        id of each names its run); ``None`` when fewer are pending or they are not
        consecutive ints (then the caller goes key by key)."""
        if n > self.count or n <= 0:
            return None
        start, need, at = self.pending[0].start, n, self.pending[0].start
        spans: list[range] = []
        for span in self.pending:
            if span.start != at:
                return None
            spans.append(span)
            if len(span) >= need:
                return range(start, start + n), spans
            need -= len(span)
            at = span.stop
        return None  # not reached: count covers n

    def take(self, ids: range, *, keep: bool) -> bool:
        """Consume ``ids``, the first pending ids (``keep``: record them as consumed; else
        they are about to leave the store); ``False`` (nothing changed) if they are not."""
        pending = self.pending
        if not pending or pending[0].start != ids.start or len(ids) > self.count:
            return False
        if trim_head(pending, len(ids)) is None:
            return False
        self.count -= len(ids)
        if keep and ids:
            last = self.consumed[-1] if self.consumed else None
            if last is not None and last.stop == ids.start:
                self.consumed[-1] = range(last.start, ids.stop)
            else:
                self.consumed.append(ids)
            self.done += len(ids)
        return True

    def pending_keys(self) -> dict[Key, None]:
        """The pending ids one by one, in order: the explicit encoding."""
        return dict.fromkeys(chain.from_iterable(self.pending))

    def consumed_keys(self) -> set[Key]:
        """The consumed ids one by one: the explicit encoding."""
        return set(chain.from_iterable(self.consumed))
