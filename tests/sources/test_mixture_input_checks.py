"""Mixture input that was misread or accepted silently: int source names, numpy integers,
merged names, an epoch that ends inside a global batch, and a hint that did not work."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed import DataLoader, Mixture
from meshfeed.curriculum import Curriculum, CurriculumMetric, MetricIndex, fixed_linear


def test_int_source_names_take_weights_by_those_names():
    # {0: 1, 1: 3} was read as a schedule (steps 0 and 1) and refused with a wrong message
    mix = Mixture({0: list(range(10)), 1: list(range(10, 30))}, {0: 1, 1: 3})
    assert mix.schedule == [(0, {"0": 1, "1": 3})]
    assert Mixture({0: [1], 1: [2]}, {"0": 1, "1": 3}).schedule == mix.schedule


def test_numpy_integers_are_steps_and_epoch_sizes_as_ints_are():
    a, b = np.arange(40), np.arange(100, 140)
    mix = Mixture(
        {"a": a, "b": b},
        {np.int64(0): {"a": 1, "b": 1}, np.int64(5): {"a": 1, "b": 0}},  # were source names
        samples_per_epoch=np.int64(40),  # was refused
    )
    assert [s for s, _ in mix.schedule] == [0, 5] and mix.samples_per_epoch == 40
    mix.reweight(np.int64(7), {"a": 0, "b": 1})  # was refused
    assert [s for s, _ in mix.schedule] == [0, 5, 7]


@pytest.mark.parametrize("bad", [True, 0, -3, 2.0, "8"])
def test_a_samples_per_epoch_that_is_not_a_positive_int_is_refused(bad):
    with pytest.raises(ValueError, match="samples_per_epoch must be a positive int"):
        Mixture({"a": [1], "b": [2]}, {"a": 1, "b": 1}, samples_per_epoch=bad)


def test_two_keys_with_the_same_name_are_refused_not_merged():
    with pytest.raises(ValueError, match=r"source names \['1'\] each name two sources"):
        Mixture({1: [1, 2], "1": [3, 4]}, {"1": 1})


def test_a_schedule_with_steps_that_are_not_ints_is_refused_by_name():
    with pytest.raises(ValueError, match=r"int steps \(got keys \[0.0\]\)"):
        Mixture({"a": [1], "b": [2]}, {0.0: {"a": 1, "b": 1}})


@pytest.mark.parametrize(("spe", "fix"), [(100, "use 96 or 120"), (5, "use 8")])
def test_an_epoch_that_ends_inside_a_global_batch_is_refused(spe, fix):
    # with drop_last the draws of the last partial batch were lost from their sources' passes,
    # and weight changes (placed at step * global batch) fell inside batches
    mix = Mixture({"a": np.arange(60), "b": np.arange(100, 160)}, {"a": 1, "b": 1},
                  samples_per_epoch=spe)  # fmt: skip
    batch = 24 if spe == 100 else 8
    with pytest.raises(ValueError, match=f"not a multiple of the global batch size {batch}.*{fix}"):
        DataLoader(mix, batch_size=batch, seed=0)


def test_the_refusal_of_a_source_with_nothing_eligible_gives_a_fix_that_works():
    values = np.concatenate([np.full(40, 1), np.full(40, 9)])  # source b: all difficulty 9
    index = MetricIndex.from_values("v", values, fingerprint={"length": 80, "hash": "v"})
    curriculum = Curriculum([CurriculumMetric(index=index, schedule=fixed_linear(1, 10, 20, 1))])
    weights = {0: {"a": 1, "b": 0}, 30: {"a": 1, "b": 1}}  # weight 0 does not help
    mix = Mixture({"a": np.arange(40), "b": np.arange(100, 140)}, weights)
    with pytest.raises(ValueError, match="at weight 0 too.*lower the min_difficulty") as e:
        DataLoader(mix, batch_size=8, seed=0, curriculum=curriculum)
    assert "give it weight 0" not in str(e.value)
