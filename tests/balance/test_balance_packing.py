from __future__ import annotations

import pytest

from meshfeed.balance import pack, packing_efficiency
from meshfeed.balance.packing import pack_windows
from tests.optional import given, settings, st


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


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 100), max_size=80),
    budget=st.integers(100, 300),
    method=st.sampled_from(["best_fit", "first_fit"]),
    window=st.integers(1, 30),
)
def test_pack_windows_places_every_item_once_within_its_window(lengths, budget, method, window):
    row_ptr, members = pack_windows(lengths, budget=budget, window=window, method=method)
    assert sorted(members.tolist()) == list(range(len(lengths)))
    for b in range(row_ptr.size - 1):
        row = members[row_ptr[b] : row_ptr[b + 1]].tolist()
        assert row == sorted(row) and row
        assert sum(lengths[i] for i in row) <= budget
        assert len({i // window for i in row}) == 1  # no bin spans two windows
    # each window is packed alone: the same as packing it by itself
    first = pack(lengths[:window], max_tokens=budget, method=method)
    assert [members[row_ptr[b] : row_ptr[b + 1]].tolist() for b in range(len(first))] == first


def test_first_fit_keeps_arrival_order_and_takes_the_first_bin():
    assert pack([5, 3, 4, 2], max_tokens=8, method="first_fit") == [[0, 1], [2, 3]]
    assert pack([6, 5, 2, 3], max_tokens=8, method="first_fit") == [[0, 2], [1, 3]]
    # best fit decreasing fills tighter on the same lengths
    assert pack([2, 5, 4, 3, 2], max_tokens=8, method="first_fit") == [[0, 1], [2, 3], [4]]
    assert pack([2, 5, 4, 3, 2], max_tokens=8) == [[1, 3], [0, 2, 4]]


def test_pack_windows_packs_float_costs_and_given_bounds():
    row_ptr, members = pack_windows([0.5, 2.5, 1.0, 3.0], budget=3.0, window=4, bounds=[0, 1, 4])
    rows = [members[row_ptr[b] : row_ptr[b + 1]].tolist() for b in range(row_ptr.size - 1)]
    assert rows == [[0], [3], [1], [2]]


def test_pack_refuses_an_unknown_method_and_bad_windows():
    with pytest.raises(ValueError, match="method='worst_fit' is not a packing method"):
        pack([1], max_tokens=8, method="worst_fit")
    with pytest.raises(ValueError, match="window must be a positive int"):
        pack_windows([1], budget=8, window=0)
    with pytest.raises(ValueError, match="bounds must run from 0 to 2"):
        pack_windows([1, 1], budget=8, window=1, bounds=[0, 1])


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 100), max_size=80),
    budget=st.integers(100, 300),
    method=st.sampled_from(["best_fit", "first_fit"]),
    window=st.integers(1, 30),
)
def test_pack_windows_carrying_the_emptiest_bin_places_every_item_once(
    lengths, budget, method, window
):
    row_ptr, members = pack_windows(
        lengths, budget=budget, window=window, method=method, carry=True
    )
    assert sorted(members.tolist()) == list(range(len(lengths)))
    rows = [members[row_ptr[b] : row_ptr[b + 1]].tolist() for b in range(row_ptr.size - 1)]
    assert all(row == sorted(row) and sum(lengths[i] for i in row) <= budget for row in rows)
    # a prefix of the items is packed alike whatever follows it (the plan is a left fold)
    cut = (len(lengths) // window) * window
    if cut and cut < len(lengths):
        head_ptr, head = pack_windows(
            lengths[:cut] + [0] * window, budget=budget, window=window, method=method, carry=True
        )
        k = sum(1 for row in rows if row and row[-1] < cut - window)
        assert [head[head_ptr[b] : head_ptr[b + 1]].tolist() for b in range(k)] == rows[:k]


def test_carrying_leaves_only_the_last_window_partly_filled():
    lengths = [70, 20, 30, 80]
    plain = pack_windows(lengths, budget=100, window=2)
    carried = pack_windows(lengths, budget=100, window=2, carry=True)
    assert plain[0].tolist() == [0, 2, 3, 4]  # {70, 20} | {30} {80}: window 1 leaves {30}
    assert carried[0].tolist() == [0, 2, 4] and carried[1].tolist() == [1, 3, 0, 2]
