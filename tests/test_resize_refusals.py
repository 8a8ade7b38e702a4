"""A refused ``resize`` changes nothing, and ``resize()`` never guesses the world.

A resize with a peer's state that the loader refuses (another run's, another dataset's, not a
state at all) left the loader on the new layout at its old position before: the caller got a
``ValueError``, and the next batches were the new layout's slices of the old position. The state
is now checked as the new layout will load it before anything moves. ``resize()`` without a mesh
while no process group is initialised took a world of one (every process read the whole global
batch); it is refused. A process group formed after a resize (or after the loader was built)
is joined at the next walk, so the ranks' agreement is checked there.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshfeed import DataLoader, StreamLoader
from meshfeed.sources.streams.stream import ShardedStream
from meshfeed.testing import take
from tests.dist_utils import run_distributed

N, G = 120, 12


def _rows(start: int, stop: int) -> Any:
    return lambda: range(start, stop)


def _loader(kind: str, *, dp: int = 2, rank: int = 0, seed: int = 4, n: int = N) -> DataLoader:
    if kind == "map":
        return DataLoader(list(range(n)), batch_size=G // dp, mesh={"dp": dp}, rank=rank, seed=seed)
    stream = ShardedStream([_rows(k, k + 20) for k in range(0, n, 20)], shuffle_buffer=8)
    return StreamLoader(stream, batch_size=G // dp, mesh={"dp": dp}, rank=rank, seed=seed)


def _bad_states(kind: str) -> dict[str, Any]:
    good = _loader(kind).state_dict()
    return {
        "another run's (seed)": _loader(kind, seed=999).state_dict(),
        "another dataset's": _loader(kind, n=N + 12).state_dict(),
        "another global batch": DataLoader(
            list(range(N)), batch_size=8, mesh={"dp": 2}, rank=0, seed=4
        ).state_dict()
        if kind == "map"
        else {**good, "global_batch_size": 24},
        "a corrupted position": {**good, "position": 10 * N},
        "not a dict": "abc",
        "another kind": {"kind": "store_loader", "version": 1},
    }


@pytest.mark.parametrize("kind", ["map", "stream"])
@pytest.mark.parametrize(
    "bad",
    [
        "another run's (seed)",
        "another dataset's",
        "another global batch",
        "a corrupted position",
        "not a dict",
        "another kind",
    ],
)
def test_a_refused_peer_state_leaves_the_loader_on_its_layout_and_iterator(kind, bad):
    state = _bad_states(kind)[bad]
    want = [b.tolist() for b in take(_loader(kind), 4)]
    loader = _loader(kind)
    it = iter(loader)
    got = [next(it).tolist(), next(it).tolist()]
    before = (loader.mesh, loader.rank, loader.data_world_size, loader.batch_size, loader.plan)
    with pytest.raises(ValueError):
        loader.resize({"dp": 4}, rank=0, state=state)
    after = (loader.mesh, loader.rank, loader.data_world_size, loader.batch_size, loader.plan)
    assert after == before and loader.position == 2 * G
    assert loader.options.batch_size == G // 2
    # Nothing moved: the live iterator goes on with the old layout's third and fourth batches.
    got += [next(it).tolist(), next(it).tolist()]
    assert got == want


def test_a_refused_peer_state_names_what_differs():
    loader = _loader("map")
    take(loader, 2)
    with pytest.raises(ValueError, match="checkpoint has seed=999 but this loader has seed=4"):
        loader.resize({"dp": 4}, rank=0, state=_loader("map", seed=999).state_dict())
    assert loader.data_world_size == 2 and loader.batch_size == G // 2


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_an_accepted_peer_state_still_moves_the_loader_to_its_position(kind):
    peer = _loader(kind, dp=2, rank=1)
    take(peer, 3)
    loader = _loader(kind, dp=2, rank=0)
    take(loader, 1)
    loader.resize({"dp": 4}, rank=0, state=peer.state_dict())
    assert (loader.data_world_size, loader.batch_size, loader.position) == (4, 3, 3 * G)
    whole = [b.tolist() for b in take(_loader(kind, dp=1), 4)]
    assert take(loader, 1)[0].tolist() == whole[3][:3]


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "2", "RANK": "1"}])
def test_resize_without_a_mesh_and_without_a_process_group_is_refused(monkeypatch, env):
    # Between destroy_process_group and init_process_group, or with a stale torchrun
    # WORLD_SIZE: the world is unknown, and a world of one made every process dp=1 rank 0.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    loader = _loader("map", rank=1)
    take(loader, 1)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as err:
        loader.resize()
    msg = str(err.value)
    assert "no process group is initialised" in msg
    assert "init_process_group" in msg and "resize(mesh, rank=...)" in msg
    assert (loader.data_world_size, loader.rank, loader.batch_size) == (2, 1, G // 2)
    assert take(loader, 1)[0].tolist() == take(_loader("map", rank=1), 2)[1].tolist()


def _resize_before_the_group(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Each rank: a loader in a group of 2; the group destroyed; resize() refused; resize with
    the mesh; a new group; rank 1 moves to another epoch. The walk must be agreed (refused)."""
    import os

    import torch.distributed as dist

    from meshfeed.services import DistributedService

    out: dict[str, Any] = {}
    loader = DataLoader(list(range(96)), batch_size=4, seed=1, timeout=30)
    out["first"] = take(loader, 1)[0].tolist()
    dist.destroy_process_group()
    os.environ.pop("WORLD_SIZE", None)  # a launcher without torchrun's env (mp.spawn, file://)
    os.environ.pop("RANK", None)
    try:
        loader.resize()
    except ValueError as exc:
        out["no_mesh"] = str(exc)
    out["after_refusal"] = (loader.data_world_size, loader.rank, loader.batch_size)
    loader.resize({"dp": 2}, rank=rank)  # the mesh given: no group needed to place it
    dist.init_process_group("gloo", init_method=f"file://{tmp}/again", rank=rank, world_size=world)
    if rank == 1:
        loader.set_epoch(1)  # the ranks now start at different places
    try:
        out["second"] = next(iter(loader)).tolist()
    except ValueError as exc:
        out["walk"] = str(exc)
    out["grouped"] = isinstance(loader.service, DistributedService)
    loader.set_epoch(1)
    out["agreed"] = next(iter(loader)).tolist()  # both at epoch 1 now: agreed, read
    loader.shutdown()
    return out


@pytest.mark.slow
def test_a_group_formed_after_a_resize_agrees_the_walk_on_gloo_ranks(tmp_path):
    results = run_distributed(_resize_before_the_group, 2, str(tmp_path), timeout=120)
    for rank, out in enumerate(results):
        assert "no process group is initialised" in out["no_mesh"]
        assert out["after_refusal"] == (2, rank, 4)  # the refused resize() moved nothing
        # Resized before the new group: its first walk is still agreed, and refused.
        assert "second" not in out, f"rank {rank} read {out['second']} unchecked"
        assert "start this iteration at different places" in out["walk"]
        assert out["grouped"]
    one = DataLoader(list(range(96)), batch_size=8, mesh={"dp": 1}, rank=0, seed=1)
    one.set_epoch(1)
    assert results[0]["agreed"] + results[1]["agreed"] == next(iter(one)).tolist()
