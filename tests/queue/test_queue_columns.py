"""Columnar storage: a put's column is one chunk; gets gather runs, views when contiguous."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshfeed.queue import SampleStore
from meshfeed.queue.engine.columns import Cell, Chunk, Gathered, gather


def test_batches_across_puts_and_out_of_order_rows_are_gathered_exactly():
    store = SampleStore()
    a, b = torch.arange(6).reshape(3, 2), torch.arange(100, 106).reshape(3, 2)
    store.put("p", {"x": a}, ids=[0, 1, 2])
    store.put("p", {"x": b}, ids=[5, 4, 3])
    batch = store.get("t", ["x"], 6, "p", timeout=1)
    assert batch.ids == [0, 1, 2, 5, 4, 3]
    assert torch.equal(batch["x"], torch.cat([a, b]))


def test_fields_of_one_sample_may_come_from_different_puts():
    store = SampleStore()
    store.put("p", {"prompt": torch.ones(4, 3)})
    store.put("p", {"reward": torch.tensor([0.5, 1.5])}, ids=[3, 1])
    store.put("p", {"reward": np.array([2.0, 3.0]).astype(np.float32).tolist()}, ids=[0, 2])
    batch = store.get("t", ["prompt", "reward"], 2, "p", timeout=1)
    assert batch.ids == [0, 1]
    assert batch["prompt"].shape == (2, 3)
    # reward 0 is a float from a list put, reward 1 a row of a tensor put: a list of both
    assert [float(r) for r in batch["reward"]] == [2.0, 1.5]


def test_gather_takes_one_index_select_per_run_and_keeps_plain_values_as_lists():
    c1, c2 = Chunk(torch.arange(10)), Chunk(torch.arange(10, 20))
    out = gather([Cell(c1, 7), Cell(c1, 2), Cell(c2, 0), Cell(c2, 1)])
    assert isinstance(out, Gathered) and out.data.tolist() == [7, 2, 10, 11]
    assert gather([Cell(c1, 1), 5]) == [torch.tensor(1), 5]
    mixed = gather([Cell(c1, 0), Cell(Chunk(np.arange(3)), 0)])  # torch and numpy: no stacking
    assert isinstance(mixed, list) and len(mixed) == 2


@pytest.mark.ray
def test_ray_store_ships_a_small_row_column_as_one_chunk(ray_store):
    from meshfeed.queue.engine.core import StoreOptions
    from meshfeed.testing import reset_store, store_held_types

    store = reset_store(ray_store, StoreOptions())
    column = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    store.put("p", {"x": column, "y": list(range(64))})
    assert store_held_types(store) == ["Cell", "int"]  # rows of one chunk, no tensors
    batch = store.get("t", ["x", "y"], 64, "p", timeout=30)
    assert torch.equal(batch["x"], column) and batch["y"] == list(range(64))
