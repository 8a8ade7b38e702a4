"""The one collate module: samples -> batch, and a store field -> column."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshfeed.collate import collate_column, default_collate


def test_default_collate_stacks_and_recurses():
    batch = default_collate([{"x": np.ones(2), "n": 1}, {"x": np.zeros(2), "n": 2}])
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].shape == (2, 2)
    assert batch["n"].tolist() == [1, 2]
    with pytest.raises(ValueError, match="different lengths"):
        default_collate([[1, 2], [3]])


def test_collate_column_stacks_equal_shapes_and_keeps_ragged_rows():
    arrays = collate_column([np.zeros(3, np.int32), np.ones(3, np.int32)])
    assert isinstance(arrays, np.ndarray) and arrays.shape == (2, 3) and arrays.dtype == np.int32
    tensors = collate_column([torch.zeros(2), torch.ones(2)])
    assert isinstance(tensors, torch.Tensor) and tensors.shape == (2, 2)
    ragged = collate_column([torch.zeros(2), torch.ones(3)])
    assert isinstance(ragged, list) and [len(t) for t in ragged] == [2, 3]
    mixed_dtype = collate_column([np.zeros(2, np.int64), np.zeros(2, np.float32)])
    assert isinstance(mixed_dtype, list)
    assert collate_column(["a", "b"]) == ["a", "b"] and collate_column([]) == []
