"""meshfeed.testing.assert_same: what it accepts and the message it fails with."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meshfeed.testing import assert_same


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (torch.arange(3), torch.arange(3)),
        (np.arange(3), np.arange(3)),
        (np.arange(3), [0, 1, 2]),
        ({"x": [1, (2, 3)]}, {"x": [1, (2, 3)]}),
        (math.nan, math.nan),
        ("s", "s"),
        (None, None),
    ],
)
def test_assert_same_accepts_equal_outputs(a: object, b: object) -> None:
    assert_same(a, b)


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (torch.arange(3), [0, 1, 2], "item: tensor vs list"),
        ([0, 1, 2], torch.arange(3), "item: tensor vs list"),
        (torch.arange(3), torch.arange(3).float(), "item: tensors differ"),
        (torch.arange(3), torch.arange(4), "item: tensors differ"),
        (np.arange(3), np.arange(4), "item: arrays differ"),
        ({"a": 1}, {"b": 1}, "item: keys differ ['a'] != ['b']"),
        ({"a": [1, 2]}, {"a": [1, 3]}, "item['a'][1]: 2 != 3"),
        ([1, 2], (1, 2), "item: list[2] != tuple[2]"),
        ([1], [1, 2], "item: list[1] != list[2]"),
        (math.nan, 1.0, "item: nan != 1.0"),
        (1, "1", "item: 1 != '1'"),
    ],
)
def test_assert_same_names_the_first_difference(a: object, b: object, message: str) -> None:
    with pytest.raises(AssertionError) as info:
        assert_same(a, b)
    assert str(info.value).startswith(message)
