"""allow_global_batch_change=True is refused for an order that counts its steps in global
batches (a curriculum, also over a Mixture, and a Mixture weight schedule): another global batch
would rewind the curriculum or move the weight changes. Orders without such steps still take it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import meshfeed
from meshfeed.curriculum import Curriculum, CurriculumMetric, MetricIndex, fixed_linear
from meshfeed.testing import take

N = 960


def _curriculum(n: int = N) -> Curriculum:
    values = np.arange(n) % 100 + 1
    index = MetricIndex.from_values("v", values, fingerprint={"length": n, "hash": "t"})
    return Curriculum([CurriculumMetric(index=index, schedule=fixed_linear(10, 100, 100))])


def _mixture(schedule: Any) -> meshfeed.Mixture:
    sources = {"a": np.arange(0, 480), "b": np.arange(10_000, 10_480)}
    return meshfeed.Mixture(sources, schedule, seed=0, samples_per_epoch=N)


def _loader(dataset: Any, batch_size: int, **kwargs: Any) -> meshfeed.DataLoader:
    return meshfeed.DataLoader(
        dataset, batch_size=batch_size, seed=1, mesh={"dp": 1}, rank=0, **kwargs
    )


def _state(make: Any, batch_size: int = 8, steps: int = 20) -> dict[str, Any]:
    """The JSON state of a loader from ``make(batch_size)`` after ``steps`` batches."""
    loader = make(batch_size)
    take(loader, steps)
    return dict(json.loads(json.dumps(loader.state_dict())))


def curriculum(batch_size: int) -> meshfeed.DataLoader:
    return _loader(np.arange(N), batch_size, curriculum=_curriculum())


def curriculum_over_mixture(batch_size: int) -> meshfeed.DataLoader:
    return _loader(_mixture({"a": 1, "b": 1}), batch_size, curriculum={"a": _curriculum(480)})


def scheduled_mixture(batch_size: int) -> meshfeed.DataLoader:
    return _loader(_mixture({0: {"a": 1, "b": 1}, 30: {"a": 0, "b": 1}}), batch_size)


def shuffled(batch_size: int) -> meshfeed.DataLoader:
    return _loader(np.arange(N), batch_size)


def constant_mixture(batch_size: int) -> meshfeed.DataLoader:
    return _loader(_mixture({"a": 1, "b": 3}), batch_size)


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (curriculum, "a curriculum"),
        (curriculum_over_mixture, "a curriculum"),
        (scheduled_mixture, "a Mixture weight schedule"),
    ],
)
def test_a_global_batch_change_is_refused_for_steps_counted_in_global_batches(make, what):
    state = _state(make)
    other = make(16)
    with pytest.raises(
        ValueError,
        match=rf"global batch size 8 differs from this loader's 16, and this loader's order has "
        rf"{what}, whose steps are counted in global batches of 8.*refused even with "
        r"allow_global_batch_change=True; resume with the same global batch size 8 \(batch_size=8",
    ):
        other.load_state_dict(state, allow_global_batch_change=True)
    with pytest.raises(ValueError, match=rf"{what}, whose steps are counted"):
        other.load_state_dict(state)  # not advised to pass allow_global_batch_change=True
    same = make(8)
    same.load_state_dict(state, allow_global_batch_change=True)  # the same global batch: exact
    assert same.position == 160


def test_a_weight_schedule_restored_from_the_checkpoint_counts_too():
    """A Mixture built with its initial weights takes the checkpoint's schedule on resume."""
    state = _state(scheduled_mixture)
    constant = _loader(_mixture({"a": 1, "b": 1}), 16)
    assert len(constant.dataset.schedule) == 1
    with pytest.raises(ValueError, match="a Mixture weight schedule, whose steps are counted"):
        constant.load_state_dict(state, allow_global_batch_change=True)


@pytest.mark.parametrize("make", [shuffled, constant_mixture])
def test_orders_without_steps_in_global_batches_still_change_the_global_batch(make):
    state = _state(make)
    other = make(16)
    with pytest.raises(ValueError, match="pass allow_global_batch_change=True"):
        other.load_state_dict(state)
    other.load_state_dict(state, allow_global_batch_change=True)  # same sample position
    assert other.position == 160
    assert len(take(other, 1)[0]) == 16
