"""Dynamic sampling (#30): a group filter in the store drops the groups that carry no signal,
counts them, and keeps every batch full and every rank in lockstep (also on 2 gloo ranks)."""

from __future__ import annotations

import threading
import uuid

import pytest

from meshfeed.mesh import DataMesh
from meshfeed.queue import GroupSampler, PartitionClosed, RankAwareSampler, SampleStore, StoreLoader
from tests.dist_utils import run_distributed

SIZE = 4  # answers per prompt


def _informative(group: dict) -> bool:
    """DAPO's dynamic sampling: drop a group whose rewards are all equal."""
    return len(set(group["reward"])) > 1


def _rollouts(store: SampleStore, prompts: range, flat: set[int]) -> None:
    """One group per prompt; the prompts in ``flat`` get equal rewards."""
    for p in prompts:
        rewards = [1.0] * SIZE if p in flat else [float(a % 2) for a in range(SIZE)]
        ids = [f"{p}/{a}" for a in range(SIZE)]
        store.put("p", {"prompt": [p] * SIZE, "reward": rewards}, ids=ids, groups=p)


def test_filtered_groups_are_dropped_counted_and_replaced_by_later_ones(make_store):
    store = make_store()
    flat = {1, 2, 5}
    _rollouts(store, range(8), flat)
    store.close("p")
    sampler = GroupSampler(group_size=SIZE)
    batches = []
    while True:
        try:
            batch = store.get(
                "t", ["prompt", "reward"], 2 * SIZE, "p", sampler=sampler,
                group_filter=_informative, timeout=10,
            )  # fmt: skip
        except PartitionClosed:
            break
        batches.append(sorted(set(batch["prompt"])))
    assert batches == [[0, 3], [4, 6], [7]]  # full batches of kept groups, the rest at close
    assert store.stats()["filtered"] == {"t": 3}
    assert store.stats()["consumed"] == {"t": 8 * SIZE}  # nothing left behind


def test_a_filter_that_raises_is_reported_by_name_and_consumes_nothing(make_store):
    store = make_store()
    _rollouts(store, range(2), set())
    sampler = GroupSampler(group_size=SIZE)

    def broken(group: dict) -> bool:
        raise KeyError("advantage")

    with pytest.raises(ValueError, match=r"group_filter raised KeyError\('advantage'\) on group 0"):
        store.get("t", ["reward"], SIZE, "p", sampler=sampler, group_filter=broken, timeout=5)
    assert store.stats()["consumed"] == {}
    batch = store.get("t", ["reward"], SIZE, "p", sampler=sampler, group_filter=_informative)
    assert batch.ids == [f"0/{a}" for a in range(SIZE)]


def _drops_0_raises_on_1(group: dict) -> bool:
    if group["prompt"][0] == 1:
        raise KeyError("advantage")
    return False


def test_a_filter_that_raises_after_dropping_a_group_counts_nothing(make_store):
    # Group 0 was dropped, then group 1 raised: the whole selection is thrown away, so
    # group 0 was neither consumed nor counted (it was counted once per attempt).
    store = make_store()
    _rollouts(store, range(2), set())
    sampler = GroupSampler(group_size=SIZE)
    for _ in range(3):
        with pytest.raises(ValueError, match=r"raised KeyError\('advantage'\) on group 1"):
            store.get(
                "t", ["prompt", "reward"], SIZE, "p", sampler=sampler,
                group_filter=_drops_0_raises_on_1, timeout=5,
            )  # fmt: skip
    assert store.stats()["consumed"] == {} and store.stats()["filtered"] == {}


def test_a_group_id_used_again_is_judged_again(make_store):
    # The same prompt sampled again (its group id again) once inherited the judgement of the
    # earlier group: a group with no signal passed the filter.
    store = make_store(tasks=["t"])
    sampler = GroupSampler(group_size=SIZE)
    _rollouts(store, range(1), set())  # prompt 0 with a signal: kept
    fields = ["prompt", "reward"]
    assert store.get("t", fields, SIZE, "p", sampler=sampler, group_filter=_informative).ids
    _rollouts(store, range(1), {0})  # prompt 0 again, equal rewards: no signal
    _rollouts(store, range(1, 2), set())
    batch = store.get("t", fields, SIZE, "p", sampler=sampler, group_filter=_informative)
    assert set(batch["prompt"]) == {1} and store.stats()["filtered"] == {"t": 1}


def test_a_group_filter_needs_a_group_sampler_and_a_function():
    store = SampleStore()
    with pytest.raises(ValueError, match="does not hand out groups"):
        store.get("t", ["reward"], 4, "p", group_filter=_informative, timeout=1)
    with pytest.raises(TypeError, match="group_filter must be a function"):
        store.get("t", ["reward"], 4, "p", sampler=GroupSampler(group_size=4), group_filter=3)


def test_simulated_ranks_get_full_batches_and_the_same_number_of_steps():
    """Two data ranks reading one round each step (the rank-aware plan), in one process:
    rejected groups never split a round, both ranks step together."""
    store = SampleStore()
    flat = {0, 3, 4, 9}
    _rollouts(store, range(12), flat)
    store.close("p")
    got: dict[int, list] = {0: [], 1: []}
    for step in range(10):
        for rank in (0, 1):
            sampler = RankAwareSampler(
                data_rank=rank, data_world_size=2, inner=GroupSampler(group_size=SIZE)
            )
            try:
                batch = store.get(
                    "t", ["prompt", "reward"], SIZE, "p", sampler=sampler, batch_index=step,
                    group_filter=_informative, timeout=5,
                )  # fmt: skip
            except PartitionClosed:
                continue
            got[rank].append(batch["prompt"])
    assert len(got[0]) == len(got[1]) == 4  # 8 kept groups, 2 per round
    assert all(len(b) == SIZE and len(set(b)) == 1 for r in got.values() for b in r)
    served = sorted(b[0] for r in got.values() for b in r)
    assert served == sorted(set(range(12)) - flat)
    assert store.stats()["filtered"] == {"t": 4}


def _dynamic_rank(rank: int, world: int, address: str, name: str) -> dict:
    import ray

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        store = SampleStore.connect(name)
        loader = StoreLoader(
            store, task="train", fields=["prompt", "reward"], partition="p",
            batch_size=2 * SIZE, mesh=DataMesh.from_env(), sampler=GroupSampler(group_size=SIZE),
            group_filter=_informative, timeout=60,
        )  # fmt: skip
        with loader:
            batches = [list(b["prompt"]) for b in loader]
            stats = loader.stats()["versions"]
        return {"batches": batches, "filtered": stats["filtered"]}
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_dynamic_sampling_on_two_gloo_ranks_full_batches_lockstep_filtered_counted(ray_session):
    """Producers write groups while 2 gloo ranks train: every batch is full (2 kept groups),
    both ranks take the same number of steps, the filtered groups are counted."""
    ray = ray_session
    name = f"store-{uuid.uuid4().hex[:8]}"
    store = SampleStore("ray", name=name, tasks=["train"])
    flat = {p for p in range(20) if p % 5 == 2}  # 4 groups with no signal, 16 kept

    def produce() -> None:
        _rollouts(store, range(20), flat)
        store.close("p")

    producer = threading.Thread(target=produce)
    try:
        producer.start()
        address = ray.get_runtime_context().gcs_address
        results = run_distributed(_dynamic_rank, 2, address, name, timeout=120)
        producer.join(30)
        stats = store.stats()
    finally:
        store.shutdown()
    steps = [len(r["batches"]) for r in results]
    assert steps == [4, 4]  # 16 kept groups / (2 ranks x 2 groups)
    assert all(len(b) == 2 * SIZE for r in results for b in r["batches"])  # every batch full
    served = sorted({p for r in results for b in r["batches"] for p in b})
    assert served == sorted(set(range(20)) - flat)
    assert stats["filtered"] == {"train": 4} and results[0]["filtered"] == 4
