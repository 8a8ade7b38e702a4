"""Megatron's BalancedCPScheduler and meshfeed's schedule_documents on the same documents.

Megatron's scheduler code runs as shipped in megatron-core (``pip install -e .[peers]``);
skipped with the reason otherwise. Both are judged by the same rules: every document once,
the per-rank token budget held, the same number of groups on every rank, and the makespan of
Megatron's own execution loop (per group: each rank runs its sub-samples in order, a sub-sample
shared by k ranks starts when all k are there and costs ``s**2 / k``, a barrier ends the group).
"""

from __future__ import annotations

import warnings
from math import ceil, log2

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hybrid_cp_schedule = pytest.importorskip(
        "megatron.core.pipeline_parallel.hybrid_cp_schedule",
        reason="megatron-core is not installed; pip install -e .[peers] runs Megatron's own code",
    )

from meshfeed.balance.megatron import MEGATRON_COST, _sample_id_groups
from meshfeed.balance.schedule import schedule_documents

MAX_LEN = 4096


class _Group:
    """The one thing BalancedCPScheduler asks of its process group: its size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def megatron_groups(lengths: np.ndarray, ranks: int) -> list[list[list[int]]]:
    scheduler = hybrid_cp_schedule.BalancedCPScheduler(
        max_seq_len_per_rank=MAX_LEN, dp_cp_group=_Group(ranks)
    )
    pairs = [(i, int(s)) for i, s in enumerate(lengths)]
    _, groups = scheduler.get_groups_and_subsamples(pairs, None)
    return [[list(g[r]) if r < len(g) else [] for r in range(ranks)] for g in groups]


def meshfeed_groups(lengths: np.ndarray, ranks: int, mode: str = "one") -> list[list[list[int]]]:
    placement = schedule_documents(
        lengths, num_ranks=ranks, max_tokens=MAX_LEN, cost=MEGATRON_COST, cp_sizes="pow2_aligned"
    )
    return _sample_id_groups(placement, mode)


def run_megatron_loop(groups: list[list[list[int]]], lengths: np.ndarray, ranks: int) -> float:
    """Finish time of Megatron's hybrid-CP loop over these groups (raises on a deadlock)."""
    clock = np.zeros(ranks)
    for g in groups:
        holders: dict[int, list[int]] = {}
        for r in range(ranks):
            for d in g[r]:
                holders.setdefault(d, []).append(r)
        pos = [0] * ranks
        left = sum(len(x) for x in g)
        while left:
            moved = False
            for d, rs in holders.items():
                if all(pos[r] < len(g[r]) and g[r][pos[r]] == d for r in rs):
                    start = max(clock[r] for r in rs)
                    for r in rs:
                        clock[r] = start + float(lengths[d]) ** 2 / len(rs)
                        pos[r] += 1
                    left -= len(rs)
                    moved = True
            assert moved, "the groups deadlock: two ranks wait for each other"
        clock[:] = clock.max()
    return float(clock.max())


def check_rules(groups: list[list[list[int]]], lengths: np.ndarray, ranks: int) -> None:
    """Every document once (on a power-of-two block of ranks), budget held, equal group counts."""
    assert all(len(g) == ranks for g in groups)
    seen: dict[int, list[int]] = {}
    for g in groups:
        for r in range(ranks):
            assert len(set(g[r])) == len(g[r])
            for d in g[r]:
                seen.setdefault(d, []).append(r)
    assert sorted(seen) == list(range(lengths.size)), "every document exactly once"
    for d, rs in seen.items():
        k = len(rs)
        assert k == 2 ** ceil(log2(k)), f"document {d} on {k} ranks, not a power of two"
        assert ceil(int(lengths[d]) / k) <= MAX_LEN, f"document {d} over the budget per rank"


def scenarios() -> list[tuple[int, int, str, int]]:
    # (ranks, documents, distribution, seed): Megatron's setting (DP x CP of 2..16 ranks,
    # documents up to ranks x budget) over short, log-normal and long-tailed lengths.
    return [
        (ranks, docs, dist, seed)
        for ranks in (2, 4, 8, 16)
        for docs, dist in ((ranks, "lognormal"), (4 * ranks, "lognormal"), (2 * ranks, "longtail"))
        for seed in range(3)
    ]


def lengths_for(ranks: int, docs: int, dist: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "lognormal":
        s = rng.lognormal(7.0, 1.2, size=docs)
    else:
        s = np.where(rng.random(docs) < 0.1, rng.uniform(0.3, 1.0, docs) * MAX_LEN * ranks, 200)
    return np.clip(s.astype(np.int64), 1, MAX_LEN * ranks)


@pytest.mark.parametrize("ranks,docs,dist,seed", scenarios())
def test_both_schedulers_keep_the_rules_on_the_same_documents(ranks, docs, dist, seed):
    lengths = lengths_for(ranks, docs, dist, seed)
    check_rules(megatron_groups(lengths, ranks), lengths, ranks)
    check_rules(meshfeed_groups(lengths, ranks), lengths, ranks)
    check_rules(meshfeed_groups(lengths, ranks, "microsteps"), lengths, ranks)


def test_meshfeed_makespan_is_not_worse_than_megatrons():
    ratios = []
    for ranks, docs, dist, seed in scenarios():
        lengths = lengths_for(ranks, docs, dist, seed)
        ours = run_megatron_loop(meshfeed_groups(lengths, ranks), lengths, ranks)
        theirs = run_megatron_loop(megatron_groups(lengths, ranks), lengths, ranks)
        ratios.append(ours / theirs)
    worst = max(ratios)
    assert worst <= 1.0 + 1e-9, f"meshfeed slower than Megatron: ratios {sorted(ratios)[-5:]}"
    print(f"makespan meshfeed / Megatron: median {np.median(ratios):.3f}, worst {worst:.3f}")
