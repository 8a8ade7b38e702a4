"""Curriculum: entry steps, multi-metric intersection, exact resume, transforms by step."""

from __future__ import annotations

import tracemalloc
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from meshfeed.curriculum import (
    Curriculum,
    CurriculumMetric,
    MetricIndex,
    SeqlenReshape,
    SeqlenTruncate,
    custom,
    fixed_discrete,
    fixed_linear,
    fixed_root,
)
from meshfeed.curriculum import curriculum as curriculum_module
from meshfeed.testing import assert_resume_equivalence
from tests.optional import given, settings, st


def _index(name: str, values: Any) -> MetricIndex:
    values = np.asarray(values)
    return MetricIndex.from_values(name, values, fingerprint={"length": len(values), "hash": "t"})


def _eligible(metrics: list[CurriculumMetric], step: int) -> set[int]:
    """Brute force: the intersection of every metric's eligible set at ``step``."""
    n = len(metrics[0].index)
    out = set(range(n))
    for m in metrics:
        d = m.schedule.difficulty(step)
        if m.difficulty_type == "value":
            ok = {i for i in range(n) if m.index.values[i] <= d}
        else:
            k = int(np.floor(d * n / 100 + 1e-9))
            ok = set(m.index.order[:k].tolist())
        out &= ok
    return out


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(5, 80),
    kind=st.sampled_from(["value", "percentile"]),
    g=st.integers(1, 8),
)
def test_the_pool_is_the_intersection_of_every_metric(seed, n, kind, g):
    rng = np.random.default_rng(seed)
    lengths = _index("len", rng.integers(1, 50, size=n))
    rarity = _index("rarity", rng.random(n) * 10)  # a float metric
    metrics = [
        CurriculumMetric(index=lengths, schedule=fixed_linear(1, 50, 12, 4)),
        CurriculumMetric(
            index=rarity,
            schedule=fixed_root(20, 100, 9, 5, 2)
            if kind == "percentile"
            else fixed_discrete(difficulty=[3.0, 6.5, 10.0], max_step=[3, 6]),
            difficulty_type=kind,
        ),
    ]
    cur = Curriculum(metrics)
    try:
        order = cur.make_order(dataset_length=n, global_batch_size=g, seed=seed)
    except ValueError as e:
        assert "no sample is eligible at step 0" in str(e)
        assert not _eligible(metrics, 0)
        return
    for step in range(16):
        pool = set(order.pool_order[: order.pool_size(step)].tolist())
        assert pool == _eligible(metrics, step), step
        drawn = order.indices(0, np.arange(g)) if step == 0 else None
        if drawn is not None:
            assert set(drawn.tolist()) <= pool


def test_single_metric_pool_is_a_prefix_of_the_sorted_index():
    values = [5, 1, 9, 3, 7, 2, 8, 4, 6, 10]
    idx = _index("m", values)
    cur = Curriculum([CurriculumMetric(index=idx, schedule=fixed_linear(2, 10, 8, 1))])
    order = cur.make_order(dataset_length=10, global_batch_size=2, seed=0)
    assert order.pool_order.tolist() == idx.order.tolist()
    for step in range(10):
        d = cur.difficulties(step)["m"]
        assert order.pool_size(step) == sum(v <= d for v in values)


def test_percentile_difficulty_takes_the_lowest_percent():
    values = np.arange(100)[::-1].copy()  # sample 99 is the easiest
    cur = Curriculum(
        [
            CurriculumMetric(
                index=_index("m", values),
                schedule=fixed_discrete(difficulty=[10, 50, 100], max_step=[0, 1]),
                difficulty_type="percentile",
            )
        ]
    )
    order = cur.make_order(dataset_length=100, global_batch_size=10, seed=3)
    assert [order.pool_size(t) for t in range(3)] == [10, 50, 100]
    assert set(order.indices(0, np.arange(10)).tolist()) == set(range(90, 100))


def test_samples_above_max_difficulty_are_never_drawn():
    cur = Curriculum(
        [CurriculumMetric(index=_index("m", [1, 2, 3, 99]), schedule=fixed_linear(1, 3, 2))]
    )
    order = cur.make_order(dataset_length=4, global_batch_size=3, seed=0)
    assert 3 not in order.indices(5, np.arange(3)).tolist()


class _StandIn:
    """A tiny loader stand-in: global batches of one data rank, state = (epoch, position)."""

    def __init__(self, cur: Curriculum, n: int, g: int, rank: int = 0, world: int = 1) -> None:
        self.cur, self.g, self.rank, self.world = cur, g, rank, world
        self.order = cur.make_order(dataset_length=n, global_batch_size=g, seed=11)
        self.epoch, self.position = 0, 0

    def __next__(self) -> dict[str, Any]:
        if self.position >= self.order.epoch_length(self.epoch):
            self.epoch, self.position = self.epoch + 1, 0
        lo = self.position + self.rank * self.g // self.world
        hi = self.position + (self.rank + 1) * self.g // self.world
        idx = self.order.indices(self.epoch, np.arange(lo, hi))
        step = self.position // self.g
        batch = self.cur.postprocess(
            {"input_ids": torch.tensor(idx).repeat(4, 1).T.contiguous()},
            step=step,
            epoch=self.epoch,
        )
        self.position += self.g
        return {"indices": idx, "batch": batch}

    def __iter__(self) -> _StandIn:
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "epoch": self.epoch,
            "position": self.position,
            "order": self.order.describe(self.epoch, self.position),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def _multi_metric_curriculum(n: int) -> Curriculum:
    rng = np.random.default_rng(5)
    return Curriculum(
        [
            CurriculumMetric(
                index=_index("len", rng.integers(1, 64, n)), schedule=fixed_linear(8, 64, 9, 8)
            ),
            CurriculumMetric(
                index=_index("rarity", rng.random(n)),
                schedule=fixed_root(30, 100, 6, 10, 2),
                difficulty_type="percentile",
            ),
        ],
        transforms=[SeqlenTruncate(schedule=fixed_linear(1, 4, 5))],
    )


def test_resume_is_exact_at_every_step_across_difficulty_changes_and_epochs():
    ref = assert_resume_equivalence(
        lambda: _StandIn(_multi_metric_curriculum(60), 60, 6), num_items=25
    )
    widths = [item["batch"]["input_ids"].shape[1] for item in ref]
    assert widths[:6] == [1, 1, 2, 2, 3, 4]  # the truncation follows the curriculum step


def test_simulated_data_ranks_see_disjoint_slices_of_the_same_global_batch():
    world = 3
    loaders = [
        _StandIn(_multi_metric_curriculum(60), 60, 6, rank=r, world=world) for r in range(world)
    ]
    whole = _StandIn(_multi_metric_curriculum(60), 60, 6)
    for _ in range(25):
        parts = [next(ld)["indices"] for ld in loaders]
        assert np.concatenate(parts).tolist() == next(whole)["indices"].tolist()


def test_seqlen_reshape_keeps_tokens_in_shorter_rows():
    cur = Curriculum(
        transforms=[SeqlenReshape(schedule=fixed_discrete(difficulty=[2, 8], max_step=[0]))]
    )
    x = torch.arange(12).reshape(2, 6)
    out = cur.postprocess({"input_ids": x, "other": x}, epoch=0, step=0)
    assert out["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert out["other"] is x
    assert cur.postprocess(x, epoch=0, step=1) is x  # difficulty 8 >= seq 6: unchanged


def test_postprocess_with_an_epoch_counts_steps_across_epochs():
    cur = Curriculum([], transforms=[SeqlenTruncate(schedule=fixed_linear(1, 100, 100))])
    cur.make_order(dataset_length=10, global_batch_size=5, seed=0)  # 2 steps per epoch
    x = torch.zeros(1, 50)
    assert cur.postprocess(x, step=1, epoch=3).shape == (1, 7)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: Curriculum(
                [CurriculumMetric(index=_index("m", [5, 6, 7, 8]), schedule=fixed_linear(1, 9, 3))]
            ),
            "no sample is eligible at step 0",
        ),
        (
            lambda: Curriculum(
                [CurriculumMetric(index=_index("m", [1, 2, 3]), schedule=fixed_linear(1, 9, 3))]
            ),
            "has 3 samples but the dataset has 4",
        ),
        (
            lambda: Curriculum(
                [CurriculumMetric(index=_index("m", [1] * 4), schedule=custom(lambda t: t))]
            ),
            "has no saturation step",
        ),
        (
            lambda: Curriculum(
                [
                    CurriculumMetric(
                        index=_index("m", [1] * 4),
                        schedule=custom(lambda t: 5 - t, total_curriculum_step=3),
                    )
                ]
            ),
            "the schedule decreases at step 1",
        ),
        (lambda: Curriculum(samples_per_epoch=3), "multiple of the global batch size"),
    ],
)
def test_bad_curricula_are_refused_at_construction(build, message):
    with pytest.raises(ValueError, match=message):
        build().make_order(dataset_length=4, global_batch_size=2, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metrics": [_index("m", [1, 2])]}, "metrics must be CurriculumMetric objects"),
        (
            {"transforms": [fixed_linear(1, 8, 3)]},
            "transforms must be SeqlenTruncate, SeqlenReshape or",
        ),
    ],
)
def test_curriculum_parts_of_the_wrong_type_are_refused(kwargs, message):
    with pytest.raises(TypeError, match=message):
        Curriculum(**kwargs)


def test_bad_difficulty_type_is_refused():
    with pytest.raises(ValueError, match="difficulty_type must be 'value' or 'percentile'"):
        CurriculumMetric(
            index=_index("m", [1]), schedule=fixed_linear(1, 2, 3), difficulty_type="rank"
        )  # type: ignore[arg-type]


def test_the_postprocess_hook_ships_to_workers_without_the_metric_indexes():
    import pickle

    cur = _multi_metric_curriculum(20_000)
    cur.make_order(dataset_length=20_000, global_batch_size=100, seed=0)
    hook = pickle.loads(pickle.dumps(cur.postprocess))
    assert len(pickle.dumps(cur.postprocess)) < 2_000
    assert hook.steps_per_epoch == 200
    assert hook(torch.zeros(2, 9), step=3, epoch=0).shape == (2, 2)


def test_postprocess_needs_the_epoch_from_its_caller():
    cur = Curriculum([], transforms=[SeqlenTruncate(schedule=fixed_linear(1, 100, 100))])
    with pytest.raises(TypeError, match="epoch"):
        cur.postprocess(torch.zeros(1, 50), step=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"epoch=2.*make_order\(\) has run"):
        cur.postprocess(torch.zeros(1, 50), epoch=2, step=1)


@pytest.mark.parametrize(
    "schedule",
    [
        fixed_discrete(difficulty=[49, 99], max_step=[10**7]),
        fixed_linear(10, 99, 10**7),
        fixed_root(10, 99, 10**7, 4, 3),
    ],
    ids=["discrete", "linear", "root"],
)
@pytest.mark.parametrize("kind", ["value", "percentile"])
def test_a_long_schedule_costs_what_the_data_costs_not_one_value_per_step(schedule, kind):
    cur = Curriculum(
        [
            CurriculumMetric(
                index=_index("m", np.arange(100)), schedule=schedule, difficulty_type=kind
            )
        ]
    )
    tracemalloc.start()
    try:
        order = cur.make_order(dataset_length=100, global_batch_size=4, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak} bytes for 100 samples"  # 10**7 steps would be 80 MB
    for step in (0, 1, 10**6, 10**7 - 1, 10**7, 10**7 + 1, 2 * 10**7, 10**12):
        d = schedule.difficulty(step)
        want = sum(v <= d for v in range(100)) if kind == "value" else int(d)
        assert order.pool_size(step) == want, step


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 60),
    kind=st.sampled_from(["value", "percentile"]),
    percentile_max=st.sampled_from([None, 100, 7]),
    total=st.integers(1, 300),
    root=st.sampled_from([1, 2, 3]),
    quantum=st.sampled_from([1, 3, 8]),
)
def test_entry_steps_searched_by_bisection_equal_the_dense_schedule(
    seed, n, kind, percentile_max, total, root, quantum
):
    rng = np.random.default_rng(seed)
    index = _index("m", rng.integers(0, 60, n))
    lo = int(rng.integers(0, 40))
    schedules = [
        fixed_root(lo, lo + int(rng.integers(0, 60)), total, quantum, root),
        fixed_discrete(
            difficulty=sorted(rng.integers(0, 101, 3).tolist()), max_step=[total, 2 * total]
        ),
        custom(lambda t: min(lo + t // 3, 100), total_curriculum_step=total),
    ]
    for schedule in schedules:
        metric = CurriculumMetric(
            index=index,
            schedule=schedule,
            difficulty_type=kind,
            percentile_max=percentile_max if kind == "percentile" else None,
        )
        dense = [metric.entry_steps(in_sorted_order=s) for s in (True, False)]
        with mock.patch.object(curriculum_module, "DENSE_STEPS", 0):
            searched = [metric.entry_steps(in_sorted_order=s) for s in (True, False)]
        for a, b in zip(dense, searched, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_long_custom_schedule_that_decreases_is_refused(monkeypatch):
    monkeypatch.setattr(curriculum_module, "DENSE_STEPS", 0)
    bumpy = custom(lambda t: 50 if 10 <= t < 1000 else 5 + (t >= 1000), total_curriculum_step=2000)
    cur = Curriculum([CurriculumMetric(index=_index("m", np.arange(60)), schedule=bumpy)])
    with pytest.raises(ValueError, match="the schedule decreases between steps"):
        cur.make_order(dataset_length=60, global_batch_size=4, seed=0)


def test_a_pool_change_no_run_reaches_leaves_the_pool_as_it_is():
    schedule = fixed_discrete(difficulty=[49, 99], max_step=[2**61])  # batch 2**61 * 4 samples
    cur = Curriculum([CurriculumMetric(index=_index("m", np.arange(100)), schedule=schedule)])
    order = cur.make_order(dataset_length=100, global_batch_size=4, seed=0)
    drawn = order.indices(3, np.arange(100))
    assert set(drawn.tolist()) == set(range(50))


def _reference_pool(metrics: list[CurriculumMetric], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The pool by definition: per sample and metric, one search of its value (or rank) in
    the schedule's thresholds in dataset order; the latest step over metrics; a stable sort."""
    never = np.iinfo(np.int64).max
    entry = np.zeros(n, dtype=np.int64)
    for m in metrics:
        thr = m.thresholds()
        if m.difficulty_type == "value":
            mine = np.searchsorted(thr, np.asarray(m.index.values), side="left")
        else:
            rank = np.empty(n, dtype=np.int64)
            rank[np.asarray(m.index.order)] = np.arange(n)
            mine = np.searchsorted(m.percentile_counts(thr), rank, side="right")
        mine = mine.astype(np.int64)
        mine[mine > len(thr) - 1] = never
        np.maximum(entry, mine, out=entry)
    if len(metrics) == 1:  # one metric: its index's own order (by value), entry never falls
        order = np.asarray(metrics[0].index.order)
    else:
        order = np.argsort(entry, kind="mergesort")
    keep = int(np.searchsorted(entry[order], never, side="left"))
    return order[:keep], entry[order][:keep]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 300),
    kinds=st.lists(st.sampled_from(["value", "percentile", "capped"]), min_size=1, max_size=3),
    steps=st.sampled_from([1, 7, 40, 70_000]),
)
def test_the_pool_and_its_order_are_the_definitions(seed, n, kinds, steps):
    """Entry steps written out along the sorted index, and the 16-bit radix sort (schedules
    under 65,535 steps) or the merge sort, give the pool order the definition gives: ties in
    dataset order (one metric: in its index's order)."""
    rng = np.random.default_rng(seed)
    metrics = []
    for k, kind in enumerate(kinds):
        values = rng.integers(0, 12, size=n) if k % 2 else rng.random(n).round(1) * 10
        metrics.append(
            CurriculumMetric(
                index=_index(f"m{k}", values),
                schedule=fixed_linear(2 if kind == "value" else 10, 100, steps, 1),
                difficulty_type="value" if kind == "value" else "percentile",
                percentile_max=100 if kind == "capped" else None,
            )
        )
    want_order, want_entry = _reference_pool(metrics, n)
    if not len(want_order) or want_entry[0] > 0:
        with pytest.raises(ValueError, match="no sample is eligible"):
            Curriculum(metrics).pool(n)
        return
    order, entry = Curriculum(metrics).pool(n)
    assert order.tolist() == want_order.tolist()
    assert entry.tolist() == want_entry.tolist()
    for m in metrics:
        sorted_entry = m.entry_steps(in_sorted_order=True)
        assert (
            sorted_entry.tolist()
            == m.entry_steps(in_sorted_order=False)[np.asarray(m.index.order)].tolist()
        )
