from __future__ import annotations

import numpy as np
import pytest

from meshfeed.balance import CostModel, naive_slicing, schedule_documents, token_balancing

S2 = CostModel(quadratic=1.0)


def test_naive_slicing_gives_each_rank_a_contiguous_equal_count_slice():
    r = naive_slicing([4, 4, 1, 1], num_ranks=2, max_tokens=8, cost=S2)
    assert r.rank_time.tolist() == [32.0, 2.0] and r.makespan == 32.0
    assert r.num_microsteps == 1 and r.packing_efficiency == 10 / 16


def test_token_balancing_equalises_tokens_not_cost():
    r = token_balancing([6, 3, 3], num_ranks=2, max_tokens=8, cost=S2)
    assert sorted(r.rank_time.tolist()) == [18.0, 36.0]  # 6 tokens each, costs differ


def test_baselines_pad_to_the_same_number_of_microsteps_and_pay_per_step():
    cost = CostModel(linear=1.0, per_step=10.0)
    r = naive_slicing([5, 5, 5, 1], num_ranks=2, max_tokens=5, cost=cost)
    assert r.num_microsteps == 2
    assert r.rank_time.tolist() == [10.0 + 20.0, 6.0 + 20.0]


def test_baselines_are_never_better_than_the_plan_lower_bound():
    rng = np.random.default_rng(0)
    for _ in range(10):
        lengths = rng.integers(1, 3000, 200)
        lb = schedule_documents(lengths, num_ranks=8, max_tokens=4096, cost=S2).lower_bound
        for base in (naive_slicing, token_balancing):
            assert base(lengths, num_ranks=8, max_tokens=4096, cost=S2).makespan >= lb * (1 - 1e-9)


@pytest.mark.parametrize("baseline", [naive_slicing, token_balancing])
@pytest.mark.parametrize("bad", [0, -2, True, 2.0])
def test_baselines_reject_a_num_ranks_that_is_not_a_positive_int(baseline, bad):
    with pytest.raises(
        ValueError, match=rf"num_ranks must be a positive int \(got num_ranks={bad}"
    ):
        baseline([4, 4, 1, 1], num_ranks=bad, max_tokens=8, cost=S2)
