"""Shared plans at scale: a round is read by every data rank without per-rank copies, every
sample once, and dropped (its samples freed) once every reader passed it."""

from __future__ import annotations

from typing import Any

import pytest

from meshfeed.queue.engine.core import StoreCore, StoreOptions
from meshfeed.queue.request import GetRequest, PutRequest
from meshfeed.queue.rounds import Round
from meshfeed.queue.samplers import RankAwareSampler


def _get(core: StoreCore, rank: int, ranks: int, index: int, **kw: Any) -> Any:
    sampler = RankAwareSampler(data_rank=rank, data_world_size=ranks)
    request = GetRequest(
        task="t", fields=("x",), batch_size=2, partition="p", sampler=sampler, **kw
    )
    return core.try_get(request, now=0.0)


def _store(n: int) -> StoreCore:
    core = StoreCore(StoreOptions(tasks=("t",)))
    core.try_put(PutRequest(partition="p", rows={"x": list(range(n))}))
    return core


def test_every_data_rank_reads_its_part_without_lists_per_rank(monkeypatch):
    ranks = 512
    core = _store(2 * ranks * 2)
    _get(core, 0, ranks, 0, batch_index=0)  # the planner
    monkeypatch.setattr(Round, "lists", lambda self: pytest.fail("parts made for a reader"))
    seen: list[Any] = []
    for rank in range(ranks):
        ids, _, parts, _ = _get(core, rank, ranks, 0, batch_index=0)
        assert parts is None and ids == [2 * rank, 2 * rank + 1]
        seen += ids
    assert sorted(seen) == list(range(2 * ranks))  # round 0: every sample exactly once
    part = core.partitions["p"]
    assert len(part.pinned) == 2 * ranks and len(part.cache) == 1  # a retry may come


def test_readers_asking_for_the_parts_share_one_list():
    core = _store(16)
    first = _get(core, 0, 4, 0, batch_index=0, parts=True)[2]
    assert first == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for rank in (1, 2, 3, 0):  # rank 0 again: a retry gets the same batch
        ids, _, parts, _ = _get(core, rank, 4, 0, batch_index=0, parts=True)
        assert parts is first and ids == first[rank]


def test_a_round_goes_once_every_reader_passed_it_and_frees_its_samples():
    ranks = 64
    core = _store(2 * ranks * 3)
    part = core.partitions["p"]
    for index in range(3):
        for rank in range(ranks):
            _get(core, rank, ranks, index, batch_index=index)
        # round index - 1 is acknowledged by every reader's request for index (prefetch 1)
        assert sorted(k[-1] for k in part.cache) == [index]
        assert core.held == 2 * ranks * (3 - index)
    for rank in range(ranks):  # every reader finds the end: everything acknowledged
        assert _get(core, rank, ranks, 3, batch_index=3) is None
    core.close("p")
    with pytest.raises(Exception, match="closed and drained"):
        _get(core, 0, ranks, 3, batch_index=3)
    assert len(part.progress[("t", "round", 0)].heap) <= 4 * ranks + 64


def test_a_resume_on_fewer_readers_drops_plans_the_gone_readers_never_pass():
    """Positions of readers 4..7 (from a state of 8 data ranks) do not hold plans back."""
    core = _store(64)
    part = core.partitions["p"]
    part.asked[("t", "round", 0)] = {r: 0 for r in range(8)}
    for index in range(3):
        for rank in range(4):
            _get(core, rank, 4, index, batch_index=index)
    assert sorted(k[-1] for k in part.cache) == [2]


def test_a_store_that_never_evicts_pins_nothing_and_still_drops_its_plans():
    core = StoreCore(StoreOptions())  # no tasks: consumed samples stay until deleted
    core.try_put(PutRequest(partition="p", rows={"x": list(range(16))}))
    part = core.partitions["p"]
    for index in range(2):
        for rank in range(4):
            ids, _, _, _ = _get(core, rank, 4, index, batch_index=index)
            assert ids == [8 * index + 2 * rank, 8 * index + 2 * rank + 1]
    assert not part.pinned and sorted(k[-1] for k in part.cache) == [1]
    assert core.held == 16  # nothing evicted, nothing lost


def test_the_end_keeps_the_plans_in_flight_until_the_reader_says_it_passed_them():
    from meshfeed.queue import SampleStore

    store = SampleStore(tasks=["t"])  # evicting: a dropped plan's samples go
    store.put("p", {"x": list(range(6))})
    store.close("p")
    sampler = RankAwareSampler(data_rank=0, data_world_size=1)

    def get(index: int) -> Any:
        return store.get("t", ["x"], 2, "p", sampler, 1, batch_index=index, prefetch=2)

    assert [get(i).ids for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(Exception, match="closed and drained"):
        get(3)  # the end: acknowledges batches up to 3 - 2 = 1 only
    assert store.stats()["cache_entries"] == 1  # batch 2 may still be asked again
    assert get(2).ids == [4, 5]  # e.g. by a loader restored there
    store.passed("p", "t", sampler, 4)  # returned everything below batch 4
    stats = store.stats()
    assert stats["cache_entries"] == 0 and stats["partitions"]["p"]["samples"] == 0


def test_replan_and_passed_refuse_nonsense_by_name():
    from meshfeed.queue import SampleStore

    store = SampleStore()
    sampler = RankAwareSampler(data_rank=0, data_world_size=1)
    with pytest.raises(ValueError, match=r"start must be a batch index.*start=-1"):
        store.replan("p", "t", -1, sampler, 1)
    with pytest.raises(ValueError, match=r"parts must be an int >= 1 \(got parts=0\)"):
        store.replan("p", "t", 0, sampler, 0)
    with pytest.raises(ValueError, match=r"unit must be an int >= 1 \(got unit=True\)"):
        store.replan("p", "t", 0, sampler, 1, True)
    with pytest.raises(ValueError, match=r"upto must be a batch index.*upto='x'"):
        store.passed("p", "t", sampler, "x")  # type: ignore[arg-type]
