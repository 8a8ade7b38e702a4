"""The batch-size ramp's schedule (#32): Megatron's float formula, its boundaries, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed import DataLoader
from meshfeed.order.rampup import BatchRampup, RampSizes, as_rampup
from tests.optional import given, settings, st


def _loader(rampup, **kw):
    return DataLoader(list(range(200)), batch_size=8, mesh={"dp": 2}, rank=0, rampup=rampup, **kw)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ((0, 4, 60), "start must be an int >= 1"),
        ((4, 4, 0), "samples must be an int >= 1"),
        ((4, 4), "rampup must be None, a BatchRampup or"),
        ((4, 8, 60), "whole increments"),
        ((20, 4, 60), "start <= 16"),
    ],
)
def test_bad_ramps_are_refused_by_name(value, match):
    with pytest.raises(ValueError, match=match):
        _loader(value)


def test_ramp_values_of_the_wrong_type_are_a_type_error_naming_them():
    with pytest.raises(TypeError, match=r"increment must be an int >= 1 \(got increment=4.0"):
        _loader((4, 4.0, 60))
    with pytest.raises(TypeError, match="round_down must be True or False .got round_down='no'"):
        BatchRampup(start=4, increment=4, samples=6, round_down="no")


def test_a_ramp_longer_than_floats_count_exactly_is_refused_by_name():
    # checked first on the ramp itself: a loader over such a ramp searched its boundaries
    # one sample at a time once floats skip integers (a hang)
    for samples in (2**53 + 1, 10**24):
        with pytest.raises(ValueError, match=r"samples must be at most 2\*\*53 = 9007199254740992"):
            BatchRampup(start=4, increment=4, samples=samples)
    with pytest.raises(ValueError, match=r"got samples=1000000000000000000000000\)"):
        _loader((4, 4, 10**24))
    longest = RampSizes(BatchRampup(start=4, increment=4, samples=2**53), 16, 2)
    for consumed in (0, 2**51, 2**52 + 5, 2**53 - 2**51 - 1):
        change = longest.next_change(consumed)
        assert change is not None and consumed < change
        assert longest.raw(change - 1) == longest.raw(consumed) != longest.raw(change)
    assert [len(b) for b in _loader((4, 4, 2**53))][:3] == [2, 2, 2]


def test_ramp_options_are_refused_where_they_cannot_be_exact():
    with pytest.raises(ValueError, match="drop_last=False, pad_last=False"):
        _loader((4, 4, 60), drop_last=False, pad_last=False)
    with pytest.raises(ValueError, match="do not split into micro-batches"):
        BatchRampup(start=4, increment=4, samples=6, micro_batch_size=2, uneven=True)
    assert "rampup_start" in _loader((4, 4, 60))._agreement()  # ranks with another ramp are refused
    with pytest.raises(ValueError, match="two answers to one question"):
        BatchRampup(start=4, increment=4, samples=6, round_down=True, uneven=True)
    assert as_rampup((4, 4, 60)) == BatchRampup(start=4, increment=4, samples=60)
    from meshfeed.sources import Mixture

    mix = Mixture({"a": list(range(50)), "b": list(range(50))}, weights={"a": 1, "b": 1})
    with pytest.raises(ValueError, match="with a Mixture dataset"):
        DataLoader(mix, batch_size=4, rampup=(2, 2, 20))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 8), st.integers(1, 200))
def test_next_change_is_the_first_consumed_count_with_another_size(start, inc, climbs, samples):
    rampup = BatchRampup(start=start, increment=inc, samples=samples, uneven=True)
    sizes = RampSizes(rampup, start + climbs * inc, 1)
    for c in range(samples + 3):
        brute = next((x for x in range(c + 1, samples + 2) if sizes.raw(x) != sizes.raw(c)), None)
        change = sizes.next_change(c)
        if brute is None:  # constant from here: no change, or a harmless boundary past samples
            assert change is None or change > samples
        else:
            assert change == brute


def test_sizes_are_megatrons_float_formula_at_awkward_boundaries():
    # 10 samples over 3 increments: boundaries at 3.33.., 6.66.., 10 (float division).
    sizes = RampSizes(BatchRampup(start=1, increment=1, samples=10), 4, 1)
    expected = [1 + int(c / (10 / 3)) if c <= 10 else 4 for c in range(30)]
    assert [sizes.size(c) for c in range(30)] == expected
    changes = [c for c in range(1, 30) if expected[c] != expected[c - 1]]
    assert [sizes.next_change(c) for c in (0, changes[0], changes[1])] == changes[:3]
    assert np.all(np.diff([sizes.size(c) for c in range(30)]) >= 0)
    assert sizes.sizes() == [1, 2, 3, 4]


def test_round_down_rounds_every_size_to_micro_batches_times_ranks():
    rampup = BatchRampup(start=6, increment=2, samples=60, micro_batch_size=2, round_down=True)
    sizes = RampSizes(rampup, 32, 2)  # multiples of 2 x 2 = 4
    assert sizes.sizes() == [4, 8, 12, 16, 20, 24, 28, 32]
    assert [sizes.size(c) for c in (0, 5, 10)] == [4, 8, 8]  # raw 6, 8, 10 at 60 / 13 each
