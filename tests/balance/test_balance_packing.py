from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfeed.balance import pack, packing_efficiency
from meshfeed.balance.zigzag import padded_length, zigzag_positions


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


@pytest.mark.parametrize(("cp", "tp"), [(1, 1), (1, 2), (2, 1), (3, 1), (4, 2)])
def test_zigzag_ranks_hold_complementary_chunks_covering_the_padded_document(cp, tp):
    padded = padded_length(37, cp, tp)
    assert padded >= 37 and padded % (2 * cp * tp if cp > 1 else tp) == 0
    held = [zigzag_positions(padded, cp, r) for r in range(cp)]
    assert sorted(np.concatenate(held).tolist()) == list(range(padded))
    assert len({len(h) for h in held}) == 1
    if cp > 1:
        chunk = padded // (2 * cp)
        assert held[0][0] == 0 and held[0][-1] == padded - 1  # rank 0: first and last chunk
        assert held[cp - 1][0] == (cp - 1) * chunk and held[cp - 1][-1] == (cp + 1) * chunk - 1


def test_zigzag_rejects_an_unpadded_document():
    with pytest.raises(ValueError, match="multiple of 4"):
        zigzag_positions(10, cp=2, cp_rank=0)
