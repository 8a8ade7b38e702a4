"""The earliest-deadline interleave: draws at scattered positions equal the dense walk."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from meshfeed.order.interleave import MARK_EVERY, _Deadline


def _deadline(weights: list[float]) -> _Deadline:
    fracs = [Fraction(w) for w in weights]
    total = sum(fracs, Fraction(0))
    return _Deadline([f / total for f in fracs])


@pytest.mark.parametrize("weights", [[3.14159, 2.71828, 1.0], [0.3, 0.0, 0.7, 0.123, 1.5]])
def test_scattered_positions_draw_what_the_dense_walk_draws(weights: list[float]) -> None:
    n = 3 * MARK_EVERY + 17
    src, rank = _deadline(weights).draws(np.arange(n))
    rng = np.random.default_rng(1)
    positions = rng.choice(n, size=200, replace=False)  # unsorted, walked from fresh marks
    got_src, got_rank = _deadline(weights).draws(positions)
    assert np.array_equal(got_src, src[positions])
    assert np.array_equal(got_rank, rank[positions])
    # The rank is the source's count before the position: the dense walk counts up by one.
    for s in set(src.tolist()):
        assert rank[src == s].tolist() == list(range(int((src == s).sum())))


def test_a_later_walk_resumes_from_the_cursor_and_marks() -> None:
    weights = [1.0, 2.0**0.5, 0.2]
    dense_src, _ = _deadline(weights).draws(np.arange(2 * MARK_EVERY + 5))
    order = _deadline(weights)
    order.draws(np.array([MARK_EVERY + 3]))
    later = np.array([MARK_EVERY + 4, 2 * MARK_EVERY + 4])
    assert np.array_equal(order.draws(later)[0], dense_src[later])
    earlier = np.array([5, MARK_EVERY - 1])
    assert np.array_equal(order.draws(earlier)[0], dense_src[earlier])
