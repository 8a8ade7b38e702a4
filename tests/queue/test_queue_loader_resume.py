"""StoreLoader resumed on another data-parallel size: every data rank of one store simulated in
one process (one StoreLoader per rank on one embedded store), the state of one rank loaded
by all the new ranks."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from meshfeed.queue import GroupSampler, SampleStore, StoreLoader
from meshfeed.queue.rounds import split_round
from tests.optional import given, settings, st

GLOBAL = 8  # samples per round (global batch)


def _store(n: int, group: int) -> SampleStore:
    store = SampleStore()
    ids = list(range(n))
    groups = [i // group for i in ids] if group > 1 else None
    store.put("p", {"x": ids}, ids=ids, groups=groups)
    store.close("p")
    return store


def _loaders(store: SampleStore, dp: int, group: int, prefetch: int) -> list[StoreLoader]:
    sampler = GroupSampler(group_size=group) if group > 1 else None
    return [
        StoreLoader(
            store,
            task="t",
            fields=["x"],
            partition="p",
            batch_size=GLOBAL // dp,
            mesh={"dp": dp},
            rank=r,
            sampler=sampler,
            prefetch=prefetch,
            timeout=20,
        )
        for r in range(dp)
    ]


def _step(loaders: list[StoreLoader]) -> list[list[Any]] | None:
    """One training step of every rank: their batches' ids, or None when all ended at once."""
    got = [next(loader, None) for loader in loaders]
    assert all(b is None for b in got) or all(b is not None for b in got), "ranks desynced"
    return None if got[0] is None else [b.ids for b in got]


def _run(loaders: list[StoreLoader], steps: float = math.inf) -> list[list[list[Any]]]:
    out: list[list[list[Any]]] = []
    while len(out) < steps:
        ids = _step(loaders)
        if ids is None:
            break
        out.append(ids)
    return out


def _resume(
    n: int, dp: int, new_dp: int, group: int, prefetch: int, stop: int
) -> tuple[list, list, SampleStore, dict]:
    """``stop`` steps on ``dp`` ranks, a checkpoint, the rest on ``new_dp`` ranks."""
    store = _store(n, group)
    old = _loaders(store, dp, group, prefetch)
    before = _run(old, stop)
    states = [loader.state_dict() for loader in old]
    assert all(json.loads(json.dumps(s)) == states[0] for s in states)  # one state, any rank
    saved = store.state_dict()
    _run(old, 1)  # progress after the checkpoint is lost with the crash
    for loader in old:
        loader.shutdown()
    store.load_state_dict(saved)
    new = _loaders(store, new_dp, group, prefetch)
    for loader in new:
        loader.load_state_dict(states[0])
    return before, _run(new), store, states[0]


@pytest.mark.parametrize(("dp", "new_dp"), [(2, 4), (4, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize(("prefetch", "stop"), [(1, 2), (2, 2), (3, 3), (2, 0)])
def test_a_resume_on_another_dp_serves_every_sample_once_and_keeps_groups_whole(
    dp, new_dp, group, prefetch, stop
):
    n = 5 * GLOBAL
    before, after, store, state = _resume(n, dp, new_dp, group, prefetch, stop)
    if 0 < stop < 5 and prefetch > 1:
        assert state["requested"] - state["next"] == prefetch - 1  # rounds fetched ahead
    assert len(json.dumps(state)) < 300  # names no sample: read back from the store's plans
    assert len(before) == stop and len(after) == 5 - stop  # the same rounds, every rank
    served = [k for step in before + after for ids in step for k in ids]
    assert sorted(served) == list(range(n))  # none twice, none lost
    for step in after:
        assert [len(ids) for ids in step] == [GLOBAL // new_dp] * new_dp
        for ids in step:  # groups stay whole on one rank
            assert all(
                ids[i] // group == ids[i + group - 1] // group for i in range(0, len(ids), group)
            )
    assert store.stats()["cache_entries"] == 0  # no plan of either layout left pinned


def test_on_the_same_dp_a_resume_gives_each_rank_exactly_its_uninterrupted_batches():
    reference = _run(_loaders(_store(44, 2), 2, 2, 3))
    before, after, _, _ = _resume(44, 2, 2, 2, 3, 2)
    assert before + after == reference
    assert [len(ids) for ids in reference[-1]] == [2, 2]  # the short last round, split evenly


def test_a_short_last_round_is_resplit_by_the_samplers_rule():
    # 44 samples = 5 rounds of 8 and one of 4 (pending at the checkpoint with prefetch=2).
    before, after, _, _ = _resume(44, 4, 2, 1, 2, 5)
    assert [len(ids) for ids in after[0]] == [2, 2]
    assert sorted(k for step in before + after for ids in step for k in ids) == list(range(44))
    assert split_round(list(range(7)), 3, 1) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_round(list(range(6)), 2, 3) == [[0, 1, 2], [3, 4, 5]]


def test_a_short_last_round_with_fewer_units_than_new_ranks_is_refused_naming_the_fix():
    store = _store(10, 1)  # round 0: 8 samples; round 1: 2 (one per data rank of 2)
    old = _loaders(store, 2, 1, 2)
    _run(old, 1)  # round 1 is fetched ahead: its plan is in the store
    state = old[0].state_dict()
    assert state["requested"] == 2 and state["next"] == 1
    new = _loaders(store, 4, 1, 2)
    with pytest.raises(ValueError, match=r"batch 1 of task 't' \(the stream's last, short "
                       r"round\) has 2 sample\(s\), 2 unit\(s\) of 1: it cannot be split among "
                       r"4 data ranks.*at most 2 data ranks"):  # fmt: skip
        new[0].load_state_dict(state)
    again = _loaders(store, 2, 1, 2)  # nothing moved (refused first): dp 2 still resumes
    for loader in again:
        loader.load_state_dict(state)
    assert _run(again) == [[[8], [9]]]


def test_a_different_global_batch_or_a_split_group_is_refused_naming_the_values():
    store = _store(16, 4)
    old = _loaders(store, 2, 4, 1)
    state = old[0].state_dict()
    bigger = StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=4,
                         mesh={"dp": 4}, rank=0, prefetch=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"global batch of 8 samples \(2 data ranks x "
                       r"batch_size=4\), but this loader's is 16 \(4 x batch_size=4\).*"
                       r"batch_size=2 on 4 data ranks"):  # fmt: skip
        bigger.load_state_dict(state)
    split = StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=2,
                        mesh={"dp": 4}, rank=0, prefetch=1, sampler=GroupSampler(group_size=4))  # fmt: skip
    with pytest.raises(ValueError, match="batch_size=2 on 4 data ranks would split groups of 4"):
        split.load_state_dict(state)
    other = StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=4,
                        mesh={"dp": 2}, rank=0, prefetch=1, sampler=GroupSampler(group_size=2))  # fmt: skip
    with pytest.raises(ValueError, match="groups of 4 samples, but .* groups of 2"):
        other.load_state_dict(state)


def test_a_state_of_the_previous_version_is_refused_by_version():
    loader = _loaders(SampleStore(), 1, 1, 1)[0]
    v3 = {"kind": "store_loader", "version": 3, "task": "t", "partition": "p",
          "data_rank": 0, "next": 1, "ended": False, "pending": []}  # fmt: skip
    with pytest.raises(ValueError, match="StoreLoader state has version=3, this meshfeed reads "
                       "version 5"):  # fmt: skip
        loader.load_state_dict(v3)


def _mesh_loaders(store: SampleStore, mesh: dict, prefetch: int) -> list[StoreLoader]:
    dp = mesh["dp"]
    size = dp * mesh.get("tp", 1)
    kwargs = {"task": "t", "fields": ["x"], "partition": "p", "batch_size": GLOBAL // dp}
    return [
        StoreLoader(store, **kwargs, mesh=mesh, rank=r, prefetch=prefetch, timeout=20)
        for r in range(size)
    ]


def test_replica_peers_may_change_with_the_data_parallel_size():
    store = _store(40, 1)
    old = _mesh_loaders(store, {"dp": 1, "tp": 2}, 2)  # two peers of one data rank
    before = _run(old, 2)
    assert all(step[0] == step[1] for step in before)  # peers: the same batch
    states = [loader.state_dict() for loader in old]
    assert states[0] == states[1] and states[0]["replica_size"] == 2
    new = _loaders(store, 2, 1, 2)
    for loader in new:
        loader.load_state_dict(states[0])
    after = _run(new)
    served = [k for step in before for k in step[0]] + [k for s in after for i in s for k in i]
    assert sorted(served) == list(range(40))
    assert store.stats()["cache_entries"] == 0


def test_a_loader_of_the_replaced_layout_is_refused_before_it_consumes_anything():
    """A loader left running when its job resumed on another layout (its request thread, or
    a caller) asks for a batch the resumed loaders now plan: refused by name, consuming
    nothing, so the resumed loaders still read every sample once. Before, its request
    planned a round of its own: samples no reader of the new layout ever saw."""
    store = _store(40, 1)
    old = _mesh_loaders(store, {"dp": 1, "tp": 2}, 1)  # synchronous: nothing asked ahead
    before = _run(old, 2)
    state = old[0].state_dict()
    new = _loaders(store, 2, 1, 2)
    for loader in new:
        loader.load_state_dict(state)
    consumed = store.stats()["consumed"]["t"]
    with pytest.raises(ValueError, match=r"moved the task's plans from batch 2 .* shut it down"):
        next(old[0])
    assert store.stats()["consumed"]["t"] == consumed
    after = _run(new)
    served = [k for step in before for k in step[0]] + [k for s in after for i in s for k in i]
    assert sorted(served) == list(range(40))
    for loader in old + new:
        loader.shutdown()


def test_another_number_of_replica_peers_resumes_exactly_when_the_store_drops_consumed_samples():
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": list(range(16))})
    store.close("p")
    old = _mesh_loaders(store, {"dp": 1, "tp": 2}, 2)
    before = _run(old, 1)
    state = old[0].state_dict()
    saved = store.state_dict()
    for loader in old:
        loader.shutdown()
    store.load_state_dict(saved)
    new = _loaders(store, 2, 1, 2)  # 2 readers of each plan -> 2 data ranks, 1 peer each
    for loader in new:
        loader.load_state_dict(state)
    after = _run(new)
    served = [k for k in before[0][0]] + [k for step in after for ids in step for k in ids]
    assert sorted(served) == list(range(16))
    assert store.stats()["cache_entries"] == 0 and store.stats()["partitions"]["p"]["samples"] == 0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    dp=st.sampled_from([1, 2, 4]),
    new_dp=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
    prefetch=st.integers(1, 3),
    stop=st.integers(0, 8),
)
def test_any_resume_serves_each_sample_at_most_once_in_lockstep_and_leaves_only_a_short_tail(
    n, dp, new_dp, group, prefetch, stop
):
    try:
        before, after, store, _ = _resume(n, dp, new_dp, group, prefetch, stop)
    except ValueError as refused:  # only a short last round too small for the new ranks
        assert "(the stream's last, short round)" in str(refused) and new_dp > dp
        return
    served = [k for step in before + after for ids in step for k in ids]
    assert len(served) == len(set(served))  # never twice (_step checked the lockstep)
    unserved = sorted(set(range(n)) - set(served))
    assert all(k > max(served, default=-1) for k in unserved)  # only the stream's tail
    assert len(unserved) < max(dp, new_dp) * group  # fewer units than data ranks
    assert store.stats()["cache_entries"] == 0


def test_a_short_last_round_the_old_ranks_could_not_share_is_served_on_fewer_ranks():
    # 33 samples on dp=2 x 4: round 4 holds one sample, too few for two ranks, so the old
    # ranks saw the end there; resumed on dp=1 the new rank asks again and serves it, then
    # finds the end itself (so no plan of the new layout stays pinned).
    before, after, store, _ = _resume(33, 2, 1, 1, 2, 4)
    served = [k for step in before + after for ids in step for k in ids]
    assert sorted(served) == list(range(33))
    assert store.stats()["cache_entries"] == 0


def test_a_state_loaded_over_a_store_of_another_moment_is_refused_naming_the_fix():
    store = _store(40, 1)
    old = _loaders(store, 2, 1, 2)
    _run(old, 2)
    state = old[0].state_dict()
    fresh = _loaders(_store(40, 1), 2, 1, 2)  # the store's checkpoint was not restored
    with pytest.raises(ValueError, match=r"at batch 2 of task 't', but this store has consumed "
                       r"0 sample\(s\) for it \(at least 4 were\).*Restore the store"):  # fmt: skip
        fresh[0].load_state_dict(state)


@pytest.mark.parametrize("prefetch", [1, 4])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_fresh_loader_of_a_task_that_read_already_is_refused_before_it_reads(prefetch, workers):
    # A loader built again without the earlier one's state starts at batch 0: it once read
    # the plans still cached for the earlier batches (their samples again, out of order).
    store = SampleStore()
    store.put("p", {"x": list(range(20))})
    store.close("p")

    def loader() -> StoreLoader:
        return StoreLoader(
            store, task="t", fields=["x"], partition="p", batch_size=2, mesh={"dp": 1},
            rank=0, timeout=30, prefetch=prefetch, num_workers=workers,
        )  # fmt: skip

    first = loader()
    it = iter(first)
    seen = [next(it).ids for _ in range(3)]
    state = first.state_dict()
    first.shutdown()
    with pytest.raises(ValueError, match=r"started at batch 0, .* which another loader read "
                       r"as already: .*load_state_dict"):  # fmt: skip
        with loader() as again:
            next(iter(again))
    resumed = loader()
    resumed.load_state_dict(state)
    with resumed:
        seen += [batch.ids for batch in resumed]
    assert sorted(i for ids in seen for i in ids) == list(range(20))  # each once
