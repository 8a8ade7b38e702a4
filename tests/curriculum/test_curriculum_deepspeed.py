"""from_deepspeed_config: a DeepSpeed user points at their config and gets the same pacing."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from meshfeed.curriculum import (
    Curriculum,
    CurriculumMetric,
    MetricIndex,
    ReportedDifficulty,
    SeqlenReshape,
    SeqlenTruncate,
    fixed_root,
    from_deepspeed_config,
)
from meshfeed.curriculum.schedule import FixedDiscrete, FixedRoot

CONFIG = {
    "train_batch_size": 8,
    "data_efficiency": {
        "enabled": True,
        "seed": 1234,
        "data_sampling": {
            "enabled": True,
            "num_workers": 0,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": "/tmp/clusters",
                "curriculum_metrics": {
                    "vocabularyrarity": {
                        "index_to_sample_path": "/nonexistent/index_to_sample",
                        "index_to_metric_path": "/nonexistent/index_to_metric",
                        "difficulty_type": "percentile",
                        "clustering_type": "schedule_based",
                        "min_difficulty": 1,
                        "max_difficulty": 100,
                        "schedule_type": "fixed_root",
                        "schedule_config": {
                            "total_curriculum_step": 110000,
                            "difficulty_step": 1,
                            "root_degree": 2,
                        },
                    },
                    "seqlen_truncate": {
                        "clustering_type": "single_cluster",
                        "min_difficulty": 80,
                        "max_difficulty": 2048,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 8},
                    },
                },
            },
        },
    },
}


def _index(tmp_path, n: int = 20) -> MetricIndex:
    index = MetricIndex.from_values(
        "vocabularyrarity",
        np.random.default_rng(0).random(n),
        fingerprint={"length": n, "hash": "t"},
    )
    index.save(tmp_path / "vocabularyrarity")
    return index


def test_data_efficiency_section_becomes_a_gating_metric_and_a_transform(tmp_path):
    index = _index(tmp_path)
    cur = from_deepspeed_config(CONFIG, indexes={"vocabularyrarity": index})
    (metric,) = cur.metrics
    assert metric.difficulty_type == "percentile" and metric.index is index
    assert metric.schedule == fixed_root(1, 100, 110000, 1, 2)
    (transform,) = cur.transforms
    assert isinstance(transform, SeqlenTruncate)
    assert isinstance(transform.schedule, FixedRoot) and transform.schedule.root_degree == 1
    assert cur.difficulties(55000) == {"vocabularyrarity": 71, "seqlen_truncate": 1064}


def test_a_json_path_and_an_index_directory_are_accepted(tmp_path):
    _index(tmp_path, n=200)
    cfg = json.loads(json.dumps(CONFIG))
    metrics = cfg["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"]
    metrics["vocabularyrarity"]["index_to_metric_path"] = str(tmp_path / "vocabularyrarity")
    metrics["seqlen_reshape"] = metrics.pop("seqlen_truncate")
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    cur = from_deepspeed_config(tmp_path / "ds.json")
    assert len(cur.metrics[0].index) == 200
    assert isinstance(cur.transforms[0], SeqlenReshape)
    order = cur.make_order(dataset_length=200, global_batch_size=4, seed=0)
    assert order.pool_size(0) == 2  # the lowest 1 percent


def test_legacy_seqlen_curriculum_becomes_truncation():
    cfg = {
        "curriculum_learning": {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": 8,
            "max_difficulty": 1024,
            "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [8, 64, 1024], "max_step": [10, 20]},
        }
    }
    cur = from_deepspeed_config(cfg)
    (t,) = cur.transforms
    assert isinstance(t.schedule, FixedDiscrete)
    assert [t.schedule.difficulty(s) for s in (0, 10, 11, 21)] == [8, 8, 64, 1024]


def test_a_gating_metric_without_a_meshfeed_index_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"run `meshfeed analyze` and pass indexes="):
        from_deepspeed_config(CONFIG)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({}, "enables no curriculum"),
        (
            {"curriculum_learning": {"enabled": True, "schedule_type": "fixed_linear"}},
            "missing 'schedule_config'",
        ),
        (
            {
                "curriculum_learning": {
                    "enabled": True,
                    "schedule_type": "custom",
                    "schedule_config": {},
                }
            },
            "schedule_type 'custom' is not supported from JSON",
        ),
    ],
)
def test_bad_configs_are_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        from_deepspeed_config(cfg)


def _without_enabled(*path: str) -> dict:
    cfg = json.loads(json.dumps(CONFIG))
    section = cfg["data_efficiency"]
    for key in path:
        section = section[key]
    del section["enabled"]
    return cfg


@pytest.mark.parametrize(
    ("path", "switch"),
    [
        ((), "data_efficiency.enabled"),
        (("data_sampling",), "data_efficiency.data_sampling.enabled"),
        (
            ("data_sampling", "curriculum_learning"),
            "data_efficiency.data_sampling.curriculum_learning.enabled",
        ),
    ],
)
def test_data_efficiency_switches_default_to_false_as_in_deepspeed(tmp_path, path, switch):
    _index(tmp_path)
    cfg = _without_enabled(*path)
    with pytest.raises(
        ValueError,
        match=rf"enables no curriculum; its curriculum_learning section is ignored because "
        rf"{re.escape(switch)} is not true \(DeepSpeed defaults each to false\)",
    ):
        from_deepspeed_config(cfg, indexes={"vocabularyrarity": tmp_path / "vocabularyrarity"})


def _seqlen_config(**schedule) -> dict:
    metric = {
        "index_to_sample_path": "unused",
        "index_to_metric_path": "unused",
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        "min_difficulty": 2,
        "max_difficulty": 10,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2},
    }
    metric.update(schedule)
    return {
        "data_efficiency": {
            "enabled": True,
            "data_sampling": {
                "enabled": True,
                "curriculum_learning": {"enabled": True, "curriculum_metrics": {"seqlen": metric}},
            },
        }
    }


def _lengths(n: int = 6_000) -> MetricIndex:
    values = np.random.default_rng(0).integers(1, 11, size=n)
    return MetricIndex.from_values("seqlen", values, fingerprint={"length": n, "hash": "d"})


def test_batch_n_gets_the_difficulty_of_step_n_plus_one_as_in_deepspeeds_sampler():
    cur = from_deepspeed_config(_seqlen_config(), indexes={"seqlen": _lengths()})
    order = cur.make_order(dataset_length=6_000, global_batch_size=4, seed=0)
    # DeepSpeed: [2, 4, 4, 6, 6, 8] for the first six batches (its step starts at 1).
    assert [order.describe(0, 4 * (n + 1))["difficulty"]["seqlen"] for n in range(6)] == [
        2,
        4,
        4,
        6,
        6,
        8,
    ]
    plain = Curriculum([CurriculumMetric(index=_lengths(), schedule=fixed_root(2, 10, 8, 2, 1))])
    assert plain.first_step == 0 and cur.first_step == 1


def test_percentile_pools_from_a_deepspeed_config_use_deepspeeds_count():
    values = np.random.default_rng(3).random(250)
    index = MetricIndex.from_values("rarity", values, fingerprint={"length": 250, "hash": "r"})
    cfg = _seqlen_config(
        difficulty_type="percentile",
        min_difficulty=5,
        max_difficulty=100,
        schedule_config={"total_curriculum_step": 95, "difficulty_step": 1},
    )
    cur = from_deepspeed_config(cfg, indexes={"seqlen": index})
    (metric,) = cur.metrics
    # N=250, p=5: DeepSpeed (250 // 100) * 5 = 10; meshfeed's own rule floor(5 * 250 / 100) = 12.
    assert metric.percentile_counts(np.array([5, 50, 99, 100])).tolist() == [10, 100, 198, 250]
    own = CurriculumMetric(index=index, schedule=metric.schedule, difficulty_type="percentile")
    assert own.percentile_counts(np.array([5])).tolist() == [12]
    order = cur.make_order(dataset_length=250, global_batch_size=10, seed=0)
    assert order.pool_size(0) == 10  # difficulty 5: (250 // 100) * 5
    assert order.pool_size(1) == 12  # batch 0 is step 1: difficulty 6, (250 // 100) * 6


def test_the_config_of_deepspeeds_own_curriculum_test_loads():
    """tests/unit/runtime/test_data_efficiency.py::test_curriculum_learning (DeepSpeed)."""
    cfg = {
        "train_batch_size": 2,
        "data_efficiency": {
            "enabled": True,
            "seed": 1234,
            "data_sampling": {
                "enabled": True,
                "num_workers": 0,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": "/tmp",
                    "curriculum_metrics": {
                        "dummy_metric": {
                            "index_to_sample_path": "dummy",
                            "index_to_metric_path": "dummy",
                            "difficulty_type": "value",
                            "clustering_type": "single_cluster",
                            "min_difficulty": 2,
                            "max_difficulty": 10,
                            "schedule_type": "fixed_root",
                            "schedule_config": {
                                "total_curriculum_step": 8,
                                "difficulty_step": 2,
                                "root_degree": 1,
                            },
                        }
                    },
                },
            },
        },
    }
    cur = from_deepspeed_config(cfg)
    (reported,) = cur.transforms
    assert isinstance(reported, ReportedDifficulty) and reported.name == "dummy_metric"
    assert not cur.metrics  # single_cluster gates nothing, as in DeepSpeed
    assert [cur.difficulties(t)["dummy_metric"] for t in range(1, 7)] == [2, 4, 4, 6, 6, 8]
    batch = {"x": np.zeros((2, 3))}
    assert cur.postprocess(batch, step=0, epoch=0) is batch
