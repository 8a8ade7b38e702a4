"""StoreLoader: mesh semantics, prefetch and worker processes without duplicates,
resumable state with batches in flight, data ranks ending together."""

from __future__ import annotations

import collections
import math
import os
import threading
import time
import uuid
from typing import Any

import pytest

from meshfeed.mesh import DataMesh
from meshfeed.queue import Batch, SampleStore, StoreLoader
from meshfeed.services import RayService, ThreadService
from meshfeed.testing import assert_resume_equivalence
from tests.queue.checkpointable import StoreWithLoader


def _loader(store: SampleStore, **kwargs: Any) -> StoreLoader:
    """A StoreLoader of task "t" over field "x" of partition "p", rank 0 of a one-rank
    mesh, with ``kwargs`` added or overriding."""
    defaults: dict[str, Any] = {
        "task": "t",
        "fields": ["x"],
        "partition": "p",
        "mesh": {"dp": 1},
        "rank": 0,
    }
    return StoreLoader(store, **{**defaults, **kwargs})


def _tag(batch: Batch) -> tuple[int, list]:
    """A transform run in worker processes: which process saw which ids."""
    return os.getpid(), list(batch.ids)


def _run_ranks(store: SampleStore, mesh: DataMesh, batch: int, prefetch: int = 1) -> dict:
    out: dict[int, list] = {}

    def rank(r: int) -> None:
        loader = _loader(
            store, task="actor", batch_size=batch, mesh=mesh, rank=r, timeout=20, prefetch=prefetch
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


@pytest.mark.parametrize("prefetch", [1, 4])
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
        loader = _loader(
            store, task=task, batch_size=7, num_workers=2, timeout=60, collate_fn=_tag, prefetch=3
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
            loader = _loader(
                store,
                task=task,
                batch_size=3,
                num_workers=2,
                timeout=120,
                collate_fn=_tag,
                prefetch=3,
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
    loader = _loader(store, batch_size=7, prefetch=4, timeout=math.inf)
    ids = [k for b in loader for k in b.ids]
    assert sorted(ids) == list(range(100)) and len(ids) == 100
    with pytest.raises(StopIteration):
        next(loader)


def test_loader_ends_when_the_partition_is_closed_and_drained():
    store = SampleStore()
    loader = _loader(store, batch_size=4, timeout=5, prefetch=1)
    store.put("p", {"x": [1, 2, 3, 4, 5]})
    assert next(loader).ids == [0, 1, 2, 3]
    store.close("p")
    assert [b.ids for b in loader] == [[4]]


def test_loader_wait_is_bounded_by_its_timeout():
    store = SampleStore()
    loader = _loader(store, batch_size=1, timeout=0.05, prefetch=1)
    with pytest.raises(TimeoutError):
        next(loader)
    store.put("p", {"x": [1]})
    assert next(loader).ids == [0]  # still usable after the timeout


def test_loader_rejects_bad_configuration():
    store = SampleStore()
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        _loader(store, batch_size=0, prefetch=1, timeout=math.inf)
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        _loader(store, batch_size=1, num_workers=-1, timeout=math.inf)
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        _loader(store, batch_size=1, prefetch=-1, timeout=math.inf)
    with pytest.raises(ValueError, match="num_workers='auto' is not available"):
        _loader(store, batch_size=1, num_workers="auto", timeout=math.inf)
    with pytest.raises(ValueError, match="pass num_workers=2 or service=..., not both"):
        _loader(store, batch_size=1, num_workers=2, service=ThreadService(2))
    with pytest.raises(TypeError, match="service=RayService is not a .*GlobalService"):
        _loader(store, batch_size=1, service=RayService(num_actors=1))
    with pytest.raises(ValueError, match="rank=4 is out of range"):
        _loader(store, batch_size=1, mesh={"dp": 2, "tp": 2}, rank=4, prefetch=1, timeout=math.inf)
    loader = _loader(store, batch_size=1, prefetch=1, timeout=math.inf)
    with pytest.raises(
        ValueError, match="StoreLoader state has version=1, this meshfeed reads version 5"
    ) as refused:
        loader.load_state_dict({"version": 1, "index": [0], "turn": 0, "done": [False]})
    assert "meshfeed 0.1" not in str(refused.value)  # 0.1 wrote version 2 of this part
    zero_one = {"version": 2, "task": "t", "partition": "p", "data_rank": 0, "next": 1}
    with pytest.raises(ValueError, match="version=2, .* written by meshfeed 0.1"):
        loader.load_state_dict(zero_one)  # the layout meshfeed 0.1's loader wrote (no kind)
    state = loader.state_dict()
    assert (state["kind"], state["version"]) == ("store_loader", 5)
    with pytest.raises(ValueError, match="version=2, this meshfeed reads version 5"):
        loader.load_state_dict({**state, "version": 2})
    other = _loader(store, task="u", batch_size=1, prefetch=1, timeout=math.inf)
    with pytest.raises(ValueError, match="task='t' but this loader has task='u'"):
        other.load_state_dict(state)


def _resumable(prefetch: int) -> StoreWithLoader:
    """A loader over 23 samples with its store, yielding batches' ids."""
    store = SampleStore()
    store.put("p", {"x": list(range(23))})
    store.close("p")
    loader = _loader(store, batch_size=3, prefetch=prefetch, timeout=20)
    return StoreWithLoader(store, loader, lambda batch: batch.ids)


@pytest.mark.parametrize("prefetch", [1, 2, 5])
def test_state_is_as_of_the_last_batch_returned_even_with_batches_in_flight(prefetch):
    reference = assert_resume_equivalence(
        lambda: _resumable(prefetch),
        num_items=8,
        cleanup=lambda r: r.loader.shutdown(),
        max_state_bytes=4096,
    )
    assert [k for ids in reference for k in ids] == list(range(23))


def test_checkpoint_with_prefetch_keeps_fetched_ahead_samples_of_an_evicting_store(tmp_path):
    store = SampleStore(tasks=["t"])  # a sample is dropped once "t" consumed it ...
    store.put("p", {"x": list(range(20))})
    store.close("p")
    loader = _loader(store, batch_size=2, prefetch=4, timeout=math.inf)
    first = [next(loader).ids for _ in range(2)]
    state = loader.state_dict()  # ... but not while its plan may be read again
    assert (state["next"], state["requested"]) == (2, 5)
    store.save(tmp_path / "store.pt")
    rest = [b.ids for b in loader]
    restored = SampleStore.load(tmp_path / "store.pt")
    again = _loader(restored, batch_size=2, prefetch=4, timeout=math.inf)
    again.load_state_dict(state)
    assert [b.ids for b in again] == rest
    assert [k for ids in first + rest for k in ids] == list(range(20))
    assert restored.stats()["held"] == 0 and store.stats()["held"] == 0


@pytest.mark.parametrize("n", range(1, 14))
@pytest.mark.parametrize("prefetch", [1, 3])
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


# ---------------------------------------------------------------- a transform that raises


class _FailOnce:
    """A picklable transform that fails the first time it sees each batch (marker files, so
    the count is shared by worker processes); returns the batch's ids."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, batch: Batch) -> list:
        marker = os.path.join(self.directory, f"seen-{batch.ids[0]}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError(f"transient failure on {batch.ids}")
        return list(batch.ids)


class _FailFor:
    """Fails while ``fail`` is set (a test flips it); counts calls."""

    def __init__(self) -> None:
        self.fail, self.calls = True, 0

    def __call__(self, batch: Batch) -> list:
        self.calls += 1
        if self.fail:
            raise RuntimeError("bad transform")
        return list(batch.ids)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_a_failing_transform_is_retried_on_the_same_batch_not_refetched(tmp_path, prefetch):
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": list(range(20))})
    store.close("p")
    loader = _loader(
        store, batch_size=3, prefetch=prefetch, timeout=20, collate_fn=_FailOnce(str(tmp_path))
    )
    out = []
    for _ in range(30):  # a caller that retries next() after an error must not lose data
        try:
            out.append(next(loader))
        except StopIteration:
            break
        except RuntimeError:
            continue
    assert out == [list(range(i, min(i + 3, 20))) for i in range(0, 20, 3)]
    assert store.stats()["held"] == 0  # delivered, released, evicted


def test_worker_processes_retry_a_failing_transform_without_losing_the_batch(tmp_path):
    store = SampleStore()
    store.put("p", {"x": list(range(30))})
    store.close("p")
    loader = _loader(
        store,
        batch_size=4,
        num_workers=2,
        timeout=60,
        collate_fn=_FailOnce(str(tmp_path)),
        prefetch=3,
    )
    out = list(loader)
    assert [k for ids in out for k in ids] == list(range(30))  # exactly once, in order


def test_a_replica_peer_whose_transform_fails_still_gets_the_batch_of_its_peers():
    store = SampleStore()
    store.put("p", {"x": list(range(12))})
    mesh = DataMesh.from_sizes(dp=1, tp=2)
    transform = _FailFor()
    first = _loader(store, batch_size=3, mesh=mesh, timeout=5, prefetch=1)
    second = _loader(
        store,
        batch_size=3,
        mesh=mesh,
        rank=1,
        timeout=5,
        collate_fn=transform,
        collate_retries=0,
        prefetch=1,
    )
    assert next(first).ids == [0, 1, 2]
    with pytest.raises(RuntimeError, match=r"sample ids \[0, 1, 2\]"):
        next(second)  # the last reader: the shared plan is gone once it has read it
    transform.fail = False
    assert next(second) == [0, 1, 2]  # the same batch as its peer, not a new plan
    assert [next(first).ids, next(second)] == [[3, 4, 5], [3, 4, 5]]
    # Only the last batch's plan is left, for a retry, until both peers ask for the next.
    assert store.stats()["cache_entries"] == 1
    assert [next(first).ids, next(second)] == [[6, 7, 8], [6, 7, 8]]
    assert store.stats()["cache_entries"] == 1


def test_a_transform_that_keeps_failing_names_the_batch_and_a_restore_redelivers_it(tmp_path):
    from meshfeed.queue import CollateError

    store = SampleStore(tasks=["t"])  # evicts consumed samples: the failed batch must be held
    store.put("p", {"x": list(range(10))})
    store.close("p")
    transform = _FailFor()
    kwargs = dict(mesh={"dp": 1}, rank=0)
    loader = StoreLoader(
        store,
        task="t",
        fields=["x"],
        batch_size=4,
        partition="p",
        collate_fn=transform,
        collate_retries=2,
        prefetch=1,
        timeout=math.inf,
        **kwargs,
    )
    with pytest.raises(CollateError, match=r"failed 3 times on batch 0 .*\[0, 1, 2, 3\]") as e:
        next(loader)
    assert e.value.ids == [0, 1, 2, 3] and e.value.index == 0 and transform.calls == 3
    state = loader.state_dict()
    assert (state["next"], state["requested"]) == (0, 1)  # batch 0: its plan is read back
    store.save(tmp_path / "store.pt")
    restored = SampleStore.load(tmp_path / "store.pt")
    again = StoreLoader(
        restored,
        task="t",
        fields=["x"],
        batch_size=4,
        partition="p",
        collate_fn=list_ids,
        prefetch=1,
        timeout=math.inf,
        **kwargs,
    )
    again.load_state_dict(state)
    assert list(again) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # nothing lost
    transform.fail = False
    assert list(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # the original goes on too
    assert store.stats()["held"] == 0 and restored.stats()["held"] == 0


def list_ids(batch: Batch) -> list:
    return list(batch.ids)


# ---------------------------------------------------------------- checkpoint waits are bounded


def test_state_dict_is_taken_at_once_while_a_batch_waits_for_producers_and_resumes_it(tmp_path):
    store = SampleStore()
    store.put("p", {"x": [0, 1]})
    loader = _loader(store, batch_size=1, prefetch=3, timeout=math.inf)
    assert next(loader).ids == [0]  # batches 1 and 2 now in flight; 2 waits for producers
    start = time.monotonic()
    state = loader.state_dict()  # producers wait for the trainer (a weight sync): no wait here
    assert time.monotonic() - start < 1.0
    assert (state["next"], state["requested"]) == (1, 3)
    store.save(tmp_path / "store.pt")
    store.put("p", {"x": [2, 3, 4]})
    store.close("p")
    assert [b.ids for b in loader] == [[1], [2], [3], [4]]  # rounds planned in index order
    loader.shutdown()
    store = SampleStore.load(tmp_path / "store.pt")  # the crash: round 2 not yet planned
    store.put("p", {"x": [2, 3, 4]})
    store.close("p")
    again = _loader(store, batch_size=1, prefetch=3, timeout=5)
    again.load_state_dict(state)
    # Batch 1 was planned before the checkpoint: read back; 2 and 3 were asked for, not yet
    # planned: planned again, in index order, from the same samples.
    assert [b.ids for b in again] == [[1], [2], [3], [4]]


# ---------------------------------------------------------------- replica peers must agree


@pytest.mark.parametrize(("setting", "other"), [("prefetch", 3), ("batch_size", 2)])
def test_replica_peers_with_different_prefetch_or_batch_size_are_refused(setting, other):
    store = SampleStore()
    store.put("p", {"x": list(range(20))})
    mesh = DataMesh.from_sizes(dp=1, tp=2)
    base = {"batch_size": 3, "prefetch": 1}
    first = _loader(store, mesh=mesh, timeout=5, **base)
    second = _loader(store, mesh=mesh, rank=1, timeout=5, **{**base, setting: other})
    assert next(first).ids == [0, 1, 2]
    with pytest.raises(ValueError, match="replica peers must share batch_size, prefetch"):
        next(second)
    second.shutdown()


def test_replica_peers_agreement_survives_a_store_checkpoint(tmp_path):
    store = SampleStore()
    store.put("p", {"x": list(range(20))})
    mesh = DataMesh.from_sizes(dp=1, tp=2)
    first = _loader(store, batch_size=3, mesh=mesh, timeout=5, prefetch=1)
    assert next(first).ids == [0, 1, 2]  # the plan for batch 0 waits for rank 1
    store.save(tmp_path / "store.pt")
    restored = SampleStore.load(tmp_path / "store.pt")
    ok = _loader(restored, batch_size=3, mesh=mesh, rank=1, timeout=5, prefetch=1)
    assert next(ok).ids == [0, 1, 2]
    again = SampleStore.load(tmp_path / "store.pt")
    bad = _loader(again, batch_size=3, mesh=mesh, rank=1, prefetch=2, timeout=5)
    with pytest.raises(ValueError, match="prefetch"):
        next(bad)
    bad.shutdown()


# ---------------------------------------------------------------- construction checks


def test_loader_refuses_a_world_larger_than_one_without_a_known_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    kw = {"task": "t", "fields": ["x"], "batch_size": 1, "partition": "p", "prefetch": 1}
    with pytest.raises(ValueError, match=r"world has 2 processes \(from the mesh\).*rank="):
        StoreLoader(SampleStore(), **kw, mesh={"dp": 2})
    assert StoreLoader(SampleStore(), **kw, mesh={"dp": 1}).rank == 0  # one process: rank 0


def test_loader_rejects_bool_workers_and_bad_timeouts_at_construction():
    store = SampleStore()
    args = (store,)
    kw = {"task": "t", "fields": ["x"], "batch_size": 1, "partition": "p"}
    # The argument checks are meshfeed.DataLoader's: a wrong type is a TypeError, a bad value a
    # ValueError, each naming the argument.
    with pytest.raises(TypeError, match="num_workers must be an int >= 0 .*num_workers=True"):
        StoreLoader(
            *args,
            **kw,
            mesh={"dp": 1},
            rank=0,
            num_workers=True,
            collate_fn=list_ids,
            timeout=math.inf,
        )
    with pytest.raises(TypeError, match="prefetch must be an int >= 1 .*prefetch=True"):
        StoreLoader(*args, **kw, mesh={"dp": 1}, rank=0, prefetch=True, timeout=math.inf)
    with pytest.raises(TypeError, match="timeout must be positive seconds .*timeout='5'"):
        StoreLoader(*args, **kw, mesh={"dp": 1}, rank=0, timeout="5", prefetch=1)
    with pytest.raises(ValueError, match="timeout must be positive seconds .*timeout=-1"):
        StoreLoader(*args, **kw, mesh={"dp": 1}, rank=0, timeout=-1, prefetch=1)
    with pytest.raises(ValueError, match="timeout must be positive seconds .*timeout=nan"):
        StoreLoader(*args, **kw, mesh={"dp": 1}, rank=0, timeout=math.nan)
    with pytest.raises(ValueError, match="collate_retries must be an int >= 0"):
        StoreLoader(
            *args, **kw, mesh={"dp": 1}, rank=0, collate_retries=-1, prefetch=1, timeout=math.inf
        )


@pytest.mark.ray  # the example imports ray
@pytest.mark.parametrize("steps", ["0", "1"])
@pytest.mark.slow
def test_ray_trainers_example_refuses_too_few_steps_with_a_clear_message(steps):
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "ray_trainers.py"
    done = subprocess.run(
        [sys.executable, str(example), "--steps", steps],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"--steps must be >= 2 (got {steps})" in done.stderr


# ---------------------------------------------------------------- samplers on a mesh
@pytest.mark.parametrize("trial", range(3))
def test_a_group_sampler_on_a_mesh_gives_every_data_rank_the_same_steps_and_whole_groups(trial):
    from meshfeed.queue import GroupSampler

    store = SampleStore()
    mesh = DataMesh.from_sizes(dp=2)
    out: dict[int, list] = {}

    def rank(r: int) -> None:
        loader = _loader(
            store,
            fields=["x"],
            batch_size=4,
            mesh=mesh,
            rank=r,
            timeout=20,
            sampler=GroupSampler(group_size=4),
        )
        out[r] = [b["x"] for b in loader]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for g in range(16 + trial):  # a GRPO producer: one prompt, four answers at a time
        store.put("p", {"x": [g] * 4}, ids=[f"{g}/{j}" for j in range(4)], groups=g)
    store.close("p")
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(out[0]) == len(out[1]) == (16 + trial) // 2  # the same steps on both ranks
    seen = [x for r in out for b in out[r] for x in b]
    for batch in (b for r in out for b in out[r]):
        assert len(batch) == 4 and len(set(batch)) == 1  # one whole group per batch
    assert len(set(seen)) == len(seen) // 4


def test_a_sampler_that_plans_per_rank_is_refused_on_a_mesh_naming_the_fix():
    from meshfeed.queue import RankAwareSampler

    class Mine:
        extra_fields = ()

        def share(self, context):
            return None

        def select(self, view, batch_size):
            return None

    mesh = DataMesh.from_sizes(dp=2)
    with pytest.raises(ValueError, match=r"different numbers of batches.*RankAwareSampler"):
        _loader(SampleStore(), batch_size=2, mesh=mesh, rank=0, sampler=Mine())
    other = RankAwareSampler.from_mesh(mesh, 1)
    with pytest.raises(ValueError, match=r"global rank 0 of the mesh.*from_mesh"):
        _loader(SampleStore(), batch_size=2, mesh=mesh, rank=0, sampler=other)
    # One rank: wrapped, so each batch is a plan the store keeps by its index (exact resume).
    wrapped = _loader(SampleStore(), batch_size=2, sampler=Mine()).sampler
    assert isinstance(wrapped, RankAwareSampler) and isinstance(wrapped.inner, Mine)
