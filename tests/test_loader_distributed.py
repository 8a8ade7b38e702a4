"""Real processes joined by gloo: the loader's distributed guarantees hold across processes."""

import pytest
import torch
import torch.distributed as dist

from meshfeed import DataLoader, DataMesh
from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.testing import take
from tests.dist_utils import run_distributed


class Items:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


def _consume(rank, world, n, batch, sizes, num_workers):
    mesh = DataMesh.from_sizes(world_size=world, **sizes)
    loader = DataLoader(Items(n), batch_size=batch, mesh=mesh, num_workers=num_workers, seed=3)
    assert loader.rank == rank  # the default rank comes from the process group
    out = [b.view(-1).tolist() for b in loader]
    # mid-run checkpoint and resume in the same process
    loader.set_epoch(1)
    first = take(loader, 2)
    state = loader.state_dict()
    rest = take(loader, 3)
    again = DataLoader(Items(n), batch_size=batch, mesh=mesh, seed=3)
    again.load_state_dict(state)
    resumed = take(again, 3)
    loader.shutdown()
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    from_device_mesh = DataMesh.from_device_mesh(device_mesh)
    steps = torch.tensor([len(out)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return {
        "epoch0": out,
        "max_steps": int(steps),
        "data_rank": mesh.data_rank(rank),
        "resume_ok": all(torch.equal(a, b) for a, b in zip(rest, resumed, strict=True)),
        "first": [b.view(-1).tolist() for b in first],
        "device_mesh_agrees": from_device_mesh.data_rank(rank) == mesh.data_rank(rank)
        and from_device_mesh.replica_group(rank) == mesh.replica_group(rank),
    }


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_four_processes_exact_shards_replicas_and_equal_steps(num_workers):
    n, batch, sizes = 45, 3, {"dp": 2, "tp": 2}
    results = run_distributed(_consume, 4, n, batch, sizes, num_workers)
    assert all(r["resume_ok"] for r in results)
    assert all(r["device_mesh_agrees"] for r in results)  # a real DeviceMesh maps the same
    steps = {len(r["epoch0"]) for r in results}
    assert steps == {results[0]["max_steps"]} == {n // (batch * 2)}
    assert results[0]["epoch0"] == results[1]["epoch0"]  # tp peers
    assert results[2]["epoch0"] == results[3]["epoch0"]
    union = [i for r in (results[0], results[2]) for b in r["epoch0"] for i in b]
    assert len(union) == len(set(union)) == (n // 6) * 6
    # every process computed what a single-process simulation of its rank computes
    mesh = DataMesh.from_sizes(**sizes)
    for rank, r in enumerate(results):
        sim = DataLoader(Items(n), batch_size=batch, mesh=mesh, rank=rank, seed=3)
        assert [b.view(-1).tolist() for b in sim] == r["epoch0"]


def _misconfigurations(rank, world):
    messages = []
    loader = DataLoader(Items(40), batch_size=2, mesh={"dp": world}, seed=rank % 2)
    try:
        next(iter(loader))
        messages.append("no error")
    except ValueError as exc:
        messages.append(str(exc))
    for build in (
        lambda: DataLoader(Items(40), batch_size=2, mesh={"dp": 2}),
        lambda: StoreLoader(
            SampleStore(), task="t", fields=["x"], partition="p", batch_size=2, mesh={"dp": 2}
        ),
    ):
        try:
            build()
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.slow
def test_misconfigured_ranks_fail_clearly_instead_of_hanging():
    for seed_msg, world_msg, store_msg in run_distributed(_misconfigurations, 4):
        assert "data loaders disagree on seed: rank i holds [0, 1, 0, 1]" in seed_msg
        assert "has world size 2 but the process group has 4 ranks" in world_msg
        assert "has world size 2 but the process group has 4 ranks" in store_msg


def _walk_starts(rank, world):
    """Each way ranks can come to start a walk at different places, then the way they agree."""

    def loader():
        return DataLoader(Items(32), batch_size=2, seed=0, timeout=30)

    out = {}
    for mode in ("load", "epoch", "iterated"):
        ld = loader()
        if mode == "load" and rank == 0:  # only rank 0 restores a checkpoint taken at step 3
            ld.load_state_dict({**ld.state_dict(), "position": 12})
        if mode == "epoch" and rank == 0:  # only rank 0 moves on
            ld.set_epoch(1)
        if mode == "iterated":  # agreed at the first walk; then only rank 1 goes back
            list(ld)
            if rank == 1:
                ld.set_epoch(0, allow_rewind=True)
        try:
            out[mode] = f"{len(list(ld))} steps"
        except ValueError as exc:
            out[mode] = str(exc)
    ld = loader()  # every rank does the same: agreed, at every walk start
    state = {**ld.state_dict(), "position": 12}
    ld.load_state_dict(state)
    steps = [len(list(ld))]
    ld.set_epoch(3)
    steps.append(len(list(ld)))
    out["agreed"] = steps
    return out


def test_ranks_that_start_a_walk_at_different_places_fail_clearly_on_every_rank():
    results = run_distributed(_walk_starts, 2)
    for r in results:
        assert "rank 0: epoch=0 position=12, rank 1: epoch=0 position=0" in r["load"]
        assert "they differ in position" in r["load"]
        assert "rank 0: epoch=1 position=0, rank 1: epoch=0 position=0" in r["epoch"]
        assert "load_state_dict with the same checkpoint on every rank" in r["epoch"]
        assert "rank 0: epoch=1 position=0, rank 1: epoch=0 position=0" in r["iterated"]
        assert r["agreed"] == [5, 8]  # (32 - 12) // 4 and a whole epoch of 32 // 4


def _meshes(rank: int, world: int) -> str:
    """Rank 0 on dp=2, rank 1 on dp=1 x tp=2: one world, one global batch, other meshes."""
    mesh = {"dp": 2} if rank == 0 else {"dp": 1, "tp": 2}
    loader = DataLoader(Items(32), batch_size=4 if rank == 0 else 8, mesh=mesh, seed=0, timeout=30)
    try:
        return f"{len(list(loader))} steps"
    except ValueError as exc:
        return str(exc)


def test_ranks_built_with_different_meshes_fail_clearly_on_every_rank():
    # The plan's agreement named the global batch, not the mesh: rank 0 read samples 0-3
    # as data rank 0 of 2, and rank 1 read 0-7 as the one data rank, silently.
    for message in run_distributed(_meshes, 2):
        assert "built with different meshes" in message
        assert "data-parallel sizes by rank: [2, 1]" in message
