"""The mesh checks that need a process group, on 4 real gloo ranks (one run, several probes;
each test reads its probe): an explicit rank that is not the process's, ``resize()`` without a
mesh on dp x tp, torch's and torchtitan's ``DeviceMesh`` naming, and sub-meshes."""

from typing import Any

import pytest

from tests.dist_utils import run_distributed


def _error(fn: Any) -> Any:
    """``fn()``, or the message of the ``ValueError`` it raised."""
    try:
        return fn()
    except ValueError as exc:
        return f"ValueError: {exc}"


def _wrong_rank(rank: int) -> dict[str, Any]:
    from meshfeed import DataLoader

    def build(r: int | None) -> Any:
        loader = DataLoader(list(range(16)), batch_size=2, mesh={"dp": 4}, rank=r, seed=0)
        loader.shutdown()
        return loader.rank

    # rank=LOCAL_RANK of a 2-node x 2-process job; rank=0 copied from the Quick start
    return {"local": _error(lambda: build(rank % 2)), "zero": _error(lambda: build(0)),
            "own": _error(lambda: build(rank)), "default": _error(lambda: build(None))}  # fmt: skip


def _resize_without_a_mesh(rank: int) -> dict[str, Any]:
    from meshfeed import DataLoader

    loader = DataLoader(list(range(64)), batch_size=4, mesh={"dp": 2, "tp": 2}, seed=0)
    first = next(iter(loader)).tolist()
    loader.resize()  # the same 4-rank group
    after = (loader.mesh.sizes, loader.data_rank, loader.data_world_size)
    second = next(iter(loader)).tolist()
    loader.shutdown()
    return {"first": first, "after": after, "second": second}


def _device_meshes(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from meshfeed import DataLoader, DataMesh

    def first_batch(device_mesh: Any) -> Any:
        loader = DataLoader(list(range(32)), batch_size=2, device_mesh=device_mesh, seed=0)
        out = (loader.data_rank, loader.data_world_size, next(iter(loader)).tolist())
        loader.shutdown()
        return out

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    titan = init_device_mesh("cpu", (1, 2, 1, 2), mesh_dim_names=("pp", "batch", "cp", "tp"))
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    on_dp_tp = DataLoader(list(range(32)), batch_size=2, device_mesh=dp_tp, seed=0)
    out = {
        "hsdp": first_batch(hsdp),
        "titan": first_batch(titan),
        "world": _error(lambda: first_batch(world)),
        "world as data": DataMesh.from_device_mesh(world, data_axes=["world"]).data_rank(rank),
        "dp sub-mesh": _error(lambda: DataMesh.from_device_mesh(dp_tp["dp"])),
        "tp sub-mesh": _error(lambda: DataMesh.from_device_mesh(dp_tp["tp"])),
        "resize a DeviceMesh loader": _error(on_dp_tp.resize),
    }
    on_dp_tp.shutdown()
    return out


def _probes(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    out = {"wrong rank": _wrong_rank(rank)}
    dist.barrier()
    out["resize"] = _error(lambda: _resize_without_a_mesh(rank))
    dist.barrier()
    out["device meshes"] = _device_meshes(rank)
    return out


@pytest.fixture(scope="module")
def probes() -> list[dict[str, Any]]:
    return run_distributed(_probes, 4, timeout=240)


@pytest.mark.slow
def test_an_explicit_rank_that_is_not_the_process_groups_is_refused(probes):
    # It was taken: ranks 0 and 2 (rank=LOCAL_RANK) read the same data, every rank with rank=0.
    for rank, probe in enumerate(p["wrong rank"] for p in probes):
        assert probe["own"] == probe["default"] == rank
        for how, passed in (("local", rank % 2), ("zero", 0)):
            if passed == rank:
                assert probe[how] == rank
            else:
                assert probe[how].startswith(f"ValueError: rank={passed} was passed, but this ")
                assert f"process is rank {rank} of the process group" in probe[how]
                assert "not LOCAL_RANK" in probe[how]


@pytest.mark.slow
def test_resize_without_a_mesh_keeps_tensor_parallel_peers_together(probes):
    # It resolved the mesh as dp=4: tensor-parallel peers got different batches.
    resized = [p["resize"] for p in probes]
    assert [r["after"] for r in resized] == [
        ({"dp": 2, "tp": 2}, rank // 2, 2) for rank in range(4)
    ]
    for step in ("first", "second"):
        assert resized[0][step] == resized[1][step] != resized[2][step] == resized[3][step]


@pytest.mark.slow
def test_torch_and_torchtitan_device_mesh_names(probes):
    meshes = [p["device meshes"] for p in probes]
    # HSDP ("replicate", "shard") and torchtitan's "batch": the data dims, so 4 and 2 data ranks
    assert [m["hsdp"][:2] for m in meshes] == [(r, 4) for r in range(4)]
    assert len({str(m["hsdp"][2]) for m in meshes}) == 4
    assert [m["titan"][:2] for m in meshes] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # torchtitan's 1-D world mesh: refused (every rank read the same data), unless named
    for rank, m in enumerate(meshes):
        assert "dim(s) ['world']" in m["world"] and "data_axes=" in m["world"]
        assert m["world as data"] == rank


@pytest.mark.slow
def test_a_sub_mesh_says_so_with_its_ranks_and_the_world(probes):
    for rank, m in enumerate(p["device meshes"] for p in probes):
        dp_ranks = [rank % 2, rank % 2 + 2]  # world_mesh["dp"] holds this rank's dp column
        tp_ranks = [rank // 2 * 2, rank // 2 * 2 + 1]
        for key, ranks in (("dp sub-mesh", dp_ranks), ("tp sub-mesh", tp_ranks)):
            assert f"is a sub-mesh: it holds 2 rank(s) {ranks}, not each of the 4 ranks" in m[key]
            assert "pass the root mesh" in m[key]
        assert "its own rank table (it came from a DeviceMesh)" in m["resize a DeviceMesh loader"]
