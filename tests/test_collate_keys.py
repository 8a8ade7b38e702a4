"""Samples whose structure differs across a batch: a key only some samples have, a sample of
another kind, an empty batch. Each is refused naming the key, the sample and the fix; torch's
default_collate drops a key only later samples have, silently, which meshfeed does not."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate as torch_collate

from meshfeed import DataLoader, default_collate, pad_collate


def test_a_key_only_a_later_sample_has_is_refused_not_dropped():
    items = [{"x": 1}, {"x": 2, "extra": np.float32(1.5)}]
    assert set(torch_collate(items)) == {"x"}  # torch drops it: silent data loss
    with pytest.raises(
        ValueError, match=r"sample 1 of the batch has key 'extra', which sample 0 lacks"
    ):
        default_collate(items)


def test_a_key_missing_from_a_later_sample_is_named_with_the_fix():
    with pytest.raises(ValueError, match=r"sample 2 of the batch lacks key 'x'.*same keys") as info:
        default_collate([{"x": 1}, {"x": 2}, {"y": 3}])
    assert "collate_fn" in str(info.value)


def test_a_nested_key_is_named_by_its_path():
    with pytest.raises(ValueError, match=r"has key 'meta\.c'"):
        default_collate([{"meta": {"b": 1}}, {"meta": {"b": 2, "c": 3}}])
    with pytest.raises(ValueError, match=r"lacks key 'meta\.b'"):
        default_collate([{"meta": {"b": 1}}, {"meta": {"c": 3}}])


@pytest.mark.parametrize(
    ("items", "odd"),
    [
        ([{"x": 1}, 2], "sample 1 of the batch is of type int"),
        ([1, {"x": 1}], "sample 1 of the batch is of type dict"),
        ([1.5, {"x": 1}], "sample 1 of the batch is of type dict"),
        ([np.int64(1), {"x": 1}], "sample 1 of the batch is of type dict"),
        ([torch.ones(2), torch.ones(2), {"x": 1}], "sample 2 of the batch is of type dict"),
        ([np.ones(2), {"x": 1}], "sample 1 of the batch is of type dict"),
        ([(1, 2), 3], "sample 1 of the batch is of type int"),
        ([{"x": 1}, {"x": "a"}], r"cannot collate key 'x': sample 1 of the batch is of type str"),
    ],
)
def test_a_sample_of_another_kind_is_named(items, odd):
    with pytest.raises(ValueError, match=odd):
        default_collate(items)


def test_an_empty_batch_is_refused_by_name():
    with pytest.raises(ValueError, match="empty batch"):
        default_collate([])


def test_same_keys_in_another_order_or_mapping_type_still_collate():
    items = [collections.OrderedDict(a=1, b=2.0), {"b": 3.0, "a": 4}]
    out = default_collate(items)
    assert list(out) == ["a", "b"] and out["a"].tolist() == [1, 4]


def test_pad_collate_refuses_a_key_only_a_later_item_has_and_one_it_lacks():
    pad = pad_collate(pad_id=0)
    with pytest.raises(ValueError, match=r"sample 1 of the batch has key 'labels'"):
        pad([{"input_ids": [1, 2]}, {"input_ids": [3], "labels": [3]}])
    with pytest.raises(ValueError, match=r"sample 1 of the batch lacks key 'labels'"):
        pad([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3]}])
    with pytest.raises(ValueError, match=r"sample 1 of the batch lacks key 'id'"):
        pad([{"input_ids": [1, 2], "id": 1}, {"input_ids": [3]}])
    with pytest.raises(ValueError, match=r"sample 1 of the batch is of type list"):
        pad([{"input_ids": [1, 2]}, [3]])


class _KeysDiffer:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {"x": i, "extra": 1.5} if i == 1 else {"x": i}


def test_the_loader_refuses_a_batch_whose_samples_keys_differ():
    loader = DataLoader(_KeysDiffer(), batch_size=4, seed=0, shuffle=False)
    with pytest.raises(ValueError, match="has key 'extra'"):
        next(iter(loader))
