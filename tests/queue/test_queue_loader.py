"""StreamingDataLoader: mesh semantics, worker streams without duplicates, clean ends."""

from __future__ import annotations

import threading

import pytest

from meshfeed.mesh import DataMesh
from meshfeed.queue import SampleStore, StreamingDataLoader


def _run_ranks(store: SampleStore, mesh: DataMesh, batch: int, num_workers: int = 0) -> dict:
    out: dict[int, list] = {}

    def rank(r: int) -> None:
        loader = StreamingDataLoader(
            store,
            "actor",
            ["x"],
            batch,
            "p",
            mesh=mesh,
            rank=r,
            timeout=20,
            num_workers=num_workers,
        )
        out[r] = [b.ids for b in loader]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(mesh.world_size)]
    for t in threads:
        t.start()
    return {"threads": threads, "out": out}


def _finish(run: dict) -> dict[int, list]:
    for t in run["threads"]:
        t.join(30)
    assert not any(t.is_alive() for t in run["threads"])
    return run["out"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_replica_peers_get_identical_batches_and_data_ranks_disjoint_ones(make_store, num_workers):
    store = make_store()
    mesh = DataMesh.from_sizes(dp=2, tp=2)
    run = _run_ranks(store, mesh, batch=3, num_workers=num_workers)
    for i in range(0, 30, 5):  # streamed while the ranks iterate
        store.put("p", {"x": list(range(i, i + 5))})
    store.close("p")
    out = _finish(run)
    for group in mesh.replica_groups():
        assert all(out[r] == out[group[0]] for r in group)  # identical, batch for batch
    per_data_rank = [[k for ids in out[g[0]] for k in ids] for g in mesh.replica_groups()]
    everything = sorted(per_data_rank[0] + per_data_rank[1])
    assert everything == list(range(30))  # disjoint and exhaustive: exactly once
    assert store.stats()["cache_entries"] == 0


def test_worker_streams_never_duplicate_a_sample():
    store = SampleStore()
    store.put("p", {"x": list(range(100))})
    store.close("p")
    loader = StreamingDataLoader(store, "t", ["x"], 7, "p", mesh={"dp": 1}, rank=0, num_workers=3)
    ids = [k for b in loader for k in b.ids]
    assert sorted(ids) == list(range(100)) and len(ids) == 100
    with pytest.raises(StopIteration):
        next(loader)


def test_loader_ends_when_the_partition_is_closed_and_drained():
    store = SampleStore()
    loader = StreamingDataLoader(store, "t", ["x"], 4, "p", mesh={"dp": 1}, rank=0, timeout=5)
    store.put("p", {"x": [1, 2, 3, 4, 5]})
    assert next(loader).ids == [0, 1, 2, 3]
    store.close("p")
    assert [b.ids for b in loader] == [[4]]


def test_loader_wait_is_bounded_by_its_timeout():
    store = SampleStore()
    loader = StreamingDataLoader(store, "t", ["x"], 1, "p", mesh={"dp": 1}, rank=0, timeout=0.05)
    with pytest.raises(TimeoutError):
        next(loader)
    store.put("p", {"x": [1]})
    assert next(loader).ids == [0]  # still usable after the timeout


def test_loader_rejects_bad_configuration():
    store = SampleStore()
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        StreamingDataLoader(store, "t", ["x"], 0, "p", mesh={"dp": 1}, rank=0)
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        StreamingDataLoader(store, "t", ["x"], 1, "p", mesh={"dp": 1}, rank=0, num_workers=-1)
    with pytest.raises(ValueError, match="rank=4 is out of range"):
        StreamingDataLoader(store, "t", ["x"], 1, "p", mesh={"dp": 2, "tp": 2}, rank=4)
    loader = StreamingDataLoader(store, "t", ["x"], 1, "p", mesh={"dp": 1}, rank=0, num_workers=2)
    with pytest.raises(ValueError, match="same num_workers"):
        loader.load_state_dict({"version": 1, "index": [0], "turn": 0, "done": [False]})


def test_loader_refuses_a_checkpoint_that_would_lose_prefetched_batches():
    store = SampleStore()
    store.put("p", {"x": list(range(10))})
    loader = StreamingDataLoader(store, "t", ["x"], 2, "p", mesh={"dp": 1}, rank=0, num_workers=2)
    next(loader)
    with pytest.raises(ValueError, match="num_workers=0"):
        loader.state_dict()
