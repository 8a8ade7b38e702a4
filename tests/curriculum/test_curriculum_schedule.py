"""Pacing schedules against hand-computed tables and DeepSpeed 0.19.8's arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshfeed.curriculum import custom, fixed_discrete, fixed_linear, fixed_root
from tests.optional import given, settings, st


def _deepspeed_before_0_19_8(t: int, lo: int, hi: int, total: int, step: int, root: float) -> int:
    """CurriculumScheduler.__fixed_root_get_difficulty before DeepSpeed 0.19.8 (the arithmetic)."""
    d = (float(t) / total) ** (1.0 / root)
    d = math.floor(d * (hi - lo) + lo)
    d -= d % step
    return min(d, hi)


def _deepspeed_fixed_root(t, lo, hi, total, step, root):
    """The same in DeepSpeed 0.19.8: the floor is raised to the first multiple of the step."""
    d = (float(t) / total) ** (1.0 / root)
    d = math.floor(d * (hi - lo) + lo)
    d -= d % step
    d = max(d, -(-lo // step) * step)
    return min(d, hi)


def test_fixed_linear_matches_a_hand_table():
    s = fixed_linear(
        min_difficulty=8, max_difficulty=64, total_curriculum_step=7, difficulty_step=8
    )
    assert [s.difficulty(t) for t in range(10)] == [8, 16, 24, 32, 40, 48, 56, 64, 64, 64]


def test_fixed_root_matches_a_hand_table():
    # floor(sqrt(t/10) * 99 + 1) rounded down to a multiple of 8:
    # t=1: 32.3 -> 32; t=2: 45.3 -> 40; t=3: 55.2 -> 48; t=5: 71.0 -> 64; t=10: 100 -> 96;
    # t=11: 104.8 -> 104, capped at 100 (t/T is not clamped, exactly as in DeepSpeed).
    s = fixed_root(1, 100, 10, 8, 2)
    assert [s.difficulty(t) for t in (1, 2, 3, 5, 10, 11, 50)] == [32, 40, 48, 64, 96, 100, 100]
    assert s.saturation_step == 11


def test_fixed_root_never_falls_below_min_difficulty_unlike_deepspeed_before_0_19_8():
    s = fixed_root(1, 100, 10, 8, 2)
    assert _deepspeed_before_0_19_8(0, 1, 100, 10, 8, 2) == 0  # an empty pool at step 0
    assert s.difficulty(0) == 8 == _deepspeed_fixed_root(0, 1, 100, 10, 8, 2)  # aligned min
    assert min(s.difficulties(np.arange(30)).tolist()) >= 1


@settings(max_examples=50, deadline=None)
@given(
    lo=st.integers(0, 50),
    span=st.integers(0, 500),
    total=st.integers(1, 200),
    step=st.integers(1, 16),
    root=st.sampled_from([1, 2, 3, 1.5]),
    t=st.integers(0, 400),
)
def test_fixed_root_equals_deepspeed_0_19_8(lo, span, total, step, root, t):
    hi = lo + span
    s = fixed_root(lo, hi, total, step, root)
    assert s.difficulty(t) == _deepspeed_fixed_root(t, lo, hi, total, step, root) >= lo


@settings(max_examples=25, deadline=None)
@given(total=st.integers(1, 100), root=st.sampled_from([1, 2, 4]))
def test_schedules_are_non_decreasing_and_vectorised_like_scalar(total, root):
    s = fixed_root(3, 77, total, 2, root)
    steps = np.arange(2 * total + 5)
    vec = s.difficulties(steps)
    assert np.all(np.diff(vec) >= 0)
    assert vec.tolist() == [s.difficulty(int(t)) for t in steps]
    sat = s.saturation_step
    assert s.difficulty(sat) == 77 and (sat == 0 or s.difficulty(sat - 1) < 77)


def test_fixed_discrete_matches_deepspeed_semantics():
    s = fixed_discrete(difficulty=[1, 2, 3], max_step=[5, 10])
    assert [s.difficulty(t) for t in range(13)] == [1] * 6 + [2] * 5 + [3] * 2
    assert s.saturation_step == 11


def test_float_difficulties_follow_deepspeed_which_floors_to_an_integer_first():
    s = fixed_linear(0.5, 2.5, 4, 0.25)
    assert [s.difficulty(t) for t in range(6)] == [0.5, 1.0, 1.0, 2.0, 2.0, 2.5]
    assert [s.difficulty(t) for t in range(6)] == [
        _deepspeed_fixed_root(t, 0.5, 2.5, 4, 0.25, 1) for t in range(6)
    ]
    assert fixed_linear(0.0, 1.0, 3, 0.1).difficulty(1) == 0.0  # the case
    d = fixed_discrete(difficulty=[0.1, 0.7], max_step=[3])
    assert d.difficulty(4) == 0.7


def test_custom_wraps_a_function_and_saturates():
    s = custom(lambda t: 10 + 2 * t, total_curriculum_step=3)
    assert [s.difficulty(t) for t in range(6)] == [10, 12, 14, 16, 16, 16]
    assert custom(lambda t: t).saturation_step is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fixed_linear(10, 5, 100), "min_difficulty must be <= max_difficulty"),
        (lambda: fixed_linear(1, 5, 0), "total_curriculum_step must be a positive int"),
        (lambda: fixed_linear(1, 5, 10, 0), "difficulty_step must be positive"),
        (lambda: fixed_root(1, 5, 10, 1, 0), "root_degree must be positive"),
        (lambda: fixed_discrete(difficulty=[1, 2], max_step=[3, 4]), r"len\(max_step\) \+ 1"),
        (lambda: fixed_discrete(difficulty=[3, 2], max_step=[3]), "must be non-decreasing"),
        (lambda: fixed_discrete(difficulty=[1, 2, 3], max_step=[5, 5]), "increasing"),
        (lambda: custom(42), "needs a callable"),  # type: ignore[arg-type]
    ],
)
def test_bad_schedule_configuration_is_refused(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_difficulties_beyond_2_to_the_52_are_refused_not_wrapped_negative():
    with pytest.raises(ValueError, match=r"max_difficulty must lie within \+-2\*\*52"):
        fixed_linear(0, 2**63, 100)
    big = fixed_linear(0, 2**52, 100)
    assert big.difficulty(100) == 2**52 and big.difficulty(10**15) == 2**52


def test_negative_steps_are_refused():
    with pytest.raises(ValueError, match="steps must be >= 0"):
        fixed_linear(1, 5, 10).difficulty(-1)


def test_steps_beyond_2_to_the_62_are_refused_by_name():
    with pytest.raises(
        ValueError, match=r"total_curriculum_step must be at most MAX_STEP = 2\*\*62"
    ):
        fixed_linear(1, 5, 2**62 + 1)
    with pytest.raises(ValueError, match=r"max_step\[-1\] must be below MAX_STEP = 2\*\*62"):
        fixed_discrete(difficulty=[1, 2], max_step=[2**62])
    with pytest.raises(ValueError, match=r"total_curriculum_step must be at most MAX_STEP"):
        custom(lambda t: t, total_curriculum_step=10**30)
    # max_difficulty (not a multiple of difficulty_step) is reached only when (t / T)**(1/100)
    # exceeds 1.2: far beyond 2**62, where the search stops
    assert fixed_root(0, 10, 2**52, 4, 100).saturation_step == 2**62
    assert fixed_discrete(difficulty=[1, 2], max_step=[2**62 - 1]).saturation_step == 2**62
