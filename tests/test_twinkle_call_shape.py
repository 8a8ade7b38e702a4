"""Twinkle's DataLoader call shape: a callable dataset, ``device_mesh=`` as the mesh."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed import DataLoader, DataMesh


class Squares:
    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i * i


def make_dataset() -> Squares:
    return Squares(12)


def _batches(loader: DataLoader) -> list[list[int]]:
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_callable_dataset_with_device_mesh_reads_like_a_built_one(rank: int):
    mesh = {"dp": 2, "tp": 2}
    twinkle_shape = DataLoader(make_dataset, batch_size=2, device_mesh=mesh, rank=rank, seed=3)
    built = DataLoader(Squares(12), batch_size=2, mesh=mesh, rank=rank, seed=3)
    assert isinstance(twinkle_shape.dataset, Squares)
    assert _batches(twinkle_shape) == _batches(built)


def test_device_mesh_takes_a_data_mesh_and_tp_peers_agree():
    mesh = DataMesh.from_sizes(dp=2, tp=2)
    peers = [_batches(DataLoader(Squares, batch_size=3, device_mesh=mesh, rank=r)) for r in (0, 1)]
    assert peers[0] == peers[1]  # ranks 0 and 1 are tp peers of data rank 0
    other = _batches(DataLoader(Squares, batch_size=3, device_mesh=mesh, rank=2))
    assert not set(np.ravel(peers[0])) & set(np.ravel(other))


def test_mesh_and_device_mesh_together_are_refused_by_name():
    with pytest.raises(ValueError, match="mesh= and device_mesh= both given"):
        DataLoader(Squares(4), batch_size=1, mesh={"dp": 1}, device_mesh={"dp": 1}, rank=0)


def test_a_callable_that_does_not_build_a_dataset_is_refused_by_name():
    with pytest.raises(TypeError, match=r"returned int, not a map-style dataset"):
        DataLoader(lambda: 5, batch_size=1)
    with pytest.raises(TypeError, match="calling it with no arguments failed"):
        DataLoader(lambda n: Squares(n), batch_size=1)
