"""A curriculum checkpoint is refused by a loader whose curriculum gives another pool or
difficulty at the checkpoint's step (it would serve other samples)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import meshfeed
from meshfeed.curriculum import Curriculum, CurriculumMetric, MetricIndex, fixed_linear
from meshfeed.curriculum.index import content_fingerprint

DATA = np.arange(120)
INDEX = MetricIndex.from_values(
    "m", np.random.default_rng(0).random(120), fingerprint=content_fingerprint(DATA)
)


def _curriculum(total: int) -> Curriculum:
    schedule = fixed_linear(10, 100, total, 10)
    return Curriculum(
        [CurriculumMetric(index=INDEX, schedule=schedule, difficulty_type="percentile")]
    )


def test_a_checkpoint_of_another_schedule_is_refused_naming_pool_and_difficulty():
    run = meshfeed.DataLoader(DATA, batch_size=12, seed=2, curriculum=_curriculum(8))
    it = iter(run)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(run.state_dict()))
    rest = [b.tolist() for b in it]
    other = meshfeed.DataLoader(DATA, batch_size=12, seed=2, curriculum=_curriculum(40))
    with pytest.raises(ValueError, match=r"had 36 eligible samples at difficulty \{'m': 30\} at "
                       r"step 2, but this one has 12"):  # fmt: skip
        other.load_state_dict(state)
    same = meshfeed.DataLoader(DATA, batch_size=12, seed=2, curriculum=_curriculum(8))
    same.load_state_dict(state)
    assert [b.tolist() for b in same] == rest


def test_a_curriculum_mixture_refuses_a_checkpoint_of_another_sources_schedule():
    def loader(total: int) -> meshfeed.DataLoader:
        mix = meshfeed.Mixture({"a": DATA, "b": np.arange(500, 620)}, {"a": 1, "b": 1}, seed=0)
        return meshfeed.DataLoader(mix, batch_size=12, seed=2, curriculum={"a": _curriculum(total)})

    run = loader(8)
    it = iter(run)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(run.state_dict()))
    with pytest.raises(ValueError, match=r"curriculum of source 'a' had \d+ eligible samples"):
        loader(40).load_state_dict(state)
    loader(8).load_state_dict(state)
