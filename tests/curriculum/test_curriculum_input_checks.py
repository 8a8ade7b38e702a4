"""Curriculum inputs refused by name: non-finite or non-numeric difficulties, a schedule that is
not a Schedule, a non-int where an int is expected, and a setting the metric would ignore."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import meshfeed
from meshfeed.curriculum import (
    Curriculum,
    CurriculumMetric,
    MetricIndex,
    custom,
    fixed_discrete,
    fixed_linear,
    fixed_root,
)

NAN, INF = float("nan"), float("inf")


def _index(values: Any, name: str = "v") -> MetricIndex:
    values = np.asarray(values)
    return MetricIndex.from_values(name, values, fingerprint={"length": len(values), "hash": "t"})


def _loader(schedule: Any, *, n: int = 40) -> meshfeed.DataLoader:
    metric = CurriculumMetric(index=_index(np.arange(n) % 20 + 1), schedule=schedule)
    return meshfeed.DataLoader(
        np.arange(n), batch_size=4, seed=0, mesh={"dp": 1}, rank=0, curriculum=Curriculum([metric])
    )


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: fixed_discrete(difficulty=[NAN, 20], max_step=[5]),
            ValueError,
            r"difficulty\[0\] must be a finite number \(got difficulty\[0\]=nan\)",
        ),
        (
            lambda: fixed_discrete(difficulty=[5, NAN, 20], max_step=[1, 2]),
            ValueError,
            r"difficulty\[1\] must be a finite number",
        ),
        (
            lambda: fixed_discrete(difficulty=[5, INF], max_step=[1]),
            ValueError,
            r"difficulty\[1\] must be a finite number \(got difficulty\[1\]=inf\)",
        ),
        (
            lambda: fixed_discrete(difficulty=["5", "20"], max_step=[1]),
            TypeError,
            r"difficulty\[0\] must be an int or a float \(got '5' of type str\)",
        ),
        (
            lambda: fixed_discrete(difficulty=[5, None], max_step=[1]),
            TypeError,
            r"difficulty\[1\] must be an int or a float \(got None",
        ),
        (
            lambda: fixed_discrete(difficulty=[False, True], max_step=[1]),
            TypeError,
            r"difficulty\[0\] must be an int or a float \(got False of type bool\)",
        ),
        (
            lambda: fixed_discrete(difficulty=[5, 10], max_step=[2.7]),
            TypeError,
            r"max_step must be ints \(got \[2\.7\]\)",
        ),
        (
            lambda: fixed_discrete(difficulty=[5, 10], max_step=[True]),
            TypeError,
            r"max_step must be ints \(got \[True\]\)",
        ),
        (
            lambda: fixed_linear(NAN, 20, 10),
            ValueError,
            r"min_difficulty must be a finite number \(got min_difficulty=nan\)",
        ),
        (
            lambda: fixed_linear(5, "20", 10),
            TypeError,
            r"max_difficulty must be an int or a float \(got '20' of type str\)",
        ),
        (
            lambda: fixed_root(5, 20, 10, 1, INF),
            ValueError,
            r"root_degree must be a finite number \(got root_degree=inf\); 1 is fixed_linear",
        ),
    ],
)
def test_non_finite_or_non_numeric_difficulties_are_refused_by_name(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_numpy_numbers_are_accepted_where_numbers_are_expected():
    s = fixed_discrete(difficulty=[np.int64(5), np.float32(20.0)], max_step=[np.int64(3)])
    assert s.max_step == (3,) and type(s.max_step[0]) is int
    assert s.difficulty(4) == 20.0
    assert fixed_linear(np.int64(1), np.int64(9), np.int64(8)).difficulty(4) == 5


@pytest.mark.parametrize(
    ("fn", "error", "message"),
    [
        (lambda s: NAN, ValueError, r"custom schedule: fn\(0\) returned nan, not a finite number"),
        (
            lambda s: 5 if s < 3 else INF,
            ValueError,
            r"custom schedule: fn\(3\) returned inf, not a finite number",
        ),
        (lambda s: None, TypeError, r"custom schedule: fn\(0\) returned None, not a finite"),
        (lambda s: "5", TypeError, r"custom schedule: fn\(0\) returned '5', not a finite"),
        (lambda s: s > 2, TypeError, r"custom schedule: fn\(0\) returned False, not a finite"),
    ],
)
def test_a_custom_schedule_value_that_is_not_a_finite_number_is_refused_where_produced(
    fn, error, message
):
    schedule = custom(fn, total_curriculum_step=10)
    with pytest.raises(error, match=message):
        schedule.difficulties(np.arange(12))  # the first step whose value is refused
    with pytest.raises(error, match=message):
        _loader(schedule)


def test_a_custom_schedule_of_numpy_numbers_is_accepted():
    schedule = custom(lambda s: np.int64(min(5 + s, 20)), total_curriculum_step=15)
    assert schedule.difficulty(3) == 8
    assert len(next(iter(_loader(schedule)))) == 4


def test_a_function_passed_as_schedule_is_refused_with_what_to_pass():
    with pytest.raises(TypeError, match=r"schedule must be a Schedule \(got function\).*custom"):
        CurriculumMetric(index=_index([1, 2, 3]), schedule=lambda s: 10)  # type: ignore[arg-type]


def test_percentile_max_with_value_difficulties_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"percentile_max=50 with difficulty_type='value' would"):
        CurriculumMetric(index=_index([1, 2, 3]), schedule=fixed_linear(1, 2, 3), percentile_max=50)
    metric = CurriculumMetric(
        index=_index([1, 2, 3]),
        schedule=fixed_linear(1, 100, 3),
        difficulty_type="percentile",
        percentile_max=np.int64(50),  # a numpy int is an int
    )
    assert metric.percentile_max == 50 and type(metric.percentile_max) is int
    with pytest.raises(ValueError, match="percentile_max must be a positive int or None"):
        CurriculumMetric(
            index=_index([1, 2, 3]),
            schedule=fixed_linear(1, 2, 3),
            difficulty_type="percentile",
            percentile_max=True,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("bad", ["x", 2.5, 8.0, True])
def test_samples_per_epoch_that_is_not_an_int_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=rf"samples_per_epoch must be a positive int or None .*"
                       rf"samples_per_epoch={bad!r}"):  # fmt: skip
        Curriculum(samples_per_epoch=bad)


def test_numpy_ints_are_accepted_for_samples_per_epoch_and_first_step():
    cur = Curriculum(samples_per_epoch=np.int64(8), first_step=np.int64(1))
    assert cur.samples_per_epoch == 8 and type(cur.samples_per_epoch) is int
    assert cur.first_step == 1 and type(cur.first_step) is int
    order = cur.make_order(dataset_length=10, global_batch_size=4, seed=0)
    assert order.epoch_length(0) == 8
    with pytest.raises(ValueError, match="first_step must be an int >= 0"):
        Curriculum(first_step=True)


@pytest.mark.parametrize("kind", ["truncate", "reshape", "reported"])
def test_a_function_passed_as_a_transforms_schedule_is_refused_with_what_to_pass(kind):
    from meshfeed.curriculum import ReportedDifficulty, SeqlenReshape, SeqlenTruncate

    make = {
        "truncate": lambda s: SeqlenTruncate(schedule=s),
        "reshape": lambda s: SeqlenReshape(schedule=s),
        "reported": lambda s: ReportedDifficulty(schedule=s, name="d"),
    }[kind]
    with pytest.raises(TypeError, match="schedule must be a Schedule.*fixed_linear"):
        make(lambda step: 64)  # was an AttributeError at the first batch
