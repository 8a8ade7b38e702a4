"""StreamingDataLoader: mesh semantics, prefetch and worker processes without duplicates,
resumable state with batches in flight, data ranks ending together."""

from __future__ import annotations

import collections
import os
import threading
import uuid

import pytest

from meshfeed.mesh import DataMesh
from meshfeed.queue import Batch, SampleStore, StreamingDataLoader
from meshfeed.testing import assert_resume_equivalence


def _tag(batch: Batch) -> tuple[int, list]:
    """A transform run in worker processes: which process saw which ids."""
    return os.getpid(), list(batch.ids)


def _run_ranks(store: SampleStore, mesh: DataMesh, batch: int, prefetch: int = 0) -> dict:
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
            prefetch=prefetch,
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


@pytest.mark.parametrize("prefetch", [0, 3])
def test_replica_peers_get_identical_batches_and_data_ranks_disjoint_ones(make_store, prefetch):
    store = make_store()
    mesh = DataMesh.from_sizes(dp=2, tp=2)
    run = _run_ranks(store, mesh, batch=3, prefetch=prefetch)
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


def _count(per_task: dict[str, list]) -> dict[str, collections.Counter]:
    return {
        t: collections.Counter(k for ids in batches for k in ids) for t, batches in per_task.items()
    }


def test_worker_processes_deliver_every_sample_exactly_once_per_task():
    store = SampleStore(tasks=["actor", "critic"])
    store.put("p", {"x": list(range(60))})
    store.close("p")
    seen: dict[str, list] = {}
    for task in ("actor", "critic"):
        loader = StreamingDataLoader(
            store,
            task,
            ["x"],
            7,
            "p",
            mesh={"dp": 1},
            rank=0,
            num_workers=2,
            transform=_tag,
            timeout=60,
        )
        out = list(loader)
        assert all(pid != os.getpid() for pid, _ in out)  # the transform ran in workers
        seen[task] = [ids for _, ids in out]
        with pytest.raises(StopIteration):
            next(loader)
    for task, counts in _count(seen).items():
        assert sorted(counts) == list(range(60)) and set(counts.values()) == {1}, task
    assert store.stats()["held"] == 0  # fetched-ahead holds released, samples evicted


@pytest.mark.ray
@pytest.mark.slow
def test_ray_worker_processes_fetch_each_sample_exactly_once_per_task(ray_session):
    name = f"loader-{uuid.uuid4().hex[:8]}"
    store = SampleStore("ray", tasks=["actor", "critic"], name=name)
    try:
        store.put("p", {"x": list(range(40))})
        store.close("p")
        seen = {}
        for task in ("actor", "critic"):
            loader = StreamingDataLoader(
                store,
                task,
                ["x"],
                3,
                "p",
                mesh={"dp": 1},
                rank=0,
                num_workers=2,
                transform=_tag,
                timeout=120,
            )
            out = list(loader)
            assert all(pid != os.getpid() for pid, _ in out)  # fetched in worker processes
            seen[task] = [ids for _, ids in out]
        held = store.stats()["held"]
    finally:
        store.shutdown()
    for task, counts in _count(seen).items():
        assert sorted(counts) == list(range(40)) and set(counts.values()) == {1}, task
    assert held == 0


def test_prefetch_never_duplicates_a_sample():
    store = SampleStore()
    store.put("p", {"x": list(range(100))})
    store.close("p")
    loader = StreamingDataLoader(store, "t", ["x"], 7, "p", mesh={"dp": 1}, rank=0, prefetch=3)
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
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        StreamingDataLoader(store, "t", ["x"], 1, "p", mesh={"dp": 1}, rank=0, prefetch=-1)
    with pytest.raises(ValueError, match="pass transform="):
        StreamingDataLoader(store, "t", ["x"], 1, "p", mesh={"dp": 1}, rank=0, num_workers=2)
    with pytest.raises(ValueError, match="rank=4 is out of range"):
        StreamingDataLoader(store, "t", ["x"], 1, "p", mesh={"dp": 2, "tp": 2}, rank=4)
    loader = StreamingDataLoader(store, "t", ["x"], 1, "p", mesh={"dp": 1}, rank=0)
    with pytest.raises(ValueError, match="version 1 is not 2"):
        loader.load_state_dict({"version": 1, "index": [0], "turn": 0, "done": [False]})
    state = loader.state_dict()
    other = StreamingDataLoader(store, "u", ["x"], 1, "p", mesh={"dp": 1}, rank=0)
    with pytest.raises(ValueError, match="task='t' but this loader has task='u'"):
        other.load_state_dict(state)


class _Resumable:
    """A loader plus the consumption state of its store: one checkpointable object."""

    def __init__(self, prefetch: int) -> None:
        self.store = SampleStore()
        self.store.put("p", {"x": list(range(23))})
        self.store.close("p")
        self.loader = StreamingDataLoader(
            self.store, "t", ["x"], 3, "p", mesh={"dp": 1}, rank=0, prefetch=prefetch, timeout=20
        )

    def __next__(self) -> list:
        return next(self.loader).ids

    def state_dict(self) -> dict:
        loader = self.loader.state_dict()  # first: waits for batches in flight
        return {"loader": loader, "store": self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state["store"])
        self.loader.load_state_dict(state["loader"])


@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_state_is_as_of_the_last_batch_returned_even_with_batches_in_flight(prefetch):
    reference = assert_resume_equivalence(
        lambda: _Resumable(prefetch), num_items=10, cleanup=lambda r: r.loader.close()
    )
    assert [k for ids in reference for k in ids] == list(range(23))


def test_checkpoint_with_prefetch_keeps_fetched_ahead_samples_of_an_evicting_store(tmp_path):
    store = SampleStore(tasks=["t"])  # a sample is dropped once "t" consumed it ...
    store.put("p", {"x": list(range(20))})
    store.close("p")
    loader = StreamingDataLoader(store, "t", ["x"], 2, "p", mesh={"dp": 1}, rank=0, prefetch=3)
    first = [next(loader).ids for _ in range(2)]
    state = loader.state_dict()  # ... but not while fetched ahead and not yet returned
    assert len(state["pending"]) == 3 and all(ids for _, ids in state["pending"])
    store.save(tmp_path / "store.pt")
    rest = [b.ids for b in loader]
    restored = SampleStore.load(tmp_path / "store.pt")
    again = StreamingDataLoader(restored, "t", ["x"], 2, "p", mesh={"dp": 1}, rank=0, prefetch=3)
    again.load_state_dict(state)
    assert [b.ids for b in again] == rest
    assert [k for ids in first + rest for k in ids] == list(range(20))
    assert restored.stats()["held"] == 0 and store.stats()["held"] == 0


@pytest.mark.parametrize("n", range(1, 14))
@pytest.mark.parametrize("prefetch", [0, 2])
def test_data_ranks_end_at_the_same_step(n, prefetch):
    mesh = DataMesh.from_sizes(dp=3, tp=2)
    store = SampleStore()
    run = _run_ranks(store, mesh, batch=2, prefetch=prefetch)
    store.put("p", {"x": list(range(n))})
    store.close("p")
    out = _finish(run)
    steps = {r: len(batches) for r, batches in out.items()}
    assert len(set(steps.values())) == 1, steps  # every rank, every data rank: same step count
    assert all(ids for batches in out.values() for ids in batches)  # no empty batch
    delivered = sorted(k for g in mesh.replica_groups() for ids in out[g[0]] for k in ids)
    # full rounds of 3 x 2; a last partial round of >= 3 samples is split as evenly as
    # possible; fewer than 3 leftover samples are not handed out
    kept = n if n % 6 >= 3 or n % 6 == 0 else n - n % 6
    assert delivered == list(range(kept))
    assert store.stats()["cache_entries"] == 0
