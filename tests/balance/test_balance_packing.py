from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfeed.balance import pack, packing_efficiency


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 100), max_size=80), budget=st.integers(100, 300))
def test_pack_places_every_document_once_within_the_budget(lengths, budget):
    bins = pack(lengths, max_tokens=budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    assert pack(lengths, max_tokens=budget) == bins
    # BFD never needs more than 11/9 OPT + 1 bins; OPT >= total / budget.
    assert len(bins) <= 11 / 9 * (sum(lengths) / budget + 1) + 1


def test_pack_fills_bins_best_fit_decreasing():
    assert pack([5, 3, 4, 2], max_tokens=8) == [[0, 1], [2, 3]]
    assert packing_efficiency([5, 3, 4, 2], [[0, 1], [2, 3]], max_tokens=8) == 0.875


def test_pack_rejects_a_document_over_budget_and_points_to_cp():
    with pytest.raises(ValueError, match="document 1 has 9 tokens > max_tokens=8; split it"):
        pack([1, 9], max_tokens=8)
