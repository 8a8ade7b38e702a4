"""meshfeed.DataLoader(curriculum=...): workers, mesh slicing, exact and elastic resume."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from meshfeed import DataLoader
from meshfeed.curriculum import (
    Curriculum,
    CurriculumMetric,
    MetricIndex,
    SeqlenTruncate,
    fixed_linear,
    fixed_root,
)
from meshfeed.testing import assert_resume_equivalence, take

N = 96


class Docs:
    """Sample i: a fixed-width row of token ids whose "length" metric is known."""

    def __init__(self, n: int = N) -> None:
        self.lengths = np.random.default_rng(1).integers(1, 33, size=n)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.full((16,), int(i)), "length": int(self.lengths[i])}


def make_curriculum(ds: Docs) -> Curriculum:
    lengths = MetricIndex.from_values(
        "length", ds.lengths, fingerprint={"length": len(ds), "hash": "docs"}
    )
    rarity = MetricIndex.from_values(
        "rarity",
        np.random.default_rng(2).random(len(ds)),
        fingerprint={"length": len(ds), "hash": "docs"},
    )
    return Curriculum(
        [
            CurriculumMetric(index=lengths, schedule=fixed_linear(8, 32, 10, 4)),
            CurriculumMetric(
                index=rarity, schedule=fixed_root(40, 100, 8, 10, 2), difficulty_type="percentile"
            ),
        ],
        transforms=[SeqlenTruncate(schedule=fixed_linear(4, 16, 12, 4))],
    )


def _loader(num_workers: int = 0, dp: int = 1, rank: int = 0, batch: int = 8) -> DataLoader:
    ds = Docs()
    return DataLoader(
        ds,
        batch_size=batch,
        mesh={"dp": dp},
        rank=rank,
        seed=7,
        num_workers=num_workers,
        curriculum=make_curriculum(ds),
    )


def _close(loader: DataLoader) -> None:
    loader.shutdown()


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_loader_resumes_exactly_at_every_step_across_difficulty_changes(num_workers):
    ref = assert_resume_equivalence(
        lambda: _loader(num_workers),
        num_items=26,
        cleanup=_close,
        every=1,
    )
    ds = Docs()
    cur = make_curriculum(ds)
    order = cur.make_order(dataset_length=N, global_batch_size=8, seed=7)
    for step, batch in enumerate(ref):
        eligible = set(order.pool_order[: order.pool_size(step)].tolist())
        assert set(batch["input_ids"][:, 0].tolist()) <= eligible
        width = cur.difficulties(step)["seqlen_truncate"]
        assert batch["input_ids"].shape == (8, min(16, width))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_reports_the_curriculum_step_of_the_last_returned_batch(num_workers):
    loader = _loader(num_workers=num_workers)  # workers prefetch ahead; the step must not
    take(loader, 5)
    facts = loader.state_dict()["order"]
    assert facts["step"] == 4
    assert facts["difficulty"] == make_curriculum(Docs()).difficulties(4)
    loader.shutdown()


def test_data_ranks_slice_the_global_batch_and_resume_elastically():
    whole = [b["input_ids"][:, 0].tolist() for b in take(_loader(dp=1, batch=8), 20)]
    halves = [take(_loader(dp=2, rank=r, batch=4), 20) for r in range(2)]
    for step in range(20):
        got = (
            halves[0][step]["input_ids"][:, 0].tolist()
            + halves[1][step]["input_ids"][:, 0].tolist()
        )
        assert got == whole[step]
    # Checkpoint on 2 data ranks, resume on 4 with the same global batch.
    two = _loader(dp=2, rank=1, batch=4)
    take(two, 7)
    state = two.state_dict()
    four = [_loader(dp=4, rank=r, batch=2) for r in range(4)]
    for ld in four:
        ld.load_state_dict(state)
    parts = [take(ld, 5) for ld in four]
    for k in range(5):
        got = [i for r in range(4) for i in parts[r][k]["input_ids"][:, 0].tolist()]
        assert got == whole[7 + k]


class _Tokens:
    """The issue's corpus: 6,000 documents of 1-10 tokens."""

    def __init__(self, n: int = 6_000) -> None:
        self.lengths = np.random.default_rng(0).integers(1, 11, size=n)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> int:
        return int(self.lengths[i])


def test_the_pacing_schedule_is_honoured_at_every_batch_like_deepspeeds_sampler():
    """fixed_linear(2, 10, 8, difficulty_step=2), global batch 256: the longest document per
    batch must reach DeepSpeed's allowed maximum [2, 4, 4, 6, 6, 8, 8, 10, 10, 10] (main gave
    [2, 2, 2, 2, 6, 6, 6, 6, 6, 6] by walking each pool to its end first)."""
    from meshfeed.curriculum import from_deepspeed_config

    ds = _Tokens()
    index = MetricIndex.from_values("seqlen", ds.lengths, fingerprint={"length": 6000, "hash": "t"})
    cfg = {
        "data_efficiency": {
            "enabled": True,
            "data_sampling": {
                "enabled": True,
                "curriculum_learning": {
                    "enabled": True,
                    "curriculum_metrics": {
                        "seqlen": {
                            "difficulty_type": "value",
                            "clustering_type": "schedule_based",
                            "min_difficulty": 2,
                            "max_difficulty": 10,
                            "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2},
                        }
                    },
                },
            },
        }
    }
    cur = from_deepspeed_config(cfg, indexes={"seqlen": index}, samples_per_epoch=256 * 10)
    loader = DataLoader(ds, batch_size=256, seed=0, collate_fn=list, curriculum=cur)
    longest = [max(batch) for batch in take(loader, 10)]
    assert longest == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]
    # Without DeepSpeed's step rule the same schedule is one batch later, and still never lags.
    plain = Curriculum([CurriculumMetric(index=index, schedule=fixed_linear(2, 10, 8, 2))])
    loader = DataLoader(ds, batch_size=256, seed=0, collate_fn=list, curriculum=plain)
    assert [max(b) for b in take(loader, 10)] == [2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
