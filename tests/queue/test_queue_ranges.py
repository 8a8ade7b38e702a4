"""A task kept as ranges (#32) behaves exactly like the same task kept per sample.

``Ranges`` and ``trim_head`` on their own; the partition turning a task explicit on first use
by anything but the FIFO path; and random sequences of store calls (puts of runs and of single
samples, explicit ids, fields added later, FIFO and rank-aware gets, holds, deletes, resets,
leases, checkpoints) on a store that keeps tasks as ranges against one that never does: the
same batches, counts and checkpoints at every step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from meshfeed.queue.checkpoints.state import dump
from meshfeed.queue.engine.core import PartitionClosed, StoreCore, StoreOptions
from meshfeed.queue.engine.plans import pin
from meshfeed.queue.engine.ranges import Ranges, trim_head
from meshfeed.queue.engine.records import Partition
from meshfeed.queue.request import GetRequest, PutRequest
from meshfeed.queue.samplers import RankAwareSampler
from tests.optional import given, settings, st


def test_ranges_take_from_the_front_and_add_at_the_back():
    r = Ranges([range(0, 4), range(4, 6)])
    assert len(r) == 6
    head = r.head(5)
    assert head == (range(0, 5), [range(0, 4), range(4, 6)])
    assert r.head(7) is None  # fewer pending
    assert r.take(range(0, 3), keep=True)
    assert not r.take(range(4, 5), keep=True)  # not the first pending ids: nothing changes
    assert r.take(range(3, 5), keep=True)
    r.add(range(9, 11))
    assert len(r) == 3 and r.done == 5
    assert r.head(3) is None  # 5 then 9: not consecutive
    assert r.pending_keys() == dict.fromkeys([5, 9, 10])
    assert list(r.pending_keys()) == [5, 9, 10]
    assert r.consumed_keys() == {0, 1, 2, 3, 4}
    assert r.consumed == [range(0, 5)]  # adjacent takes merge
    assert r.take(range(5, 6), keep=False)
    assert r.done == 5 and r.consumed_keys() == {0, 1, 2, 3, 4}


def test_trim_head_removes_consecutive_ids_or_nothing():
    spans = deque([range(0, 3), range(3, 5), range(7, 9)])
    assert trim_head(spans, 4) == range(0, 4)
    assert list(spans) == [range(4, 5), range(7, 9)]
    assert trim_head(spans, 2) is None  # 4 then 7
    assert list(spans) == [range(4, 5), range(7, 9)]
    assert trim_head(spans, 9) is None  # more than held
    assert trim_head(spans, 0) == range(0)


def test_a_task_is_kept_as_ranges_until_a_caller_needs_it_per_sample():
    core = StoreCore(StoreOptions())
    core.try_put(PutRequest(partition="p", rows={"x": list(range(6))}))
    core.try_put(PutRequest(partition="p", rows={"x": list(range(4))}))
    part = core.partitions["p"]
    got = core.try_get(GetRequest(task="t", fields=("x",), batch_size=8, partition="p"))
    assert got is not None and got[0] == list(range(8))
    assert part.ranges("t") is not None  # consumed first-in first-out: still ranges
    assert part.stats()["consumed"] == {"t": 8}
    assert part.pending_count("t") == 2
    assert part.ranges("t") is not None  # counting made nothing explicit
    assert part.pending == {"t": {8: None, 9: None}}
    assert part.consumed == {"t": set(range(8))}
    assert part.ranges("t") is None  # explicit for good from the first per-sample read


def test_a_sole_reader_drops_what_it_consumed_and_stays_ranges():
    """The common RL loop (one declared task, a put then a get of the same size): consumed
    samples go at once, the partition's spans lose them from the front, nothing goes per
    sample."""
    core = StoreCore(StoreOptions(tasks=("t",)))
    request = GetRequest(task="t", fields=("x",), batch_size=4, partition="p")
    for step in range(5):
        core.try_put(PutRequest(partition="p", rows={"x": list(range(4))}))
        got = core.try_get(request)
        assert got is not None and got[0] == list(range(4 * step, 4 * step + 4))
    part = core.partitions["p"]
    assert part.ranges("t") is not None and not part.samples and not part.spans
    assert core.held == 0 and core.stats()["consumed"] == {"t": 20}


def test_a_sample_changed_on_its_own_ends_the_ranges_of_every_task():
    core = StoreCore(StoreOptions())
    core.try_put(PutRequest(partition="p", rows={"x": list(range(4))}))
    part = core.partitions["p"]
    assert part.ranges("t") is not None and part.ranges("u") is not None
    core.try_put(PutRequest(partition="p", rows={"y": [1]}, ids=[2]))  # a field added later
    assert part.spans is None and part.ranges("t") is None and part.ranges("u") is None
    assert part.pending == {"t": dict.fromkeys(range(4)), "u": dict.fromkeys(range(4))}
    assert part.ranges("v") is None  # a task made now is per sample


def test_a_range_pinned_is_counted_per_sample_when_the_pins_are_read():
    """``pin`` of a FIFO round's range costs O(1); the counts read back are those of the
    same ids pinned as lists, overlapping pins included."""
    lists, ranges = Partition(), Partition()
    for ids in (range(0, 6), range(4, 9), range(4, 9)):
        pin(lists, list(ids))
        pin(ranges, ids)
    pin(lists, [20, 21])
    pin(ranges, [20, 21])
    assert ranges.pinned == lists.pinned
    assert ranges.pinned[5] == 3 and ranges.pinned[0] == 1 and ranges.pinned[20] == 1


def test_a_round_of_a_store_with_tasks_pins_its_range_and_evicts_it_when_passed():
    core = StoreCore(StoreOptions(tasks=("t",)))
    core.try_put(PutRequest(partition="p", rows={"x": list(range(8))}))
    part = core.partitions["p"]
    for index in range(2):
        for rank in range(2):
            sampler = RankAwareSampler(data_rank=rank, data_world_size=2)
            request = GetRequest(
                task="t",
                fields=("x",),
                batch_size=2,
                partition="p",
                sampler=sampler,
                batch_index=index,
            )
            got = core.try_get(request)
            assert got is not None and got[0] == [4 * index + 2 * rank, 4 * index + 2 * rank + 1]
    # Asking for round 1 acknowledged round 0 (prefetch 1): its plan and samples went.
    assert part.pinned == dict.fromkeys(range(4, 8), 1)
    assert core.held == 4 and list(part.samples) == [4, 5, 6, 7]


def test_a_restored_partition_keeps_its_tasks_per_sample():
    assert Partition().spans is None  # only a store's own new partition starts as runs


def _explicit(core: StoreCore) -> StoreCore:
    """``core`` with every partition per sample from its creation."""
    make = core._partition

    def per_sample(name: str) -> Partition:
        new = name not in core.partitions
        part = make(name)
        if new:
            part.not_runs()
        return part

    core._partition = per_sample  # type: ignore[method-assign]
    return core


def _rows(got: Any) -> Any:
    if got is None:
        return None
    ids, rows, parts, versions = got
    return ids, {f: list(getattr(c, "data", c)) for f, c in rows.items()}, parts, versions


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("run"), st.integers(2, 9)),
        st.tuples(st.just("one"), st.just(1)),
        st.tuples(st.just("ids"), st.integers(0, 3)),
        st.tuples(st.just("field"), st.integers(0, 40)),
        st.tuples(st.just("get"), st.integers(1, 7)),
        st.tuples(st.just("get_u"), st.integers(1, 7)),
        st.tuples(st.just("round"), st.integers(1, 3)),
        st.tuples(st.just("hold"), st.integers(1, 4)),
        st.tuples(st.just("release"), st.just(0)),
        st.tuples(st.just("delete"), st.integers(0, 40)),
        st.tuples(st.just("reset"), st.just(0)),
        st.tuples(st.just("dump"), st.just(0)),
        st.tuples(st.just("close"), st.just(0)),
    ),
    max_size=30,
)


class _Play:
    """One store under a sequence of calls; each call's answer, for comparison."""

    def __init__(self, core: StoreCore) -> None:
        self.core, self.index, self.n = core, 0, 0
        self.held: list[list[Any]] = []
        self.keys: list[Any] = []

    def put(self, rows: dict[str, list[Any]], ids: list[int] | None = None) -> Any:
        try:
            return self.core.try_put(PutRequest(partition="p", rows=rows, ids=ids))
        except ValueError as e:  # a closed partition: both stores refuse alike
            return str(e)

    def get(self, task: str, batch_size: int, **kw: Any) -> Any:
        request = GetRequest(task=task, fields=("x",), batch_size=batch_size, partition="p", **kw)
        try:
            got = self.core.try_get(request)
        except PartitionClosed as e:
            return str(e)
        if got is not None and kw.get("hold"):
            self.held.append(got[0])
        return _rows(got)

    def step(self, op: str, arg: int) -> Any:
        """Call ``op``; its answer, or the store's counts after it."""
        self.n += 1
        part = self.core.partitions.get("p")
        self.keys = [] if part is None else list(part.samples)
        got = getattr(self, f"_{op}")(arg)
        if got is not None:
            return got
        stats = self.core.stats()
        return stats["held"], stats["consumed"], stats["produced"], stats["partitions"]

    def _run(self, n: int) -> Any:
        return self.put({"x": list(range(self.n, self.n + n))})

    def _one(self, _: int) -> Any:
        return self.put({"x": [self.n]})

    def _ids(self, gap: int) -> Any:  # consecutive ids of the caller's, above or with gaps
        start = 1000 + 10 * self.n + gap
        return self.put({"x": [0, 1, 2]}, ids=list(range(start, start + 3)))

    def _field(self, at: int) -> Any:
        return self.put({"y": [1]}, ids=[self.keys[at % len(self.keys)]]) if self.keys else None

    def _get(self, n: int) -> Any:
        return self.get("t", n)

    def _get_u(self, n: int) -> Any:
        return self.get("u", n)

    def _round(self, ranks: int) -> Any:  # every reader of a rank-aware round, in turn
        out = []
        for rank in range(ranks):
            sampler = RankAwareSampler(data_rank=rank, data_world_size=ranks)
            out.append(self.get("t", 2, sampler=sampler, batch_index=self.index, parts=True))
        self.index += 1
        return out

    def _hold(self, n: int) -> Any:
        return self.get("t", n, hold=True)

    def _release(self, _: int) -> None:
        if self.held:
            self.core.release("p", self.held.pop(0))

    def _delete(self, at: int) -> None:
        if self.keys:
            self.core.delete("p", [self.keys[at % len(self.keys)]])

    def _reset(self, _: int) -> None:
        if self.keys:
            self.core.reset_consumption("p", "t")

    def _dump(self, _: int) -> Any:
        return dump(self.core, with_payload=False)[0]

    def _close(self, _: int) -> None:
        self.core.close("p")


@pytest.mark.parametrize("tasks", [None, ("t",), ("t", "u")])
@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_a_store_with_ranges_answers_as_one_without(tasks, ops):
    fast = _Play(StoreCore(StoreOptions(tasks=tasks)))
    slow = _Play(_explicit(StoreCore(StoreOptions(tasks=tasks))))
    for op, arg in [*ops, ("dump", 0)]:
        assert fast.step(op, arg) == slow.step(op, arg), (op, arg)


def test_the_comparison_covers_rounds_served_as_ranges():
    """The property above is not vacuous: a round of a store kept as ranges is served as
    ranges (the task stays ranges) and equals the per-sample store's."""
    fast = _Play(StoreCore(StoreOptions()))
    slow = _Play(_explicit(StoreCore(StoreOptions())))
    for op, arg in [("run", 9), ("run", 5), ("round", 3), ("get", 4), ("round", 2)]:
        assert fast.step(op, arg) == slow.step(op, arg)
    assert fast.core.partitions["p"].ranges("t") is not None
    assert slow.core.partitions["p"].ranges("t") is None
