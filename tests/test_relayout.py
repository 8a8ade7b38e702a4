"""Live resizing (#32): a loader moves to a new data-parallel layout between global batches,
every sample once, the same global batches as without the change."""

from __future__ import annotations

from typing import Any

import pytest

from meshfeed import DataLoader, StreamLoader
from meshfeed.sources.streams.stream import ShardedStream
from meshfeed.testing import take
from tests.dist_utils import run_distributed

N, G = 120, 12  # 10 global batches of 12: divisible among 4 and 3 data ranks


def _rows(start: int, stop: int) -> Any:
    return lambda: range(start, stop)


def _dataset(kind: str) -> Any:
    if kind == "map":
        return list(range(N))
    return ShardedStream([_rows(k, k + 20) for k in range(0, N, 20)], shuffle_buffer=8)


def _loader(kind: str, dp: int, rank: int, **kw: Any) -> DataLoader:
    door = DataLoader if kind == "map" else StreamLoader
    return door(_dataset(kind), batch_size=G // dp, mesh={"dp": dp}, rank=rank, seed=4, **kw)


def _global_batches(kind: str, steps: int) -> list[list[int]]:
    return [b.tolist() for b in take(_loader(kind, 1, 0), steps)]


def _phase(loaders: list[DataLoader], steps: int) -> list[list[int]]:
    """``steps`` global batches made of every data rank's batch, in rank order."""
    per_rank = [take(ld, steps) for ld in loaders]
    return [sum((per_rank[r][s].tolist() for r in range(len(loaders))), []) for s in range(steps)]


@pytest.mark.parametrize("kind", ["map", "stream"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_dp_4_to_3_to_4_mid_epoch_serves_every_sample_once(kind, num_workers):
    loaders = [_loader(kind, 4, r, num_workers=num_workers) for r in range(4)]
    got = _phase(loaders, 3)
    for r in range(3):  # rank 3's replica group leaves
        loaders[r].resize({"dp": 3}, rank=r)
    assert loaders[0].batch_size == 4 and loaders[0].global_batch_size == G
    got += _phase(loaders[:3], 3)
    state = loaders[0].state_dict()
    for r in range(4):  # it comes back, and takes the position from a peer
        loaders[r].resize({"dp": 4}, rank=r, state=state if r == 3 else None)
    got += _phase(loaders, 4)
    for ld in loaders:
        ld.shutdown()
    assert got == _global_batches(kind, 10)  # the same global batches as one rank of all
    assert sorted(x for b in got for x in b) == list(range(N))  # every sample exactly once


def test_an_iterator_taken_before_a_resize_refuses_to_go_on():
    loader = _loader("map", 2, 0)
    it = iter(loader)
    next(it)
    loader.resize({"dp": 3}, rank=0)
    with pytest.raises(RuntimeError, match="resized after this iterator was taken"):
        next(it)
    assert next(iter(loader)).tolist() == _global_batches("map", 2)[1][:4]


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_layout_the_global_batch_does_not_divide_is_refused_by_name(kind):
    loader = _loader(kind, 4, 0)
    take(loader, 1)
    with pytest.raises(ValueError, match=r"global batch of 12 samples does not divide among 5"):
        loader.resize({"dp": 5}, rank=0)
    assert loader.batch_size == 3
    assert take(loader, 1)[0].tolist() == _global_batches(kind, 2)[1][:3]


def test_a_resized_loader_resumes_exactly_on_the_new_layout():
    loader = _loader("map", 4, 1)
    take(loader, 2)
    loader.resize({"dp": 2, "tp": 2}, rank=2)  # data rank 1 of 2
    assert loader.state_dict()["data_world_size"] == 2
    fresh = _loader("map", 2, 1)
    fresh.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in take(loader, 3)] == [b.tolist() for b in take(fresh, 3)]


def _gloo_resize(rank: int, world: int, tmp: str) -> list[list[int]]:
    """dp 4 -> 3 -> 4 on real gloo ranks: a new process group per layout, one loader object."""
    import torch.distributed as dist

    loader = DataLoader(list(range(N)), batch_size=G // world, seed=4, timeout=60)
    got = [b.tolist() for b in take(loader, 3)]
    state: list[Any] = [None]
    dist.destroy_process_group()
    if rank < 3:  # rank 3's replica group leaves; the others go on without a restart
        dist.init_process_group("gloo", init_method=f"file://{tmp}/three", rank=rank, world_size=3)
        loader.resize()  # the new process group's layout
        got += [b.tolist() for b in take(loader, 3)]
        state = [loader.state_dict()]
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/four", rank=rank, world_size=4)
    dist.broadcast_object_list(state, src=0)  # the rank that rejoins takes the position
    loader.resize(state=state[0] if rank == 3 else None)
    got += [b.tolist() for b in take(loader, 4)]
    loader.shutdown()
    return got


@pytest.mark.slow
def test_dp_4_to_3_to_4_on_gloo_ranks_without_a_restart(tmp_path):
    per_rank = run_distributed(_gloo_resize, 4, str(tmp_path), timeout=240)
    want = _global_batches("map", 10)
    got = []
    for s in range(3):
        got.append(sum((per_rank[r][s] for r in range(4)), []))
    for s in range(3, 6):
        got.append(sum((per_rank[r][s] for r in range(3)), []))
    for s in range(6, 10):
        got.append(sum((per_rank[r][s - 3 if r == 3 else s] for r in range(4)), []))
    assert got == want
    assert sorted(x for b in got for x in b) == list(range(N))


def _store_loaders(store: Any, dp: int, prefetch: int) -> list[Any]:
    from meshfeed.queue import StoreLoader

    return [
        StoreLoader(
            store,
            task="t",
            fields=["x"],
            partition="p",
            batch_size=G // dp,
            mesh={"dp": dp},
            rank=r,
            prefetch=prefetch,
            timeout=20,
        )
        for r in range(dp)
    ]


def _store_phase(loaders: list[Any], steps: int) -> list[list[int]]:
    return [sum((list(next(ld).ids) for ld in loaders), []) for _ in range(steps)]


def test_the_store_door_resizes_4_to_3_to_4_through_its_elastic_resume():
    from meshfeed.queue import SampleStore

    store = SampleStore()
    store.put("p", {"x": list(range(N))})
    store.close("p")
    ahead = _store_loaders(store, 1, 2)[0]
    with pytest.raises(ValueError, match="prefetch=2: batches fetched ahead"):
        ahead.resize({"dp": 2}, rank=0)
    loaders = _store_loaders(store, 4, 1)
    got = _store_phase(loaders, 3)
    loaders[3].shutdown()  # its replica group leaves
    for r in range(3):
        loaders[r].resize({"dp": 3}, rank=r)
    assert loaders[0].batch_size == 4
    got += _store_phase(loaders[:3], 3)
    with pytest.raises(ValueError, match="global batch of 12 samples does not divide among 5"):
        loaders[0].resize({"dp": 5}, rank=0)  # refused before anything changes
    state = loaders[0].state_dict()
    for r in range(4):
        loaders[r].resize({"dp": 4}, rank=r, state=state if r == 3 else None)
    got += _store_phase(loaders, 4)
    assert all(next(ld, None) is None for ld in loaders)
    for ld in loaders:
        ld.shutdown()
    assert [len(b) for b in got] == [G] * 10
    assert sorted(x for b in got for x in b) == list(range(N))  # every sample exactly once


def _epoch_steps(loaders: list[DataLoader]) -> list[list[int]]:
    """The global batches left in the loaders' epoch (every rank's batch, in rank order)."""
    per_rank = [[batch.tolist() for batch in ld] for ld in loaders]
    assert len({len(steps) for steps in per_rank}) == 1, "ranks took unequal steps"
    return [sum(step, []) for step in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("kind", ["map", "stream"])
@pytest.mark.parametrize("how", ["load_state_dict", "resize"])
def test_pad_last_false_an_epoch_over_on_3_ranks_stays_over_on_2(kind, how):
    """pad_last=False truncates the last batch to the data ranks: 114 = 9 x 12 + 6, so the
    last batch on 4 ranks serves 4 of 6 (2 left out). A state taken after it, resumed or
    resized to 2 ranks, served the 2 left out as one more step of the epoch."""
    door = DataLoader if kind == "map" else StreamLoader
    data = list(range(114)) if kind == "map" else ShardedStream([_rows(0, 114)], shuffle_buffer=8)

    def loaders(dp: int) -> list[DataLoader]:
        return [
            door(data, batch_size=G // dp, mesh={"dp": dp}, rank=r, seed=4, drop_last=False,
                 pad_last=False)
            for r in range(dp)
        ]  # fmt: skip

    four = loaders(4)
    its = [iter(ld) for ld in four]  # the epoch's steps, the state taken after the last one
    epoch = [sum([next(it).tolist() for it in its], []) for _ in range(len(four[0]))]
    assert len(epoch) == 10 and len(epoch[-1]) == 4  # 2 of the last 6 left out
    assert four[0].state_dict()["epoch"] == 0
    if how == "load_state_dict":
        two = loaders(2)
        for ld in two:
            ld.load_state_dict(four[0].state_dict())
    else:
        two = four[:2]
        for r, ld in enumerate(two):
            ld.resize({"dp": 2}, rank=r)
    # the rest of epoch 0 is empty, as in the uninterrupted run (the 2 samples its last batch
    # left out are no step); then epoch 1, whole (its last batch of 6 divides among 2 ranks)
    assert _epoch_steps(two) == []
    assert [len(step) for step in _epoch_steps(two)] == [12] * 9 + [6]


def test_a_huge_global_batch_in_a_state_is_refused_at_once():
    """The error's list of data-parallel sizes that divide it walked every number up to the
    value (2**70 + 1: it never returned)."""
    state = DataLoader(list(range(8)), batch_size=2, mesh={"dp": 2}, rank=0).state_dict()
    state["global_batch_size"] = 2**70 + 1
    loader = DataLoader(list(range(8)), batch_size=2, mesh={"dp": 2}, rank=0)
    with pytest.raises(ValueError, match=r"does not divide among this loader's 2 data ranks"):
        loader.load_state_dict(state)


def test_a_ramped_state_loads_on_another_size_with_another_ramp_as_before():
    """The epoch-end check built the checkpoint's plan with this loader's ramp over the old
    data ranks, which a ramp may refuse: a state that loaded before was refused."""
    from meshfeed.order.rampup import BatchRampup

    old = DataLoader(list(range(1000)), batch_size=4, mesh={"dp": 4}, rank=0,
                     rampup=BatchRampup(start=4, increment=4, samples=64))  # fmt: skip
    take(old, 2)
    state = old.state_dict()
    new = DataLoader(list(range(1000)), batch_size=3, mesh={"dp": 2}, rank=0,
                     rampup=BatchRampup(start=2, increment=2, samples=64))  # fmt: skip
    new.load_state_dict(state, allow_global_batch_change=True)
    assert new.state_dict()["position"] == state["position"] == 8
