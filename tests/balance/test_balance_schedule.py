from __future__ import annotations

import numpy as np
import pytest

from meshfeed.balance import CostModel, naive_slicing, schedule_documents, token_balancing
from meshfeed.balance.synthetic import sample_batch
from tests.optional import given, settings, st

from .checks import check_placement, simulate

S2 = CostModel(quadratic=1.0)
LQ = CostModel(linear=8192.0, quadratic=1.0, per_step=1e6)

lengths_st = st.lists(st.integers(0, 5000), min_size=0, max_size=60).map(np.asarray)


@settings(max_examples=40, deadline=None)
@given(
    lengths=lengths_st,
    num_ranks=st.integers(1, 12),
    max_tokens=st.integers(512, 4096),
    policy=st.sampled_from(["any", "pow2_aligned", "list"]),
    tp=st.sampled_from([1, 2]),
    cost=st.sampled_from([S2, LQ, CostModel(linear=1.0)]),
)
def test_plan_respects_budget_places_each_document_once_with_equal_microsteps(
    lengths, num_ranks, max_tokens, policy, tp, cost
):
    cp_sizes = [1, 2, 3] if policy == "list" else policy
    if policy == "list" and num_ranks < 3:
        cp_sizes = list(range(1, num_ranks + 1))
    try:
        p = schedule_documents(
            lengths, num_ranks=num_ranks, max_tokens=max_tokens, cost=cost, cp_sizes=cp_sizes, tp=tp
        )
    except ValueError as e:
        assert "more than" in str(e)  # only the documented too-long error
        return
    check_placement(p, lengths, cost, aligned=policy == "pow2_aligned")
    again = schedule_documents(
        lengths, num_ranks=num_ranks, max_tokens=max_tokens, cost=cost, cp_sizes=cp_sizes, tp=tp
    )
    assert again.microsteps == p.microsteps and again.makespan == p.makespan


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["lognormal", "longtail"])
def test_plan_is_near_the_lower_bound_and_beats_baselines_on_heavy_tails(seed, kind):
    lengths = sample_batch(kind, tokens=16 * 32768 * 4, seed=seed)
    for cost in (S2, LQ):
        p = schedule_documents(lengths, num_ranks=16, max_tokens=32768, cost=cost)
        check_placement(p, lengths, cost)
        assert p.makespan / p.lower_bound <= 1.10
        for base in (naive_slicing, token_balancing):
            assert p.makespan <= base(lengths, num_ranks=16, max_tokens=32768, cost=cost).makespan


def test_plan_splits_an_expensive_document_for_balance_not_only_memory():
    lengths = np.asarray([4000] + [500] * 40)  # every document fits one rank
    p = schedule_documents(lengths, num_ranks=4, max_tokens=4096, cost=S2)
    assert p.cp_size[0] > 1
    assert p.imbalance < 0.05


def test_plan_with_pow2_aligned_uses_power_of_two_blocks_on_aligned_ranks():
    lengths = sample_batch("longtail", tokens=6 * 8192 * 3, seed=3)
    p = schedule_documents(lengths, num_ranks=6, max_tokens=8192, cost=S2, cp_sizes="pow2_aligned")
    check_placement(p, lengths, S2, aligned=True)
    assert set(p.cp_size.tolist()) <= {1, 2, 4}


def test_plan_pads_split_documents_for_sequence_parallelism():
    p = schedule_documents([10_000, 100], num_ranks=4, max_tokens=4096, cost=S2, tp=2)
    c = int(p.cp_size[0])
    assert c >= 3 and p.padded[0] % (4 * c) == 0


def test_plan_of_an_empty_batch_gives_every_rank_one_empty_microstep():
    p = schedule_documents([], num_ranks=3, max_tokens=100, cost=S2)
    assert p.microsteps == (((),),) * 3
    assert p.makespan == 0.0 and p.imbalance == 0.0 and p.packing_efficiency == 0.0


def test_plan_rejects_a_document_longer_than_all_ranks_can_hold():
    with pytest.raises(ValueError, match=r"document 1 has 9000 tokens, more than 4 ranks"):
        schedule_documents([10, 9000], num_ranks=4, max_tokens=2048, cost=S2)


def test_plan_of_all_tiny_documents_packs_them_densely():
    lengths = np.ones(1000, dtype=np.int64)
    p = schedule_documents(lengths, num_ranks=5, max_tokens=100, cost=LQ)
    check_placement(p, lengths, LQ)
    assert p.num_microsteps == 2 and (p.cp_size == 1).all()
    assert p.packing_efficiency == 1.0


def test_plan_on_a_non_power_of_two_number_of_ranks_uses_any_degree():
    lengths = np.asarray([6 * 1000] + [300] * 50)
    p = schedule_documents(lengths, num_ranks=7, max_tokens=1024, cost=S2)
    check_placement(p, lengths, S2)
    assert p.cp_size[0] >= 6


def test_plan_counts_per_step_overhead_of_padding_microsteps():
    cost = CostModel(linear=1.0, per_step=100.0)
    lengths = np.asarray([50] * 5)
    p = schedule_documents(lengths, num_ranks=2, max_tokens=100, cost=cost)
    real = [sum(1 for step in steps if step) for steps in p.microsteps]
    assert min(real) < p.num_microsteps  # one rank pads with an empty micro-step ...
    assert p.rank_time.min() >= p.num_microsteps * 100.0  # ... and pays per_step for it
    assert simulate(p, lengths, cost) == p.makespan


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_ranks": 0}, "num_ranks must be a positive int"),
        ({"max_tokens": 0}, "max_tokens must be positive"),
        ({"cp_sizes": "ring"}, "not a policy"),
        ({"cp_sizes": [2, 4]}, "must include 1"),
        ({"tp": 0}, "tp must be a positive int"),
        ({"tp": True}, "tp must be a positive int"),
        ({"min_microsteps": True}, "min_microsteps must be an int"),
    ],
)
def test_plan_rejects_bad_options_with_a_fix(kwargs, match):
    args = {"num_ranks": 2, "max_tokens": 10, "cost": S2, **kwargs}
    with pytest.raises(ValueError, match=match):
        schedule_documents([1, 2], **args)


def test_plan_rejects_fractional_cp_sizes_instead_of_truncating_them():
    with pytest.raises(TypeError, match=r"cp_sizes=\[1, 2.5\] must hold int CP degrees"):
        schedule_documents([1, 2], num_ranks=4, max_tokens=10, cost=S2, cp_sizes=[1, 2.5])


def test_plan_rejects_negative_or_fractional_lengths():
    with pytest.raises(ValueError, match="must be >= 0"):
        schedule_documents([-1], num_ranks=1, max_tokens=10, cost=S2)
    with pytest.raises(TypeError, match="must be integers"):
        schedule_documents([1.5], num_ranks=1, max_tokens=10, cost=S2)


def test_plan_lets_split_documents_of_one_cp_group_share_a_microstep():
    lengths = np.asarray([20_000] * 6)  # each needs >= 3 ranks of 8192 tokens
    p = schedule_documents(lengths, num_ranks=8, max_tokens=8192, cost=S2)
    check_placement(p, lengths, S2)
    assert max(len(step) for steps in p.microsteps for step in steps) > 1
    assert p.num_microsteps == 2 and p.imbalance == 0.0  # vs 6 with one document per step


# ---------------------------------------------------------------- bounds (refused up front)


def test_schedule_documents_refuses_a_budget_beyond_2_pow_40_by_name():
    with pytest.raises(ValueError, match=r"max_tokens must be at most 2\*\*40"):
        schedule_documents([10, 20], num_ranks=2, max_tokens=2**63, cost=S2)


def test_schedule_documents_refuses_a_million_ranks_up_front_naming_the_limit():
    with pytest.raises(ValueError, match="num_ranks must be at most 8192"):
        schedule_documents([10, 20], num_ranks=10**6, max_tokens=4096, cost=S2)


def test_schedule_documents_refuses_10_pow_8_microsteps_up_front_naming_the_limit():
    with pytest.raises(ValueError, match=r"num_ranks x min_microsteps must be at most 2\*\*20"):
        schedule_documents([10, 20], num_ranks=2, max_tokens=4096, cost=S2, min_microsteps=10**8)


def test_schedule_documents_accepts_the_limits_themselves():
    p = schedule_documents(
        [10, 20], num_ranks=64, max_tokens=2**40, cost=S2, min_microsteps=2**20 // 64
    )
    assert p.num_microsteps == 2**20 // 64


@pytest.mark.parametrize("seed", range(5))
def test_sliding_max_equals_the_naive_windows(seed):
    from meshfeed.balance._candidates import _sliding_max, _windows

    rng = np.random.default_rng(seed)
    for n in (1, 2, 5, 16, 37):
        x = rng.random(n)
        for w in range(1, n + 1):
            assert np.array_equal(_sliding_max(x, w), _windows(x, w).max(axis=1))
