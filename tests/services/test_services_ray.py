"""RayService: dataset built in loader actors, one reference per data rank, exact resume."""

from __future__ import annotations

import os
import time

import pytest
import torch

from meshfeed import DataLoader, DataMesh, SampleError
from meshfeed.order.batches import ShuffledOrder
from meshfeed.protocols import GlobalService, Service
from meshfeed.services.ray import LoaderActorError, RayService, RemoteBatch
from meshfeed.sources.lazy import LazyDataset
from meshfeed.sources.mixture import Mixture
from meshfeed.testing import assert_resume_equivalence, assert_same, take
from tests.optional import given, settings, st


class Items:
    """A small dataset; ``built_in`` records the process that built it (must be an actor)."""

    def __init__(self, n: int = 30, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.n, self.fail_at, self.delay, self.built_in = n, fail_at, delay, os.getpid()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay:
            time.sleep(self.delay)  # keeps steps in flight long enough to be lost by a kill
        if i == self.fail_at:
            raise ValueError(f"cannot decode sample {i}")
        return {"i": i, "x": torch.arange(4) + i, "built_in": self.built_in}


class Sequential(Items):
    """A dataset with its own order (positions in order): the loader asks the actor for it."""

    def make_order(self, *, dataset_length: int, global_batch_size: int, seed: int):
        return ShuffledOrder(dataset_length, seed=seed, shuffle=False)


def _items_14() -> Items:
    return Items(14)


def _failing() -> Items:
    return Items(30, fail_at=7)


def _slow_items() -> Items:
    return Items(30, delay=0.03)


def _stalled() -> Items:
    return Items(30, delay=30.0)


def _broken() -> Items:
    raise FileNotFoundError("/data/shard-00007.bin does not exist")


def _strip(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "built_in"}


def _ray_loader(create, *, mesh: dict, service: RayService | None = None, **kwargs) -> DataLoader:
    service = service or RayService()
    return DataLoader(create, mesh=mesh, service=service, **kwargs)


def _resolve(remote_batches: list[RemoteBatch], rank: int) -> list[dict]:
    import ray

    return [_strip(b) for b in ray.get([rb.for_rank(rank) for rb in remote_batches])]


# ---------------------------------------------------------------------- without Ray


def test_remote_batch_maps_global_ranks_to_their_data_rank_reference():
    mesh = DataMesh.from_sizes(dp=2, tp=2)
    rb = RemoteBatch(0, 5, ("ref-d0", "ref-d1"), mesh)
    assert [rb.for_rank(r) for r in range(4)] == ["ref-d0", "ref-d0", "ref-d1", "ref-d1"]
    assert rb.for_data_rank(1) == "ref-d1" and rb.data_world_size == 2
    with pytest.raises(ValueError, match="rank=4 is out of range"):
        rb.for_rank(4)
    with pytest.raises(ValueError, match=r"data_rank=2 is out of range .* \[0, 2\)"):
        rb.for_data_rank(2)


@settings(max_examples=30, deadline=None)
@given(dp=st.integers(1, 4), tp=st.integers(1, 3), cp=st.integers(1, 2), pp=st.integers(1, 2))
def test_replica_peers_share_one_reference_and_data_ranks_never_do(dp, tp, cp, pp):
    mesh = DataMesh.from_sizes(dp=dp, tp=tp, cp=cp, pp=pp)
    rb = RemoteBatch(0, 0, tuple(f"ref{d}" for d in range(dp)), mesh)
    for group in mesh.replica_groups():
        assert len({rb.for_rank(r) for r in group}) == 1
    assert len({rb.for_rank(g[0]) for g in mesh.replica_groups()}) == dp


def test_without_a_mesh_global_ranks_are_data_ranks():
    rb = RemoteBatch(0, 0, ("a", "b"))
    assert [rb.for_rank(r) for r in range(2)] == ["a", "b"]
    with pytest.raises(ValueError, match="data_rank=2 is out of range"):
        rb.for_rank(2)


def test_a_service_that_was_not_started_refuses_to_serve():
    with pytest.raises(RuntimeError, match="without running actors"):
        next(iter(RayService().map_global(iter([]))))


def test_remote_batch_refuses_a_mesh_of_another_data_world_size():
    with pytest.raises(ValueError, match="does not fit the mesh"):
        RemoteBatch(0, 0, ("a", "b", "c"), DataMesh.from_sizes(dp=2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_actors": 0}, "num_actors must be an int >= 1"),
        ({"prefetch": 0}, "prefetch must be an int >= 1"),
        ({"actor_options": {"max_restarts": -2}}, r"max_restarts'\] must be an int >= -1"),
        ({"timeout": 0}, "timeout must be positive"),
        ({"start_timeout": -1}, "start_timeout must be positive"),
    ],
)
def test_ray_service_rejects_bad_options_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RayService(**kwargs)


def test_ray_service_wants_a_callable_not_a_built_dataset():
    with pytest.raises(TypeError, match=r"functools.partial\(MyDataset, path\)"):
        RayService().prepare(Items(5))
    # It meets the protocol it is passed as: a GlobalService, never a per-rank Service.
    assert isinstance(RayService(), GlobalService)
    assert not isinstance(RayService(), Service)


def test_binding_a_different_mesh_is_refused():
    service = RayService()
    service.bind_mesh(DataMesh.from_sizes(dp=2))
    service.bind_mesh(DataMesh.from_sizes(dp=2))
    with pytest.raises(ValueError, match="one RayService per DataLoader"):
        service.bind_mesh(DataMesh.from_sizes(dp=4))


# ---------------------------------------------------------------------- with Ray


class Trainer:
    """A consumer (one per global rank): resolves only its own slice, inside its process."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seen: list[dict] = []
        self.bytes = 0

    def train_step(self, remote_batch: RemoteBatch) -> int:
        import ray

        batch = ray.get(remote_batch.for_rank(self.rank))
        self.bytes += sum(v.numel() * v.element_size() for v in batch.values())
        self.seen.append(_strip(batch))
        return os.getpid()

    def report(self) -> tuple[list[dict], int]:
        return self.seen, self.bytes


@pytest.mark.ray
@pytest.mark.slow
def test_four_trainer_actors_each_get_only_their_in_process_slice(ray_session):
    mesh = {"dp": 4}
    trainers = [ray_session.remote(Trainer).options(num_cpus=0).remote(rank) for rank in range(4)]
    service = RayService(num_actors=2, prefetch=3)
    with _ray_loader(Items, mesh=mesh, service=service, batch_size=2, seed=7) as loader:
        assert len(loader) == 3  # 30 samples, global batch 8
        head = take(loader, 2)
        state = loader.state_dict()
        tail = take(loader, 3)  # crosses into epoch 1
        pids = set()
        for rb in head + tail:
            pids |= set(ray_session.get([t.train_step.remote(rb) for t in trainers]))
        built_in = {int(v) for rb in head for v in ray_session.get(rb.refs[0])["built_in"]}
    assert os.getpid() not in built_in | pids and len(built_in) == 2  # in the two loader actors
    assert [(rb.epoch, rb.step) for rb in head + tail] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    slice_bytes = 2 * (8 + 4 * 8 + 8)  # two samples of int64 "i", 4 x int64 "x", "built_in"
    for rank, (seen, nbytes) in enumerate(ray_session.get([t.report.remote() for t in trainers])):
        assert nbytes == 5 * slice_bytes  # only its own slice, never the global batch
        local = DataLoader(Items(), batch_size=2, mesh=mesh, rank=rank, seed=7)
        assert_same(seen, [_strip(b) for b in take(local, 5)])
        resumed = DataLoader(Items(), batch_size=2, mesh=mesh, rank=rank, seed=7)
        resumed.load_state_dict(state)  # a Ray loader's state resumes the in-process loader
        assert_same(seen[2:], [_strip(b) for b in take(resumed, 3)])
    for t in trainers:
        ray_session.kill(t)


@pytest.mark.ray
@pytest.mark.slow
def test_resuming_from_any_state_gives_the_same_per_rank_batches(ray_session):
    mesh = {"dp": 2, "tp": 2}

    def factory() -> DataLoader:
        return _ray_loader(_items_14, mesh=mesh, batch_size=2, seed=3, prefetch=2)

    def equal(want: RemoteBatch, got: RemoteBatch, where: str) -> None:
        assert (want.epoch, want.step) == (got.epoch, got.step), where
        for rank in range(4):
            assert_same(
                _strip(ray_session.get(want.for_rank(rank))),
                _strip(ray_session.get(got.for_rank(rank))),
                f"{where} rank {rank}",
            )

    reference = assert_resume_equivalence(
        factory, num_items=5, every=4, cleanup=lambda lo: lo.shutdown(), equal=equal
    )
    assert [(rb.epoch, rb.step) for rb in reference] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


@pytest.mark.ray
def test_bad_samples_are_substituted_in_the_actor_as_in_process(ray_session):
    kwargs = {"batch_size": 5, "seed": 1, "on_error": "substitute"}
    with _ray_loader(_failing, mesh={"dp": 2}, **kwargs) as loader:
        got = take(loader, 3)
        stats = loader.stats()
    local = [DataLoader(_failing(), mesh={"dp": 2}, rank=r, **kwargs) for r in range(2)]
    for r in range(2):
        assert_same(_resolve(got, r), [_strip(b) for b in take(local[r], 3)])
    assert stats["substituted"] == 1 and stats["failures"][0]["index"] == 7


@pytest.mark.ray
@pytest.mark.slow
def test_a_dataset_order_built_in_the_actor_drives_the_driver_plan(ray_session):
    with _ray_loader(Sequential, mesh={"dp": 2}, batch_size=2) as loader:
        got = take(loader, 2)
        assert isinstance(loader.order, ShuffledOrder) and not loader.order.shuffle
    assert [b["i"].tolist() for b in _resolve(got, 0)] == [[0, 1], [4, 5]]
    assert [b["i"].tolist() for b in _resolve(got, 1)] == [[2, 3], [6, 7]]


def _double(x: int) -> int:
    return 2 * x


def _lazy_mixture() -> LazyDataset:
    """#28: a lazy map over a 3:1 mixture, built in the actor, must keep the mixture's order."""
    mix = Mixture({"a": list(range(100)), "b": list(range(1000, 1100))}, {"a": 3, "b": 1})
    return LazyDataset(mix).map(_double)


@pytest.mark.ray
@pytest.mark.slow
def test_a_lazy_map_over_a_mixture_built_in_the_actor_keeps_the_weights(ray_session):
    with _ray_loader(_lazy_mixture, mesh={"dp": 2}, batch_size=4, seed=3) as loader:
        got = take(loader, 5)
    local = [
        DataLoader(_lazy_mixture(), mesh={"dp": 2}, rank=r, batch_size=4, seed=3) for r in (0, 1)
    ]
    for r in (0, 1):
        assert [b.tolist() for b in ray_session.get([rb.for_rank(r) for rb in got])] == [
            b.tolist() for b in take(local[r], 5)
        ]
    values = [v for rb in got for r in (0, 1) for v in ray_session.get(rb.for_rank(r)).tolist()]
    assert sum(v < 2000 for v in values) == 30  # 3:1 of 40, exactly (the interleave is +-1)


@pytest.mark.ray
@pytest.mark.slow
def test_errors_raised_in_the_actor_reach_the_driver_as_themselves(ray_session):
    with (
        _ray_loader(_failing, mesh={"dp": 1}, batch_size=30, on_error="raise") as loader,
        pytest.raises(SampleError, match="cannot decode sample 7"),
    ):
        take(loader, 1)
    with pytest.raises(FileNotFoundError, match="shard-00007"):
        _ray_loader(_broken, mesh={"dp": 1}, batch_size=1)


@pytest.mark.ray
@pytest.mark.slow
def test_a_failing_create_dataset_leaves_no_loader_actor_running(ray_session):
    service = RayService(num_actors=2)
    with pytest.raises(FileNotFoundError, match="shard-00007"):
        _ray_loader(_broken, mesh={"dp": 1}, service=service, batch_size=1)
    assert service._actors == []  # killed, not left holding a process per failed attempt


@pytest.mark.ray
@pytest.mark.slow
def test_a_dead_loader_actor_is_reported_by_name(ray_session):
    service = RayService(prefetch=2)
    with _ray_loader(Items, mesh={"dp": 1}, service=service, batch_size=2) as loader:
        it = iter(loader)
        next(it)
        victim = service._actors[0]
        ray_session.kill(victim)
        with pytest.raises(LoaderActorError, match=r"Ray loader actor 0 of 1 \(actor id") as err:
            list(it)
    assert victim._actor_id.hex() in str(err.value) and "max_restarts" in str(err.value)


@pytest.mark.ray
@pytest.mark.slow
def test_a_stalled_loader_actor_is_reported_after_the_timeout(ray_session):
    service = RayService(timeout=1.0)
    with _ray_loader(_stalled, mesh={"dp": 1}, service=service, batch_size=1) as loader:
        start = time.monotonic()
        with pytest.raises(LoaderActorError, match=r"actor 0 of 1 .* within timeout=1.0s"):
            take(loader, 1)
    assert time.monotonic() - start < 10


@pytest.mark.ray
@pytest.mark.slow
def test_a_restarted_loader_actor_continues_with_nothing_lost_or_duplicated(ray_session):
    mesh = {"dp": 2}
    service = RayService(actor_options={"max_restarts": 2}, prefetch=3)
    with _ray_loader(_slow_items, mesh=mesh, service=service, batch_size=3, seed=11) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(2)]  # three more steps are in flight, 0.18 s each
        ray_session.kill(service._actors[0], no_restart=False)
        got += list(it)
        assert loader.state_dict()["epoch"] == 1
        got += take(loader, 2)
    assert service.resubmitted >= 1
    assert [rb.step for rb in got] == [0, 1, 2, 3, 4, 0, 1]
    for r in range(2):
        local = DataLoader(Items(), batch_size=3, mesh=mesh, rank=r, seed=11)
        assert_same(_resolve(got, r), [_strip(b) for b in take(local, 7)])


def _items_13() -> Items:
    return Items(13)


@pytest.mark.ray
def test_a_ray_loader_resized_goes_on_as_the_in_process_loaders_do(ray_session):
    # resize() rebound the service after the loader had moved to the new layout, and the
    # service refused any other mesh: the loader was left unusable on the new one.
    kwargs = {"batch_size": 3, "seed": 0}
    with _ray_loader(Items, mesh={"dp": 4}, **kwargs) as loader:
        it = iter(loader)
        next(it)
        loader.resize({"dp": 2}, rank=0)
        got = [_resolve([b], r) for b in loader for r in range(2)]
    local = [DataLoader(Items(), mesh={"dp": 4}, rank=r, **kwargs) for r in range(4)]
    for x in local:
        next(iter(x))
    state = local[0].state_dict()
    want = []
    kwargs["batch_size"] = 6  # the global batch kept: 4 x 3 = 2 x 6
    resized = [DataLoader(Items(), mesh={"dp": 2}, rank=r, **kwargs) for r in range(2)]
    for x in resized:
        x.load_state_dict(state)
    for batches in zip(*resized, strict=True):
        want += [[_strip(b)] for b in batches]
    assert got and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


@pytest.mark.ray
def test_a_ray_loader_counts_the_padding_of_every_data_rank_it_serves(ray_session):
    # 13 samples on 4 data ranks, batch 3: the last global batch has 1 sample, so 3 ranks
    # repeat the start of the epoch; it counted none.
    kwargs = {"batch_size": 3, "seed": 0, "drop_last": False}
    with _ray_loader(_items_13, mesh={"dp": 4}, **kwargs) as loader:
        list(loader)
        padded = loader.stats()["padded"]
    local = []
    for r in range(4):
        x = DataLoader(_items_13(), mesh={"dp": 4}, rank=r, **kwargs)
        list(x)
        local.append(x.stats()["padded"])
    assert padded == sum(local) > 0


@pytest.mark.parametrize("kwargs", [{"pin_memory": True}, {"device": "cpu"}])
def test_a_ray_service_refuses_pin_memory_and_device_it_would_ignore(kwargs):
    # They were silently ignored: the loader hands out RemoteBatch references.
    with pytest.raises(ValueError, match=r"would be ignored: with service=RayService a batch"):
        DataLoader(_items_14, batch_size=2, service=RayService(), **kwargs)
