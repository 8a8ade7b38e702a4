"""Samplers: rank-aware sharing with a bounded cache, whole GRPO groups, balanced splits."""

from __future__ import annotations

import threading

import pytest

from meshfeed.mesh import DataMesh
from meshfeed.queue import (
    GroupSampler,
    LengthBalancedSampler,
    PartitionClosed,
    RankAwareSampler,
    SampleStore,
)
from meshfeed.queue.samplers import karmarkar_karp
from tests.optional import given, settings, st


def test_rank_aware_replica_members_get_the_same_batch_and_data_ranks_disjoint_ones(make_store):
    store = make_store()
    mesh = DataMesh.from_sizes(dp=2, tp=2)  # ranks 0,1 -> data rank 0; 2,3 -> data rank 1
    store.put("p", {"x": list(range(16))})
    samplers = {r: RankAwareSampler.from_mesh(mesh, r) for r in range(4)}
    seen: dict[int, list] = {r: [] for r in range(4)}
    for step in range(2):
        for r in (0, 2, 3, 1):  # members arrive in any order
            b = store.get("actor", ["x"], 4, "p", sampler=samplers[r], timeout=1, batch_index=step)
            seen[r].append(b.ids)
    assert seen[0] == seen[1] and seen[2] == seen[3]
    flat0 = [k for ids in seen[0] for k in ids]
    flat2 = [k for ids in seen[2] for k in ids]
    assert not set(flat0) & set(flat2) and len(flat0) == len(flat2) == 8
    # Only the last round is kept (a retry of it must get the same batch) ...
    assert store.stats()["cache_entries"] == 1
    assert store.get("actor", ["x"], 4, "p", sampler=samplers[2], batch_index=1).ids == seen[2][1]
    store.close("p")
    for r in range(4):  # ... until every member asked for the next round
        with pytest.raises(PartitionClosed):
            store.get("actor", ["x"], 4, "p", sampler=samplers[r], timeout=1, batch_index=2)
    assert store.stats()["cache_entries"] == 0
    assert store.stats()["redelivered"] == 4  # the retried batch, counted


def test_rank_aware_cache_stays_bounded_while_members_lag(make_store):
    store = make_store()
    store.put("p", {"x": list(range(40))})
    lead = RankAwareSampler(data_rank=0, replica_rank=0, replica_size=2)
    lag = RankAwareSampler(data_rank=0, replica_rank=1, replica_size=2)
    for step in range(10):
        store.get("t", ["x"], 2, "p", sampler=lead, timeout=1, batch_index=step)
    assert store.stats()["cache_entries"] == 10  # one per step the lagging member has not read
    for step in range(10):
        store.get("t", ["x"], 2, "p", sampler=lag, timeout=1, batch_index=step)
    assert store.stats()["cache_entries"] == 1  # the last step, kept for a retry
    got = [store.get("t", ["x"], 2, "p", sampler=s, timeout=1, batch_index=10) for s in (lead, lag)]
    assert got[0].ids == got[1].ids
    assert store.stats()["cache_entries"] == 1  # step 9 dropped once both asked for step 10


def test_rank_aware_sampler_requires_a_batch_index():
    store = SampleStore()
    store.put("p", {"x": [1]})
    with pytest.raises(ValueError, match="batch_index"):
        store.get("t", ["x"], 1, "p", sampler=RankAwareSampler(data_rank=0), timeout=1)


def test_rank_aware_members_in_threads_agree_with_real_concurrency():
    store = SampleStore()
    mesh = DataMesh.from_sizes(dp=2, cp=2)
    out: dict[int, list] = {}

    def rank(r: int) -> None:
        s = RankAwareSampler.from_mesh(mesh, r)
        out[r] = [
            store.get("t", ["x"], 3, "p", sampler=s, timeout=20, batch_index=i).ids
            for i in range(4)
        ]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for i in range(0, 24, 3):
        store.put("p", {"x": [i, i + 1, i + 2]})
    for t in threads:
        t.join(30)
    assert out[0] == out[1] and out[2] == out[3]
    assert sorted(k for ids in out[0] + out[2] for k in ids) == list(range(24))


def _grpo_put(store: SampleStore, group_ids: list[int], size: int, order: list[int]) -> None:
    for g in order:
        gid = group_ids[g]
        store.put("p", {"x": [gid] * size}, ids=[f"{gid}/{j}" for j in range(size)], groups=gid)


def test_group_sampler_hands_out_only_whole_groups(make_store):
    store = make_store()
    store.put("p", {"x": [0, 0, 1]}, ids=["a0", "a1", "b0"], groups=["a", "a", "b"])
    sampler = GroupSampler(group_size=2)
    assert store.get("t", ["x"], 2, "p", sampler=sampler, timeout=1).ids == ["a0", "a1"]
    with pytest.raises(TimeoutError):
        store.get("t", ["x"], 2, "p", sampler=sampler, timeout=0.05)  # b is incomplete
    store.put("p", {"x": [1]}, ids=["b1"], groups=["b"])
    assert store.get("t", ["x"], 2, "p", sampler=sampler, timeout=1).ids == ["b0", "b1"]


@settings(max_examples=30, deadline=None)
@given(
    groups=st.integers(1, 8),
    size=st.integers(1, 4),
    per_batch=st.integers(1, 3),
    data=st.data(),
)
def test_grpo_groups_are_never_split_across_batches_or_ranks(groups, size, per_batch, data):
    store = SampleStore()
    order = data.draw(st.permutations(list(range(groups))))
    _grpo_put(store, list(range(groups)), size, order)
    store.close("p")
    mesh = DataMesh.from_sizes(dp=2)
    batches = []
    for step in range(groups + 1):
        for r in range(2):
            s = RankAwareSampler.from_mesh(mesh, r, inner=GroupSampler(group_size=size))
            try:
                b = store.get("t", ["x"], size * per_batch, "p", sampler=s, batch_index=step)
            except PartitionClosed:
                continue
            batches.append(b)
    owners: dict[int, int] = {}
    for i, b in enumerate(batches):
        assert len(b) % size == 0
        for gid in b["x"]:
            assert owners.setdefault(gid, i) == i  # a group lives in one batch only
    # A last round with fewer whole groups than data ranks is not handed out (no empty batch).
    left = groups % (2 * per_batch)
    assert len(owners) == groups - (left if left == 1 else 0)


def test_group_sampler_rejects_a_batch_size_that_splits_groups():
    store = SampleStore()
    store.put("p", {"x": [1, 2]}, groups=[0, 0])
    with pytest.raises(ValueError, match="not a multiple of group_size=2"):
        store.get("t", ["x"], 3, "p", sampler=GroupSampler(group_size=2), timeout=1)


def test_group_sampler_requires_group_ids():
    store = SampleStore()
    store.put("p", {"x": [1, 2]})
    with pytest.raises(ValueError, match="has no group id"):
        store.get("t", ["x"], 2, "p", sampler=GroupSampler(group_size=2), timeout=1)


def test_length_balanced_splits_a_global_batch_with_balanced_tokens_and_whole_groups(make_store):
    store = make_store()
    lengths = [100, 100, 5, 5, 60, 60, 40, 40, 30, 30, 70, 70]  # 6 groups of 2
    store.put(
        "p",
        {"x": list(range(12)), "n": lengths},
        ids=list(range(12)),
        groups=[i // 2 for i in range(12)],
    )
    parts = []
    for r in range(2):
        s = LengthBalancedSampler(length_field="n", data_rank=r, data_world_size=2, group_size=2)
        parts.append(store.get("t", ["x", "n"], 6, "p", sampler=s, timeout=1, batch_index=0))
    assert sorted(parts[0].ids + parts[1].ids) == list(range(12))
    assert len(parts[0]) == len(parts[1]) == 6
    for b in parts:
        assert all(b.ids[i] // 2 == b.ids[i + 1] // 2 for i in range(0, 6, 2))  # whole groups
    totals = [sum(b["n"]) for b in parts]
    assert abs(totals[0] - totals[1]) <= 30, totals  # 290 vs 320 is optimal here
    assert store.stats()["cache_entries"] == 1  # kept until both ranks ask for the next batch
    store.close("p")
    for r in range(2):
        s = LengthBalancedSampler(length_field="n", data_rank=r, data_world_size=2, group_size=2)
        with pytest.raises(PartitionClosed):
            store.get("t", ["x", "n"], 6, "p", sampler=s, timeout=1, batch_index=1)
    assert store.stats()["cache_entries"] == 0


def test_length_balanced_last_round_gives_no_data_rank_an_empty_batch_even_with_empty_samples():
    store = SampleStore()
    store.put("p", {"n": [0, 0, 5, 0]})  # zero-token samples (empty responses) happen in RL
    store.close("p")
    parts = []
    for r in range(3):
        s = LengthBalancedSampler(length_field="n", data_rank=r, data_world_size=3)
        parts.append(store.get("t", ["n"], 2, "p", sampler=s, timeout=1, batch_index=0).ids)
    assert sorted(k for ids in parts for k in ids) == [0, 1, 2, 3]
    assert all(parts), parts  # 4 samples over 3 data ranks: nobody gets an empty batch


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=20), st.integers(1, 5))
def test_karmarkar_karp_leaves_no_part_empty_when_there_are_enough_items(weights, k):
    parts = karmarkar_karp(weights, k)
    assert sum(1 for p in parts if p) == min(k, len(weights)), (weights, parts)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.integers(1, 5))
def test_karmarkar_karp_is_a_partition_and_no_worse_than_round_robin(weights, k):
    parts = karmarkar_karp(weights, k)
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    sums = [sum(weights[i] for i in p) for p in parts]
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    rr = [sum(weights[i] for i in order[j::k]) for j in range(k)]
    assert max(sums) - min(sums) <= max(rr) - min(rr)
    if len(weights) % k == 0:
        eq = karmarkar_karp(weights, k, equal_size=True)
        assert {len(p) for p in eq} == {len(weights) // k}


def test_samplers_reject_bad_configuration():
    with pytest.raises(ValueError, match="group_size must be an integer >= 1"):
        GroupSampler(group_size=0)
    with pytest.raises(ValueError, match="replica_rank=2 must be < replica_size=2"):
        RankAwareSampler(data_rank=0, replica_rank=2, replica_size=2)
    with pytest.raises(ValueError, match="data_rank=3 must be < data_world_size=2"):
        LengthBalancedSampler(length_field="n", data_rank=3, data_world_size=2)


def test_consecutive_ids_groups_follow_transferqueues_window_rule(make_store):
    store = make_store()
    ready = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11]  # 8 is missing: [6, 7] never forms a group
    store.put("p", {"x": ready}, ids=ready)
    sampler = GroupSampler(group_size=3, consecutive_ids=True)
    assert store.get("t", ["x"], 6, "p", sampler=sampler, timeout=1).ids == [0, 1, 2, 3, 4, 5]
    assert store.get("t", ["x"], 3, "p", sampler=sampler, timeout=1).ids == [9, 10, 11]
    with pytest.raises(TimeoutError):
        store.get("t", ["x"], 3, "p", sampler=sampler, timeout=0.05)
    store.put("p", {"x": [8]}, ids=[8])
    assert store.get("t", ["x"], 3, "p", sampler=sampler, timeout=1).ids == [6, 7, 8]


def test_consecutive_ids_groups_need_int_ids_and_a_bool_flag():
    with pytest.raises(TypeError, match="consecutive_ids must be True or False"):
        GroupSampler(group_size=2, consecutive_ids="yes")
    store = SampleStore()
    store.put("p", {"x": [1, 2]}, ids=["a", "b"])
    with pytest.raises(ValueError, match="groups int ids"):
        store.get("t", ["x"], 2, "p", sampler=GroupSampler(group_size=2, consecutive_ids=True))


def test_asking_again_for_the_same_batch_index_returns_the_same_batch(make_store):
    store = make_store()
    store.put("p", {"x": list(range(8))})
    sampler = RankAwareSampler(data_rank=0)
    first = store.get("t", ["x"], 2, "p", sampler=sampler, timeout=1, batch_index=0)
    retry = store.get("t", ["x"], 2, "p", sampler=sampler, timeout=1, batch_index=0)
    assert retry.ids == first.ids == [0, 1]  # a retried request is safe
    assert store.get("t", ["x"], 2, "p", sampler=sampler, timeout=1, batch_index=1).ids == [2, 3]
    stats = store.stats()
    assert stats["consumed"] == {"t": 4} and stats["redelivered"] == 2
    # Two data ranks, one round: each rank's retry returns its own part again.
    ranks = [RankAwareSampler(data_rank=r, data_world_size=2) for r in range(2)]
    parts = [store.get("u", ["x"], 2, "p", sampler=s, timeout=1, batch_index=0) for s in ranks]
    again = [store.get("u", ["x"], 2, "p", sampler=s, timeout=1, batch_index=0) for s in ranks]
    assert [b.ids for b in parts] == [b.ids for b in again] == [[0, 1], [2, 3]]
