"""make_interleave's whole-number fast path (#32) builds exactly the rational path's period."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed.order.interleave import make_interleave


@pytest.mark.parametrize("weights", [[1] * 7, [2, 4, 6], [3, 1, 0, 5], [10**6, 1], [5]])
def test_whole_weights_give_the_same_interleave_as_the_rational_path(weights: list[int]) -> None:
    fast = make_interleave(weights)
    slow = make_interleave([float(w) for w in weights])  # floats take the Fraction path
    assert fast.kind == slow.kind  # "tree" past MAX_PERIOD ([10**6, 1]), else "period"
    assert fast.max_deviation == slow.max_deviation
    positions = np.arange(3 * sum(weights) + 11)
    for got, want in zip(fast.draws(positions), slow.draws(positions), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(fast.counts(1000), slow.counts(1000))


def test_ten_thousand_equal_weights_take_turns() -> None:
    mix = make_interleave([1] * 10_000)
    sources, ranks = mix.draws(np.arange(20_000))
    assert np.bincount(sources).tolist() == [2] * 10_000
    assert set(ranks.tolist()) == {0, 1}


def test_all_zero_whole_weights_are_still_refused() -> None:
    with pytest.raises((ValueError, ZeroDivisionError)):
        make_interleave([0, 0])
