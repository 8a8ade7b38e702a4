"""The loader state's checks: a global batch the new data-parallel size does not divide (#32)."""

from __future__ import annotations

import pytest

from meshfeed import DataLoader
from meshfeed.testing import take


def test_a_global_batch_the_new_dp_size_does_not_divide_is_refused_by_name():
    old = DataLoader(list(range(120)), batch_size=3, mesh={"dp": 4}, rank=0)
    take(old, 2)
    state = old.state_dict()
    five = DataLoader(list(range(120)), batch_size=2, mesh={"dp": 5}, rank=0)
    with pytest.raises(ValueError, match=r"12 does not divide among this loader's 5 data ranks.*"
                       r"\[1, 2, 3, 4, 6, 12\]"):  # fmt: skip
        five.load_state_dict(state)
    five.load_state_dict(state, allow_global_batch_change=True)  # same sample position
    assert five.position == 24
    three = DataLoader(list(range(120)), batch_size=4, mesh={"dp": 3}, rank=2)
    three.load_state_dict(state)  # 12 divides among 3: exact
    assert (
        take(three, 1)[0].tolist()
        == take(DataLoader(list(range(120)), batch_size=12), 3)[2][8:].tolist()
    )
