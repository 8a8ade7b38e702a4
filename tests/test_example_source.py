"""The one-file example source works with workers, gloo ranks, Ray and resume, untouched."""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import pytest
import torch
from examples.npy_folder_source import NpyFolder, write_npy_folder

from meshfeed import DataLoader
from meshfeed.collate import default_collate
from meshfeed.errors import SourceError
from meshfeed.testing import assert_resume_equivalence, take
from tests.dist_utils import run_distributed

N = 24


@pytest.fixture
def folder(tmp_path) -> str:
    write_npy_folder(tmp_path, [np.arange(i, i + 3, dtype=np.int64) for i in range(N)])
    return str(tmp_path)


def _firsts(batches: list[torch.Tensor]) -> list[list[int]]:
    return [b[:, 0].tolist() for b in batches]


def test_the_source_meets_the_declared_contract(folder):
    from meshfeed.protocols import BatchSource, FingerprintedSource, Source

    ds = NpyFolder(folder)
    assert isinstance(ds, Source) and isinstance(ds, BatchSource)
    assert isinstance(ds, FingerprintedSource) and ds.fingerprint.startswith("npy-folder:24:")
    idx = np.array([5, 0, 7])
    assert torch.equal(ds.fetch_batch(idx), default_collate([ds[int(i)] for i in idx]))


def test_workers_give_what_the_main_process_gives(folder):
    local = _firsts(list(DataLoader(NpyFolder(folder), batch_size=4, seed=2)))
    with DataLoader(NpyFolder(folder), batch_size=4, seed=2, num_workers=2) as loader:
        assert _firsts(list(loader)) == local
    assert sorted(v for b in local for v in b) == list(range(N))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_is_exact_across_epochs(folder, num_workers):
    def factory() -> DataLoader:
        return DataLoader(
            NpyFolder(folder), batch_size=5, seed=4, num_workers=num_workers, drop_last=False
        )

    assert_resume_equivalence(factory, num_items=8, every=1 if num_workers == 0 else 3)


def test_a_checkpoint_of_another_folder_is_refused(folder, tmp_path_factory):
    loader = DataLoader(NpyFolder(folder), batch_size=4)
    take(loader, 2)
    other = write_npy_folder(tmp_path_factory.mktemp("b"), [np.zeros(3)] * N)
    with pytest.raises(ValueError, match="another dataset"):
        DataLoader(other, batch_size=4).load_state_dict(loader.state_dict())


def test_a_damaged_file_raises_naming_it(folder):
    ds = NpyFolder(folder)
    (ds.folder / ds.files[3]).write_bytes(b"not numpy")
    with pytest.raises(SourceError, match=ds.files[3]):
        list(DataLoader(ds, batch_size=4, shuffle=False))


def _rank(rank: int, world: int, folder: str) -> dict[str, Any]:
    loader = DataLoader(NpyFolder(folder), batch_size=3, mesh={"dp": world}, seed=6)
    head = _firsts(take(loader, 2))
    state = json.loads(json.dumps(loader.state_dict()))
    tail = _firsts(list(loader))
    resumed = DataLoader(NpyFolder(folder), batch_size=3, mesh={"dp": world}, seed=6)
    resumed.load_state_dict(state)
    return {"head": head, "tail": tail, "resumed": _firsts(list(resumed))}


@pytest.mark.slow
def test_two_gloo_ranks_read_disjoint_slices_and_resume(folder):
    results = run_distributed(_rank, 2, folder, timeout=120)
    for rank, got in enumerate(results):
        simulated = DataLoader(NpyFolder(folder), batch_size=3, mesh={"dp": 2}, rank=rank, seed=6)
        assert got["head"] + got["tail"] == _firsts(list(simulated))  # one process, same slices
        assert got["resumed"] == got["tail"]
    seen = [v for r in results for b in r["head"] + r["tail"] for v in b]
    assert sorted(seen) == list(range(N))  # every sample once per epoch, on exactly one rank


@pytest.mark.ray
@pytest.mark.slow
def test_ray_actors_build_the_source_and_each_rank_gets_its_slice(folder, ray_session):
    from meshfeed.services.ray import RayService

    mesh = {"dp": 2}
    loader = DataLoader(
        functools.partial(NpyFolder, folder),
        batch_size=3,
        mesh=mesh,
        seed=6,
        service=RayService(),
    )
    try:
        remote = take(loader, 4)
        for rank in range(2):
            local = DataLoader(NpyFolder(folder), batch_size=3, mesh=mesh, rank=rank, seed=6)
            got = ray_session.get([rb.for_rank(rank) for rb in remote])
            assert _firsts(got) == _firsts(take(local, 4))
    finally:
        loader.shutdown()
