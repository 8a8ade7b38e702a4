"""DeepSpeed's own curriculum code and meshfeed on the same inputs (pip install '.[peers]').

DeepSpeed's ``CurriculumScheduler`` and ``DeepSpeedDataSampler`` (with its metric index files
built by DeepSpeed's own builder, on a one-process gloo group) run next to meshfeed's schedules,
``from_deepspeed_config`` and ``DataLoader``: difficulties over a grid of schedules and steps,
the per-batch difficulty and longest document of the sampler, percentile pools and DeepSpeed's
own test config. Skipped, with the reason, when DeepSpeed is not importable.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is a peer test dependency: pip install '.[peers]'"
)

import torch.distributed as torch_dist
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import (
    DeepSpeedDataSampler,
)
from deepspeed.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
)

from meshfeed import DataLoader
from meshfeed.curriculum import MetricIndex, from_deepspeed_config
from meshfeed.curriculum.deepspeed import schedule_from_deepspeed


@pytest.fixture(scope="module")
def ds_group() -> Iterator[Any]:
    """A one-process gloo group: DeepSpeed's sampler calls barriers on it."""
    import deepspeed
    import deepspeed.comm as ds_comm

    if torch_dist.is_initialized():
        pytest.skip("a process group already exists in this process; run the peer tests alone")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    old = {k: os.environ.get(k) for k in [*env, "LOCAL_RANK"]}
    os.environ.update(env | {"LOCAL_RANK": "0"})
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    try:
        yield ds_comm.new_group([0])
    finally:
        torch_dist.destroy_process_group()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _metric_files(tmp: Path, values: np.ndarray, name: str) -> dict[str, str]:
    """DeepSpeed's index_to_sample / index_to_metric files, written with DeepSpeed's builder.

    Value rows: one per distinct value (ascending) with its sample ids. Percentile rows: the
    same, so the rows in order are the samples sorted by value (DeepSpeed's analyzer layout).
    """
    order = np.argsort(values, kind="stable")
    distinct = np.unique(values)
    i2s, i2m = str(tmp / f"{name}_index_to_sample"), str(tmp / f"{name}_index_to_metric")
    builder = create_mmap_dataset_builder(i2s, np.int64)
    for v in distinct:
        builder.add_item_numpy(order[values[order] == v].astype(np.int64))
    close_mmap_dataset_builder(builder, i2s)
    builder = create_mmap_dataset_builder(i2m, np.int64)
    for v in distinct:
        builder.add_item_numpy(np.array([v], dtype=np.int64))
    close_mmap_dataset_builder(builder, i2m)
    return {"index_to_sample_path": i2s, "index_to_metric_path": i2m}


def _config(tmp: Path, metrics: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_efficiency": {
            "enabled": True,
            "seed": 1234,
            "data_sampling": {
                "enabled": True,
                "num_epochs": 1,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": str(tmp / "clusters"),
                    "curriculum_metrics": metrics,
                },
            },
        }
    }


def _sampler(cfg: dict[str, Any], n: int, batch: int, group: Any) -> DeepSpeedDataSampler:
    return DeepSpeedDataSampler(cfg["data_efficiency"], n, batch, 0, 1, group, 1, 0)


# ------------------------------------------------------------------ schedules
def _grid() -> Iterator[dict[str, Any]]:
    for lo, hi, total, step in itertools.product(
        (1, 2, 8, 10, 64), (10, 100, 1024), (1, 7, 100), (1, 2, 8, 16)
    ):
        if lo > hi:
            continue
        yield {
            "schedule_type": "fixed_linear",
            "min_difficulty": lo,
            "max_difficulty": hi,
            "schedule_config": {"total_curriculum_step": total, "difficulty_step": step},
        }
        for root in (1, 2, 3):
            yield {
                "schedule_type": "fixed_root",
                "min_difficulty": lo,
                "max_difficulty": hi,
                "schedule_config": {
                    "total_curriculum_step": total,
                    "difficulty_step": step,
                    "root_degree": root,
                },
            }
    yield {
        "schedule_type": "fixed_discrete",
        "min_difficulty": 1,
        "max_difficulty": 3,
        "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]},
    }
    yield {
        "schedule_type": "fixed_linear",
        "min_difficulty": 0.0,
        "max_difficulty": 1.0,
        "schedule_config": {"total_curriculum_step": 3, "difficulty_step": 0.1},
    }
    yield {
        "schedule_type": "fixed_linear",
        "min_difficulty": 0.5,
        "max_difficulty": 2.5,
        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 0.25},
    }


def test_difficulties_equal_deepspeeds_scheduler_over_a_grid_of_schedules_and_steps():
    checked = 0
    for cfg in _grid():
        ours = schedule_from_deepspeed(cfg)
        theirs = CurriculumScheduler(cfg)
        total = cfg["schedule_config"].get("total_curriculum_step", 12)
        steps = sorted({*range(0, 2 * total + 3), 5 * total, 10**6})
        expected = [theirs.get_difficulty(t) for t in steps]
        got = ours.difficulties(np.asarray(steps)).tolist()
        assert got == expected, cfg
        assert min(got) >= cfg["min_difficulty"]  # never below the minimum
        checked += len(steps)
    assert checked > 10_000


# ------------------------------------------------------------------ the sampler
def _seqlen_metric(files: dict[str, str]) -> dict[str, Any]:
    return files | {
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        "min_difficulty": 2,
        "max_difficulty": 10,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2},
    }


class _Lengths:
    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> int:
        return int(self.lengths[i])


def test_per_batch_difficulty_and_longest_document_equal_deepspeeds_sampler(tmp_path, ds_group):
    """The issue's case: 6,000 docs of 1-10 tokens, fixed_linear(2, 10, 8, 2), batch 256."""
    lengths = np.random.default_rng(0).integers(1, 11, size=6_000)
    cfg = _config(
        tmp_path,
        {"seqlen": _seqlen_metric(_metric_files(tmp_path, lengths, "s"))},
    )
    sampler = _sampler(cfg, 6_000, 256, ds_group)
    batches = iter(sampler)
    index = MetricIndex.from_values("seqlen", lengths, fingerprint={"length": 6000, "hash": "l"})
    cur = from_deepspeed_config(cfg, indexes={"seqlen": index}, samples_per_epoch=256 * 23)
    loader = DataLoader(_Lengths(lengths), batch_size=256, seed=0, collate_fn=list, curriculum=cur)
    ds_hardest, ds_difficulty, ours_hardest, ours_difficulty = [], [], [], []
    it = iter(loader)
    for _ in range(23):
        batch = next(batches)
        ds_hardest.append(int(lengths[batch].max()))
        ds_difficulty.append(sampler.current_difficulties["seqlen"])
        ours_hardest.append(max(next(it)))
        ours_difficulty.append(loader.state_dict()["order"]["difficulty"]["seqlen"])
    assert ours_difficulty == ds_difficulty  # batch n at curriculum step n + 1
    assert ds_hardest[:10] == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]
    assert ours_hardest == ds_hardest  # every batch reaches the difficulty DeepSpeed allows


def test_percentile_pools_equal_deepspeeds(tmp_path, ds_group):
    n = 250  # not a multiple of 100: (N // 100) * p differs from floor(p * N / 100)
    values = np.random.default_rng(1).permutation(n)
    metric = _metric_files(tmp_path, values, "r") | {
        "difficulty_type": "percentile",
        "clustering_type": "schedule_based",
        "min_difficulty": 5,
        "max_difficulty": 100,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 95, "difficulty_step": 1},
    }
    cfg = _config(tmp_path, {"rarity": metric})
    sampler = _sampler(cfg, n, 10, ds_group)
    index = MetricIndex.from_values("rarity", values, fingerprint={"length": n, "hash": "r"})
    (ours,) = from_deepspeed_config(cfg, indexes={"rarity": index}).metrics
    for p in (1, 5, 33, 50, 99, 100):
        theirs = sampler.get_sample_based_on_metric_percentile("rarity", 0, p)
        assert ours.percentile_counts(np.array([p])).tolist() == [len(theirs)], p
        # The same samples: the lowest values.
        assert sorted(theirs.tolist()) == sorted(np.argsort(values)[: len(theirs)].tolist())


def test_deepspeeds_own_test_config_runs_in_both(tmp_path, ds_group):
    """DeepSpeed's test_curriculum_learning config: a single_cluster dummy_metric."""
    metric = {
        "index_to_sample_path": "dummy",
        "index_to_metric_path": "dummy",
        "difficulty_type": "value",
        "clustering_type": "single_cluster",
        "min_difficulty": 2,
        "max_difficulty": 10,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2, "root_degree": 1},
    }
    cfg = _config(tmp_path, {"dummy_metric": metric})
    sampler = _sampler(cfg, 20, 2, ds_group)
    it = iter(sampler)
    cur = from_deepspeed_config(cfg)
    for n in range(10):
        batch = next(it)
        assert len(batch) == 2
        assert cur.difficulties(n + cur.first_step) == dict(sampler.current_difficulties)
