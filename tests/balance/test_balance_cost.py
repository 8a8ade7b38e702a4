from __future__ import annotations

import numpy as np
import pytest

from meshfeed.balance import CostModel


def test_cost_of_a_document_splits_evenly_over_its_cp_ranks():
    cost = CostModel(linear=2.0, quadratic=0.5)
    assert cost.work([10]).tolist() == [70.0]
    assert cost.time([10, 10], cp=[1, 2]).tolist() == [70.0, 35.0]


def test_from_transformer_counts_gemm_flops_per_token_and_causal_attention_per_pair():
    cost = CostModel.from_transformer(hidden_size=64, num_layers=2, num_heads=4, training=False)
    h = 64
    assert cost.linear == 2 * (2 * h * 3 * h + 2 * h * h + 2 * 2 * h * 4 * h)
    assert cost.quadratic == 2 * 4 * h * 0.5
    full = CostModel.from_transformer(hidden_size=64, num_layers=2, num_heads=4, causal=False)
    assert full.quadratic == 3 * 2 * 4 * h


def test_from_transformer_gqa_makes_projections_cheaper():
    mha = CostModel.from_transformer(hidden_size=128, num_layers=1, num_heads=8)
    gqa = CostModel.from_transformer(hidden_size=128, num_layers=1, num_heads=8, num_kv_heads=2)
    assert gqa.linear < mha.linear and gqa.quadratic == mha.quadratic


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calibrate_recovers_coefficients_from_noisy_measurements(seed):
    rng = np.random.default_rng(seed)
    s = rng.integers(128, 65536, size=200)
    truth = CostModel(linear=3e-6, quadratic=2e-10, per_step=1e-3)
    t = truth.work(s) + truth.per_step
    t = t * (1 + 0.01 * rng.standard_normal(s.size))
    fit = CostModel.calibrate(s, t, fit_per_step=True)
    assert fit.linear == pytest.approx(truth.linear, rel=0.05)
    assert fit.quadratic == pytest.approx(truth.quadratic, rel=0.05)


def test_calibrate_drops_a_negative_coefficient_instead_of_returning_it():
    s = np.asarray([100, 200, 400, 800])
    fit = CostModel.calibrate(s, 2.0 * s)  # purely linear measurements
    assert fit.quadratic == 0.0 and fit.linear == pytest.approx(2.0)


def test_calibrate_rejects_mismatched_or_too_few_measurements():
    with pytest.raises(ValueError, match="must pair up"):
        CostModel.calibrate([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="at >= 2 distinct lengths"):
        CostModel.calibrate([5, 5, 5], [1.0, 1.0, 1.0])


def test_cost_model_rejects_negative_or_all_zero_coefficients():
    with pytest.raises(ValueError, match=r"CostModel.per_step must be a finite number >= 0"):
        CostModel(linear=1.0, per_step=-1.0)
    with pytest.raises(ValueError, match="needs linear > 0 or quadratic > 0"):
        CostModel()
