"""Real processes: Ray actors produce, torchrun-style gloo ranks consume one named Ray store."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from meshfeed.mesh import DataMesh
from meshfeed.queue import PartitionClosed, SampleStore, StoreLoader
from tests.dist_utils import run_distributed

PRODUCERS, PER_PRODUCER = 4, 16


class _Producer:
    """A Ray actor process putting fields of samples (large ones via the object store)."""

    def produce(self, store: SampleStore, p: int) -> int:
        for i in range(0, PER_PRODUCER, 4):
            ids = [f"{p}-{j}" for j in range(i, i + 4)]
            store.put("p", {"obs": np.full((4, 32768), p, dtype=np.float32)}, ids=ids, timeout=60)
            store.put("p", {"reward": [float(p)] * 4}, ids=ids[::-1], timeout=60)
        return PER_PRODUCER


def _rank_main(rank: int, world: int, address: str, name: str) -> dict:
    import ray
    import torch.distributed as dist

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        store = SampleStore.connect(name)
        task = ["actor", "critic"][rank % 2]  # two consumer processes compete per task
        consumed = []
        while True:
            try:
                batch = store.get(task, ["obs", "reward"], 4, "p", timeout=60)
            except PartitionClosed:
                break
            assert batch["obs"].shape == (len(batch), 32768)
            assert all(batch["obs"][i, 0] == batch["reward"][i] for i in range(len(batch)))
            consumed.extend(batch.ids)
        mesh = DataMesh.from_env(tp=2)  # WORLD_SIZE=4 -> dp=2 x tp=2; rank from the process group
        loader = StoreLoader(
            store,
            task="train",
            fields=["x"],
            batch_size=3,
            partition="q",
            mesh=mesh,
            timeout=60,
            prefetch=1,
        )
        ids = [b.ids for b in loader]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, ids)  # the ranks' views, compared in every process
        return {"task": task, "consumed": consumed, "ids": ids, "everyone": everyone}
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_four_producer_and_four_consumer_processes_exactly_once_and_replicas_agree(ray_session):
    ray = ray_session
    name = f"store-{uuid.uuid4().hex[:8]}"
    store = SampleStore("ray", capacity=32, tasks=["actor", "critic"], name=name)
    producers = [ray.remote(num_cpus=0)(_Producer).remote() for _ in range(PRODUCERS)]
    try:
        store.put("q", {"x": list(range(24))})
        store.close("q")
        done = [p.produce.remote(store, i) for i, p in enumerate(producers)]

        def close_when_produced() -> None:
            ray.get(done, timeout=180)
            store.close("p")

        closer = threading.Thread(target=close_when_produced)
        closer.start()
        address = ray.get_runtime_context().gcs_address
        results = run_distributed(_rank_main, 4, address, name, timeout=180)
        closer.join(10)
        stats = store.stats()
    finally:
        for p in producers:
            ray.kill(p)
        store.shutdown()
    expected = sorted(f"{p}-{i}" for p in range(PRODUCERS) for i in range(PER_PRODUCER))
    for task in ("actor", "critic"):
        got = [k for r in results if r["task"] == task for k in r["consumed"]]
        assert sorted(got) == expected  # every sample once per task: no loss, no duplicate
    assert stats["partitions"]["p"]["samples"] == 0  # dropped once both tasks consumed them
    assert stats["bytes_in_object_store"] == 0
    ids = [r["ids"] for r in results]
    assert ids[0] == ids[1] and ids[2] == ids[3]  # tp peers: identical batches
    assert all(r["everyone"] == ids for r in results)
    assert sorted(k for batch in ids[0] + ids[2] for k in batch) == list(range(24))


# ---------------------------------------------------------------- elastic resume on gloo ranks
def _resume_rank(rank: int, world: int, address: str, name: str) -> dict:
    """Two steps as dp=2 x tp=2 and the state (every rank's the same); then the rest of the
    stream from rank 0's state as dp=4."""
    import ray
    import torch.distributed as dist

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        store = SampleStore.connect(name)

        def loader(mesh: DataMesh) -> StoreLoader:
            return StoreLoader(store, task="train", fields=["x"], partition="r",
                               batch_size=8 // mesh.data_world_size, mesh=mesh, prefetch=2,
                               timeout=60)  # fmt: skip

        with loader(DataMesh.from_env(tp=2)) as old:
            first = [next(old).ids for _ in range(2)]
            state = old.state_dict()
        states: list = [None] * world
        dist.all_gather_object(states, state)  # the checkpoint: the store is at it already
        with loader(DataMesh.from_env()) as new:
            new.load_state_dict(states[0])
            rest = [b.ids for b in new]
        return {"first": first, "rest": rest, "states": states}
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_a_store_loader_state_of_dp2_tp2_gloo_ranks_resumes_on_dp4_serving_every_sample_once(
    ray_session,
):
    ray = ray_session
    name = f"store-{uuid.uuid4().hex[:8]}"
    store = SampleStore("ray", name=name)
    try:
        store.put("r", {"x": list(range(40))})  # 5 rounds of a global batch of 8
        store.close("r")
        address = ray.get_runtime_context().gcs_address
        results = run_distributed(_resume_rank, 4, address, name, timeout=120)
        stats = store.stats()
    finally:
        store.shutdown()
    states = results[0]["states"]
    assert all(s == states[0] for s in states)  # one state for every rank
    assert (states[0]["next"], states[0]["requested"]) == (2, 3)  # round 2: fetched ahead
    assert results[0]["first"] == results[1]["first"] != results[2]["first"]  # tp peers
    assert [len(r["rest"]) for r in results] == [3] * 4  # rounds 2, 3, 4 on every new rank
    assert all(len(ids) == 2 for r in results for ids in r["rest"])
    first = [k for r in results[::2] for ids in r["first"] for k in ids]  # one per tp group
    served = first + [k for r in results for ids in r["rest"] for k in ids]
    assert sorted(served) == list(range(40))  # none twice, none lost
    assert stats["cache_entries"] == 0  # neither layout's plans left pinned


# ---------------------------------------------------------------- on_error="skip" agreed by ranks
def _fails_on_4(batch) -> list:
    if 4 in batch.ids:  # round 1 is [4, 5] on data rank 0 and [6, 7] on data rank 1
        raise ValueError("cannot collate sample 4")
    return list(batch.ids)


def _skip_rank(rank: int, world: int) -> dict:
    store = SampleStore()  # each process its own store, same puts: the same rounds
    store.put("p", {"x": list(range(16))})
    store.close("p")
    with StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=2,
                     mesh=DataMesh.from_env(), collate_fn=_fails_on_4, on_error="skip",
                     prefetch=2, timeout=30) as loader:  # fmt: skip
        out = {"ids": list(loader), "stats": loader.stats()}
    # on_error="raise": the rank whose batch fails raises it, the other raises RankError at the
    # same batch (which it keeps first in line), so neither goes on to a later collective
    store = SampleStore()
    store.put("p", {"x": list(range(16))})
    store.close("p")
    with StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=2,
                     mesh=DataMesh.from_env(), collate_fn=_fails_on_4, on_error="raise",
                     collate_retries=0, prefetch=2, timeout=30) as loader:  # fmt: skip
        got = [next(loader)]
        try:
            got.append(next(loader))
        except Exception as e:  # the test reports which error each rank saw
            out["raised"] = (type(e).__name__, getattr(e, "rank", None))
        out["before_error"] = got
        out["pending"] = loader.state_dict()["next"]
    return out


@pytest.mark.slow
def test_on_error_on_gloo_ranks_skip_drops_a_round_on_every_rank_and_raise_stops_every_rank():
    results = run_distributed(_skip_rank, 2, timeout=120)
    assert [r["before_error"] for r in results] == [[[0, 1]], [[2, 3]]]
    assert results[0]["raised"] == ("CollateError", None)
    assert results[1]["raised"] == ("RankError", 0)  # its own batch 1 was fine
    assert [r["pending"] for r in results] == [1, 1]  # batch 1 stays first in line
    assert results[0]["ids"] == [[0, 1], [8, 9], [12, 13]]
    assert results[1]["ids"] == [[2, 3], [10, 11], [14, 15]]  # its round 1 dropped too
    assert results[0]["stats"]["failures"] == [[1, [4, 5], "ValueError", "cannot collate sample 4"]]
    assert results[1]["stats"]["failures"] == [
        [1, [6, 7], "RankError", "rank 0 could not collate its part of this round"]
    ]
    assert [r["stats"]["skipped"] for r in results] == [1, 1]
