"""Meshes that made ranks read the wrong data without an error, and the checks that refuse them
(one process; the process-group checks run on real gloo ranks in test_mesh_checks_dist.py)."""

import math

import numpy as np
import pytest
import torch

from meshfeed import DataLoader, DataMesh
from meshfeed.launch import run_distributed
from meshfeed.mesh import place


class FakeDeviceMesh:
    """What ``DataMesh.from_device_mesh`` reads of a ``DeviceMesh``: its dim names and table."""

    def __init__(self, names: tuple[str, ...], table: list) -> None:
        self.mesh_dim_names = names
        self.mesh = torch.tensor(table)


def _data_ranks(mesh: DataMesh) -> list[int]:
    return [mesh.data_rank(r) for r in range(mesh.world_size)]


@pytest.fixture
def no_torchrun(monkeypatch):
    """A single-process simulation: no torchrun environment."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


# ----------------------------------------------------------------- DeviceMesh dim names
@pytest.mark.parametrize(
    ("names", "table", "unknown"),
    [
        (("world",), [0, 1, 2, 3], "['world']"),  # torchtitan's 1-D world mesh
        (("dp", "mp"), [[0, 1], [2, 3]], "['mp']"),
        (("pp", "dp_shard_cp", "tp"), [[[0, 1], [2, 3]]], "['dp_shard_cp']"),
    ],
)
def test_a_device_mesh_dim_meshfeed_does_not_know_is_refused(names, table, unknown):
    # It replicated the data: every rank of a ("world",) mesh read the same samples.
    with pytest.raises(ValueError, match="data_axes=") as error:
        DataMesh.from_device_mesh(FakeDeviceMesh(names, table))
    assert f"dim(s) {unknown}" in str(error.value)
    assert "rename the dims" in str(error.value)


def test_a_dim_named_in_data_axes_shards_data():
    mesh = DataMesh.from_device_mesh(FakeDeviceMesh(("world",), [0, 1, 2, 3]), data_axes=["world"])
    assert _data_ranks(mesh) == [0, 1, 2, 3]


def test_with_data_axes_named_every_other_dim_replicates():
    # veRL's Ulysses mesh ("dp", "sp"): sequence-parallel peers read the same samples (it was
    # refused even with data_axes=["dp"], and the message proposed data_axes=["dp", "sp"])
    mesh = DataMesh.from_device_mesh(
        FakeDeviceMesh(("dp", "sp"), [[0, 1], [2, 3], [4, 5], [6, 7]]), data_axes=["dp"]
    )
    assert _data_ranks(mesh) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="name the dims that shard data") as error:
        DataMesh.from_device_mesh(FakeDeviceMesh(("dp", "sp"), [[0, 1], [2, 3]]))
    assert "every other dim then replicates" in str(error.value)
    assert "data_axes=['dp', 'sp']" not in str(error.value)


def test_a_resize_to_a_mesh_between_two_process_groups_ignores_the_stale_world_size(monkeypatch):
    # resize() without a mesh, between destroy_process_group and init_process_group, says to
    # pass the mesh; torchrun's WORLD_SIZE still names the old world, and refused that too.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    loader = DataLoader(list(range(96)), batch_size=2, mesh={"dp": 4}, rank=0)
    next(iter(loader))
    with pytest.raises(ValueError, match=r"resize\(mesh, rank=\.\.\.\)"):
        loader.resize()
    loader.resize({"dp": 2}, rank=0)
    assert loader.data_world_size == 2 and len(next(iter(loader))) == 4


@pytest.mark.parametrize(
    ("names", "table", "want"),
    [
        # torch's HSDP naming: both dims are data parallel
        (("replicate", "shard"), [[0, 1], [2, 3]], [0, 1, 2, 3]),
        # torchtitan's data-loading mesh: "batch" is dp_replicate x dp_shard
        (
            ("pp", "batch", "cp", "tp"),
            np.arange(8).reshape(1, 4, 1, 2).tolist(),
            [0, 0, 1, 1, 2, 2, 3, 3],
        ),
        (
            ("pp", "batch", "cp", "tp"),
            np.arange(8).reshape(1, 2, 2, 2).tolist(),
            [0, 0, 0, 0, 1, 1, 1, 1],
        ),
    ],
)
def test_hsdp_and_torchtitan_data_dims_shard_data(names, table, want):
    assert _data_ranks(DataMesh.from_device_mesh(FakeDeviceMesh(names, table))) == want


def test_a_sub_mesh_is_named_with_its_ranks(no_torchrun):
    # world_mesh["dp"] of a dp=2 x tp=2 mesh, on rank 0
    with pytest.raises(ValueError, match=r"is a sub-mesh: it holds 2 rank\(s\) \[0, 2\]") as error:
        DataMesh.from_device_mesh(FakeDeviceMesh(("dp",), [0, 2]))
    assert "pass the root mesh" in str(error.value)
    big = FakeDeviceMesh(("dp",), list(range(1, 41)))
    with pytest.raises(ValueError, match=r"40 rank\(s\) \[1, 2, .*, 16, \.\.\.\]"):
        DataMesh.from_device_mesh(big)


# ----------------------------------------------------------------- expert parallel
#: Megatron-LM's data ranks (``get_data_parallel_rank()``: the position in the dense "dp" group
#: of ``RankGenerator``, default order tp-cp-ep-dp-pp, dense dp = world / (tp * cp * pp)), for
#: every global rank, from ``generate_masked_orthogonal_rank_groups`` of megatron/core/
#: parallel_state.py. With expert parallel, the expert generator splits the dense dp into
#: ep x expert-dp, ep innermost: ``{"dp": expert_dp, "ep": ep}`` here.
MEGATRON_DATA_RANKS = [
    ({"tp": 2, "cp": 2, "pp": 2, "dp": 2}, [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]),
    ({"tp": 2, "cp": 1, "pp": 2, "dp": 3}, [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]),
    ({"tp": 1, "cp": 2, "pp": 1, "dp": 3}, [0, 0, 1, 1, 2, 2]),
    ({"tp": 1, "pp": 1, "ep": 2, "dp": 2}, [0, 1, 2, 3]),
    ({"tp": 1, "pp": 1, "ep": 4, "dp": 2}, [0, 1, 2, 3, 4, 5, 6, 7]),
    ({"tp": 2, "pp": 1, "ep": 2, "dp": 2}, [0, 0, 1, 1, 2, 2, 3, 3]),
    ({"tp": 1, "pp": 2, "ep": 2, "dp": 1}, [0, 1, 0, 1]),
    ({"tp": 2, "pp": 2, "ep": 2, "dp": 2}, [0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3]),
]


@pytest.mark.parametrize(("sizes", "megatron"), MEGATRON_DATA_RANKS)
def test_data_ranks_are_megatrons_with_expert_parallel_a_data_axis(sizes, megatron):
    # ep replicated the data: from_sizes(dp=2, ep=4) had 2 data ranks where Megatron has 8.
    mesh = DataMesh.from_sizes(**sizes)
    assert _data_ranks(mesh) == megatron
    assert mesh.data_world_size == len(set(megatron))
    if "ep" in sizes:  # the same data ranks as the dense layout, dp = world / (tp * cp * pp)
        dense = {**sizes, "dp": sizes["dp"] * sizes["ep"]}
        del dense["ep"]
        assert _data_ranks(DataMesh.from_sizes(**dense)) == megatron


def test_expert_parallel_ranks_read_different_data(no_torchrun):
    mesh = DataMesh.from_sizes(dp=2, ep=4)
    assert mesh.data_world_size == 8
    seen = [
        {int(x) for b in DataLoader(list(range(64)), batch_size=2, mesh=mesh, rank=r) for x in b}
        for r in range(8)
    ]
    assert set().union(*seen) == set(range(64)) and sum(map(len, seen)) == 64


# ----------------------------------------------------------------- resize() without a mesh
def _group_formed(monkeypatch, world: int) -> None:
    """All ranks simulated in this process, as if a process group of ``world`` ranks had
    formed again: resize() reads its world (here torchrun's WORLD_SIZE); the real group is in
    tests/test_mesh_checks_dist.py."""
    monkeypatch.setattr("meshfeed.loader_base.is_initialized", lambda: True)
    monkeypatch.setattr("meshfeed.loader_base.world_size_now", lambda: world)


def test_resize_without_a_mesh_keeps_tensor_parallel_and_rescales_dp(monkeypatch):
    # It became from_sizes(dp=world): dp=2 x tp=2 turned into dp=4, tp peers got different data.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    mesh = {"dp": 2, "tp": 2}
    loaders = [DataLoader(list(range(96)), batch_size=4, mesh=mesh, rank=r) for r in range(4)]
    for loader in loaders:
        next(iter(loader))
    _group_formed(monkeypatch, 4)
    for r, loader in enumerate(loaders):  # the same world again
        loader.resize(rank=r)
        assert loader.mesh.sizes == {"dp": 2, "tp": 2}
    batches = [next(iter(loader)).tolist() for loader in loaders]
    assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2]
    _group_formed(monkeypatch, 8)  # twice the ranks: dp doubles, tp stays
    for r, loader in enumerate(loaders):
        loader.resize(rank=r)
        assert (loader.mesh.sizes, loader.data_world_size) == ({"dp": 4, "tp": 2}, 4)


def test_rescaled_keeps_the_order_the_data_axes_and_ulysses():
    mesh = DataMesh.from_sizes(order=["tp", "fsdp"], tp=2, fsdp=4, ulysses=2)
    assert mesh.rescaled(16).sizes == {"tp": 2, "fsdp": 8}
    assert mesh.rescaled(16).ulysses == 2 and mesh.rescaled(16).data_axes == mesh.data_axes
    assert DataMesh.from_sizes(pp=2, dp=3, cp=2, tp=2).rescaled(40).sizes == {
        "pp": 2,
        "dp": 5,
        "cp": 2,
        "tp": 2,
    }


@pytest.mark.parametrize(
    ("mesh", "world", "match"),
    [
        (DataMesh.from_sizes(dp=2, tp=4), 6, r"6 ranks is not divisible by 4.*\{'tp': 4\}"),
        (DataMesh.from_sizes(dp_replicate=2, dp_shard=2), 8, r"2 data axes \['dp_replicate'"),
        (DataMesh.from_sizes(tp=4, data_axes=[]), 8, r"0 data axes \[\]"),
        (
            DataMesh.from_device_mesh(FakeDeviceMesh(("dp", "tp"), [[0, 1], [2, 3]])),
            8,
            "its own rank table",
        ),
    ],
)
def test_resize_without_a_mesh_asks_for_one_where_the_layout_is_not_one(
    monkeypatch, mesh, world, match
):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(mesh.world_size))
    loader = DataLoader(list(range(96)), batch_size=2, mesh=mesh, rank=0)
    _group_formed(monkeypatch, world)
    with pytest.raises(ValueError, match=match) as error:
        loader.resize(rank=0)
    assert "loader.resize(mesh)" in str(error.value)
    assert loader.mesh is mesh  # nothing moved


# ----------------------------------------------------------------- torchrun's WORLD_SIZE
@pytest.mark.parametrize("rank_env", [None, "1"])
def test_a_mesh_of_another_world_than_torchruns_is_refused(monkeypatch, rank_env):
    # dp=4 on 2 torchrun processes read half of every epoch, without an error.
    monkeypatch.setenv("WORLD_SIZE", "2")
    if rank_env is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank_env)
    with pytest.raises(ValueError, match=r"world size 4 but torchrun's WORLD_SIZE=2 says the job"):
        DataLoader(list(range(40)), batch_size=4, mesh={"dp": 4}, rank=1)
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        place({"dp": 2, "tp": 2}, None, 0)
    assert place({"dp": 2}, None, 1)[1] == 1  # the job's world: fine


def test_a_simulation_without_torchrun_or_of_one_process_is_not_checked(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert place({"dp": 4}, None, 3)[1] == 3
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert place({"dp": 4}, None, 3)[1] == 3
    monkeypatch.setenv("WORLD_SIZE", "2")  # a process serving every rank is not one of them
    assert place({"dp": 4}, None, None, serves_every_rank=True)[1] == 0


# ----------------------------------------------------------------- from_env sizes
@pytest.mark.parametrize("tp", [0, -2, True, 2.0, 2.5, "2", None])
def test_from_env_checks_each_size_before_dividing_the_world(tp):
    # tp=0 was a bare ZeroDivisionError, tp=-2 blamed 'dp', tp=True and tp=2.0 were taken,
    # tp="2" a raw TypeError.
    with pytest.raises(ValueError, match=rf"axis 'tp' has size {tp!r}; sizes must be integers"):
        DataMesh.from_env(env={"WORLD_SIZE": "8"}, tp=tp)


def test_from_env_names_an_unknown_axis_before_dividing():
    with pytest.raises(ValueError, match=r"unknown mesh axis \['xp'\].*from_sizes\(order="):
        DataMesh.from_env(env={"WORLD_SIZE": "5"}, xp=2)
    assert DataMesh.from_env(env={"WORLD_SIZE": "8"}, tp=np.int64(2)).sizes == {"dp": 4, "tp": 2}


# ----------------------------------------------------------------- strings for lists
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"order": "tp-dp", "tp": 2, "dp": 2}, r"order='tp-dp' is a string.*order=\['dp', 'tp'\]"),
        ({"order": "dp", "dp": 2}, r"order='dp' is a string; pass a list of axis names, outermost"),
        ({"data_axes": "dp", "dp": 2, "tp": 2}, r"data_axes='dp' is a string.*data_axes=\['dp'\]"),
        ({"data_axes": "cp", "dp": 2, "cp": 2}, r"data_axes='cp' is a string"),
    ],
)
def test_a_string_for_a_list_of_axes_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataMesh.from_sizes(**kwargs)


def test_a_string_of_data_axes_is_refused_by_every_constructor():
    with pytest.raises(ValueError, match="data_axes='dp' is a string"):
        DataMesh.from_device_mesh(FakeDeviceMesh(("dp",), [0, 1]), data_axes="dp")
    with pytest.raises(ValueError, match="data_axes='dp' is a string"):
        DataMesh(axis_names=("dp",), axis_sizes=(2,), data_axes="dp")


# ----------------------------------------------------------------- run_distributed timeout
def _returns(rank: int, world: int) -> int:
    return rank


@pytest.mark.parametrize(
    ("timeout", "error", "match"),
    [
        (math.nan, ValueError, "timeout=nan"),  # never fired: a hung fn hung the caller
        (-5.0, ValueError, "timeout=-5.0"),  # "did not finish within -5.0s"
        (0, ValueError, "timeout=0"),
        ("5", TypeError, "timeout must be seconds as a number"),
        (True, TypeError, "timeout must be seconds as a number"),
    ],
)
def test_run_distributed_checks_its_timeout_before_starting(timeout, error, match):
    with pytest.raises(error, match=match):
        run_distributed(_returns, 1, timeout=timeout)
