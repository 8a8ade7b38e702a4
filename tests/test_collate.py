"""The one collate module: samples -> batch, and a store field -> column."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meshfeed
from meshfeed import DataLoader, pad_collate
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


def test_default_collate_names_the_key_of_mismatched_shapes_and_points_at_pad_collate():
    items = [{"ids": np.zeros(3, np.int64), "y": 1}, {"ids": np.zeros(5, np.int64), "y": 2}]
    with pytest.raises(ValueError, match=r"key 'ids': shapes differ.*\(3,\), \(5,\).*pad_collate"):
        default_collate(items)
    nested = [{"a": {"b": torch.zeros(2)}}, {"a": {"b": torch.zeros(4)}}]
    with pytest.raises(ValueError, match=r"key 'a\.b'.*pad_collate"):
        default_collate(nested)
    with pytest.raises(ValueError, match=r"key 'ids': sequences of different lengths.*pad_collate"):
        default_collate([{"ids": [1, 2]}, {"ids": [1]}])


def test_pad_collate_bare_sequences_of_every_kind():
    batch = pad_collate(pad_id=9)([torch.tensor([5, 6, 7]), np.array([8]), [1, 2]])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9], [1, 2, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0], [0, 1, 0]]
    assert batch["attention_mask"].dtype == batch["position_ids"].dtype == torch.int64


def test_pad_collate_dicts_pad_each_key_with_its_value_and_keep_scalars():
    items = [
        {"input_ids": [1, 2, 3], "labels": [2, 3, 4], "score": 0.5, "name": "a"},
        {"input_ids": [7], "labels": [8], "score": 1.5, "name": "b"},
    ]
    batch = pad_collate(pad_id=0)(items)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [7, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4], [8, -100, -100]]  # ignored by the loss
    assert batch["score"].tolist() == [0.5, 1.5] and batch["name"] == ["a", "b"]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    left = pad_collate(pad_id=0, side="left", pad_values={"labels": -1})(items)
    assert left["input_ids"].tolist() == [[1, 2, 3], [0, 0, 7]]
    assert left["labels"].tolist() == [[2, 3, 4], [-1, -1, 8]]
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert left["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]


def test_pad_collate_max_len_fixes_the_shape_and_refuses_or_truncates_longer_items():
    assert pad_collate(max_len=4)([[1], [2, 3]])["input_ids"].shape == (2, 4)
    with pytest.raises(
        ValueError, match="'input_ids' has 5 entries, more than max_len=4.*truncate"
    ):
        pad_collate(max_len=4)([[1, 2, 3, 4, 5]])
    cut = pad_collate(max_len=2, truncate=True)([[1, 2, 3], [4]])
    assert cut["input_ids"].tolist() == [[1, 2], [4, 0]]
    with pytest.raises(ValueError, match="'labels' and 'input_ids' differ in length"):
        pad_collate()([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        pad_collate(max_len=0)


def test_pad_collate_in_a_loader_with_worker_processes():
    data = [list(range(n)) for n in (3, 1, 4, 1, 5, 9, 2, 6)]
    loader = DataLoader(data, batch_size=4, collate_fn=pad_collate(pad_id=-1), num_workers=1)
    batches = list(loader)
    assert len(batches) == 2
    lengths = []
    for batch in batches:
        mask = batch["attention_mask"].bool()
        assert (batch["input_ids"][~mask] == -1).all()
        lengths += mask.sum(1).tolist()
        for row, n in zip(batch["input_ids"], mask.sum(1).tolist(), strict=True):
            assert row[:n].tolist() == list(range(n))  # each item intact, in front
    assert sorted(lengths) == sorted(len(d) for d in data)
    assert "pad_collate" in meshfeed.__all__ and meshfeed.__all__ == sorted(meshfeed.__all__)


def test_pad_collate_adds_its_mask_and_positions_on_the_tokens_device():
    # A scalar field collated first lands on the CPU; the mask and positions follow the tokens
    # (the meta device stands in for a GPU here).
    items = [{"label": 1, "input_ids": torch.arange(n, device="meta")} for n in (2, 4)]
    out = pad_collate()(items)
    assert out["label"].device.type == "cpu"
    assert {out[k].device.type for k in ("input_ids", "attention_mask", "position_ids")} == {"meta"}
