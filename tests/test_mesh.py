import numpy as np
import pytest

from meshfeed import DataLoader, DataMesh
from meshfeed.mesh import default_rank


def test_from_sizes_tp_innermost_and_replica_groups():
    mesh = DataMesh.from_sizes(dp=2, tp=2)
    assert mesh.world_size == 4 and mesh.data_world_size == 2
    assert [mesh.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert mesh.replica_group(1) == [0, 1]
    assert mesh.coords(3) == {"dp": 1, "tp": 1}


def test_full_mesh_data_ranks_ignore_replicating_axes():
    mesh = DataMesh.from_sizes(pp=2, dp=2, fsdp=2, cp=2, tp=2)
    assert mesh.world_size == 32 and mesh.data_world_size == 4
    groups = mesh.replica_groups()
    assert sorted(r for g in groups for r in g) == list(range(32))
    for d, group in enumerate(groups):
        assert len(group) == 8
        for r in group:
            c = mesh.coords(r)
            assert c["dp"] * 2 + c["fsdp"] == d


def test_overridden_data_axes_and_order():
    mesh = DataMesh.from_sizes(order=["tp", "dp"], tp=2, dp=3, data_axes=["dp", "tp"])
    assert mesh.data_world_size == 6
    assert [mesh.data_rank(r) for r in range(6)] == list(range(6))


def test_ulysses_folds_consecutive_data_ranks():
    mesh = DataMesh.from_sizes(dp=8, ulysses=4)
    assert mesh.data_world_size == 2
    assert [mesh.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert mesh.replica_group(5) == [4, 5, 6, 7]


def test_from_env_pure_data_parallel_and_with_tp():
    assert DataMesh.from_env(env={"WORLD_SIZE": "6"}).data_world_size == 6
    mesh = DataMesh.from_env(env={"WORLD_SIZE": "8"}, tp=2)
    assert mesh.sizes == {"dp": 4, "tp": 2}


def test_from_device_mesh_uses_names_and_layout():
    class FakeDeviceMesh:
        mesh_dim_names = ("dp", "tp")

        class mesh:
            @staticmethod
            def cpu():
                import torch

                return torch.tensor([[0, 2], [1, 3]])

    mesh = DataMesh.from_device_mesh(FakeDeviceMesh())
    # rank 2 sits at dp=0, tp=1: it shares data with rank 0
    assert mesh.replica_group(2) == [0, 2]
    assert mesh.data_rank(1) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp": 2, "tp": 2, "world_size": 8}, "multiply to 4, but the world size is 8"),
        ({"dp": 2, "xp": 2}, "unknown mesh axis"),
        ({"dp": 6, "ulysses": 4}, "ulysses=4 must be a positive divisor"),
        ({"dp": 0}, "sizes must be integers >= 1"),
        ({"dp": True}, "axis 'dp' has size True"),
        ({"dp": 4, "ulysses": True}, "ulysses=True must be a positive divisor"),
        ({"dp": 10**8}, r"100000000 ranks, more than meshfeed plans \(MAX_WORLD_SIZE = 2\*\*24"),
        ({"dp": 2**23, "tp": 4}, "33554432 ranks"),
        ({"dp": 2**40, "tp": 2**40}, "ranks, more than meshfeed plans"),
    ],
)
def test_invalid_meshes_name_the_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataMesh.from_sizes(**kwargs)


def test_rank_out_of_range_is_rejected():
    mesh = DataMesh.from_sizes(dp=2)
    with pytest.raises(ValueError, match="rank=2 is out of range"):
        mesh.data_rank(2)
    with pytest.raises(ValueError, match="rank=-1"):
        mesh.coords(-1)


@pytest.mark.parametrize("rank", [True, 1.0, "1", None])
def test_a_rank_that_is_not_an_int_is_refused_by_type(rank):
    # rank=True was taken as rank 1, and rank=1.0 was called "out of range".
    mesh = DataMesh.from_sizes(dp=2)
    with pytest.raises(TypeError, match=rf"rank must be an int in \[0, 2\) \(got rank={rank!r}"):
        mesh.data_rank(rank)


def test_env_world_not_divisible():
    with pytest.raises(ValueError, match="WORLD_SIZE=6 is not divisible"):
        DataMesh.from_env(env={"WORLD_SIZE": "6"}, tp=4)


def test_ranks_array_must_cover_world():
    with pytest.raises(ValueError, match="each of the global ranks"):
        DataMesh(axis_names=("dp",), axis_sizes=(2,), ranks=np.array([0, 0]))


# ----------------------------------------------------------------- default rank (issue 11.1)


def test_default_rank_reads_rank_from_the_environment():
    assert default_rank(env={"RANK": "3", "WORLD_SIZE": "4"}) == 3
    assert default_rank(env={}) == 0
    assert default_rank(1, env={}) == 0


@pytest.mark.parametrize(
    ("world", "env", "source"),
    [(None, {"WORLD_SIZE": "2"}, "from WORLD_SIZE"), (4, {}, "from the mesh")],
)
def test_default_rank_refuses_to_guess_in_a_larger_world(world, env, source):
    with pytest.raises(ValueError, match=f"cannot tell this process's rank.*{source}.*torchrun"):
        default_rank(world, env=env)


@pytest.mark.parametrize(
    ("env", "match"), [({"RANK": "one"}, "RANK='one'"), ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'")]
)
def test_bad_rank_environment_is_named(env, match):
    with pytest.raises(ValueError, match=match):
        default_rank(env=env)


def test_torchrun_environment_gives_each_rank_its_own_data(monkeypatch):
    # every rank of a torchrun world of 4, simulated in one process without a process group
    batches = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        loader = DataLoader(list(range(64)), batch_size=4, mesh=None, seed=1)
        assert (loader.rank, loader.data_rank, loader.data_world_size) == (rank, rank, 4)
        batches.append(sorted(int(x) for b in loader for x in b))
    flat = [x for b in batches for x in b]
    assert sorted(flat) == list(range(64))  # exclusive and exhaustive across the 4 ranks


def test_rank_beyond_a_single_process_world_is_an_error(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="rank=5 is out of range"):
        DataLoader(list(range(8)), batch_size=2)


def test_place_is_the_one_mesh_and_rank_rule_of_every_loader():
    from meshfeed.mesh import place
    from meshfeed.queue import SampleStore, StoreLoader

    mesh, rank = place(None, {"dp": 2, "tp": 2}, 3)
    assert (mesh.sizes, rank, mesh.data_rank(rank)) == ({"dp": 2, "tp": 2}, 3, 1)
    with pytest.raises(ValueError, match="mesh= and device_mesh= both given"):
        place({"dp": 1}, {"dp": 1}, 0)
    with pytest.raises(ValueError, match="rank"):
        place({"dp": 2}, None, 2)  # outside the mesh
    # the store loader takes the same arguments as DataLoader and maps them the same way
    store = SampleStore()
    store.put("p", {"x": list(range(8))})
    store.close("p")
    for r in range(4):
        loader = StoreLoader(
            store,
            task="t",
            fields=["x"],
            partition="p",
            batch_size=2,
            device_mesh=DataMesh.from_sizes(dp=2, tp=2),
            rank=r,
        )
        assert (loader.data_rank, loader.rank) == (r // 2, r)
        loader.shutdown()
    with pytest.raises(ValueError, match="mesh= and device_mesh= both given"):
        StoreLoader(
            store,
            task="t",
            fields=["x"],
            partition="p",
            batch_size=2,
            mesh={"dp": 1},
            device_mesh={"dp": 1},
            rank=0,
        )


def test_the_largest_plannable_world_is_built_and_a_larger_one_refused_at_once():
    import time

    from meshfeed.mesh import MAX_WORLD_SIZE

    mesh = DataMesh.from_sizes(dp=MAX_WORLD_SIZE // 8, tp=8)
    assert mesh.data_world_size == MAX_WORLD_SIZE // 8
    assert mesh.replica_group(MAX_WORLD_SIZE - 1) == list(range(MAX_WORLD_SIZE - 8, MAX_WORLD_SIZE))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="MAX_WORLD_SIZE"):
        DataMesh.from_sizes(dp=MAX_WORLD_SIZE // 8 + 1, tp=8)
    assert time.perf_counter() - start < 0.1


def test_a_mesh_of_axis_sizes_costs_the_same_at_any_world_size():
    """#32: no per-rank table; coordinates, data rank and replica group are arithmetic."""
    import time
    import tracemalloc

    def build(dp: int) -> tuple[float, int, DataMesh]:
        tracemalloc.start()
        t0 = time.perf_counter()
        mesh = DataMesh.from_sizes(pp=4, dp=dp, cp=4, tp=8)
        rank = mesh.world_size - 1
        assert mesh.data_rank(rank) == (dp - 1) % dp and len(mesh.replica_group(rank)) == 128
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return took, peak, mesh

    _, small_peak, _ = build(16)
    _, big_peak, big = build(2**15)  # 4 million ranks
    assert big_peak < 2 * small_peak + 100_000
    assert big.coords(big.world_size - 1) == {"pp": 3, "dp": 2**15 - 1, "cp": 3, "tp": 7}


@pytest.mark.parametrize("ulysses", [1, 2])
def test_replica_groups_are_those_of_a_rank_by_rank_scan(ulysses):
    mesh = DataMesh.from_sizes(pp=2, dp=4, cp=2, tp=3, ulysses=ulysses)
    for rank in range(mesh.world_size):
        want = [r for r in range(mesh.world_size) if mesh.data_rank(r) == mesh.data_rank(rank)]
        assert mesh.replica_group(rank) == want
    shuffled = np.random.default_rng(0).permutation(mesh.world_size).reshape(2, 4, 2, 3)
    custom = DataMesh(
        axis_names=("pp", "dp", "cp", "tp"),
        axis_sizes=(2, 4, 2, 3),
        ranks=shuffled,
        ulysses=ulysses,
    )
    for rank in range(custom.world_size):
        want = [
            r for r in range(custom.world_size) if custom.data_rank(r) == custom.data_rank(rank)
        ]
        assert custom.replica_group(rank) == want
        c = custom.coords(rank)
        assert shuffled[c["pp"], c["dp"], c["cp"], c["tp"]] == rank


def test_the_sizes_an_error_suggests_are_every_divisor_in_bounded_time():
    from meshfeed.mesh import MAX_WORLD_SIZE, data_sizes_dividing

    assert data_sizes_dividing(12) == [1, 2, 3, 4, 6, 12]
    assert data_sizes_dividing(4099) == [1, 4099]  # a prime past the search bound
    assert data_sizes_dividing(2**70 + 1)[0] == 1  # at once (it walked every number up to it)
    assert all(d <= MAX_WORLD_SIZE for d in data_sizes_dividing(2**40))
