"""ShuffleBuffer: a seeded permutation of its source with exact, RNG-free state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfeed.nodes import ListNode, ShuffleBuffer
from meshfeed.testing import assert_resume_equivalence


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 60), size=st.integers(0, 20), seed=st.integers(0, 2**32))
def test_output_is_a_permutation_of_the_source(n, size, seed):
    out = list(ShuffleBuffer(ListNode(list(range(n))), size=size, seed=seed))
    assert sorted(out) == list(range(n))


def test_same_seed_same_order_and_other_seed_other_order():
    def run(seed: int) -> list[int]:
        return list(ShuffleBuffer(ListNode(list(range(50))), size=10, seed=seed))

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert run(1) != list(range(50))


def test_buffer_bounds_how_far_an_item_moves_forward():
    out = list(ShuffleBuffer(ListNode(list(range(100))), size=5, seed=0))
    assert all(out.index(i) >= i - 4 for i in range(100))


@pytest.mark.parametrize("size", [0, 1, 4, 30])
def test_exact_resume_from_every_item(size):
    assert_resume_equivalence(
        lambda: ShuffleBuffer(ListNode(list(range(23))), size=size, seed=7), num_items=23
    )


def test_references_are_stored_instead_of_items_when_asked():
    rows = [{"x": i, "blob": object()} for i in range(12)]
    loads: list[list[int]] = []

    def load(refs: list[int]) -> list[dict]:
        loads.append(refs)
        return [rows[r] for r in refs]

    def factory() -> ShuffleBuffer:
        return ShuffleBuffer(ListNode(rows), size=4, seed=3, ref=lambda r: r["x"], load=load)

    node = factory()
    [next(node) for _ in range(3)]
    state = node.get_state()
    assert all(isinstance(x, int) for x in state["buffer"])
    other = factory()
    other.restore(state)
    assert loads[-1] == state["buffer"]
    assert [r["x"] for r in other] == [r["x"] for r in node]


def test_bad_arguments_and_states_are_refused():
    with pytest.raises(ValueError, match="size"):
        ShuffleBuffer(ListNode([1]), size=-1, seed=0)
    with pytest.raises(ValueError, match="both ref= and load="):
        ShuffleBuffer(ListNode([1]), size=2, seed=0, ref=lambda x: x)
    with pytest.raises(ValueError, match="missing 'draws'"):
        ShuffleBuffer(ListNode([1]), size=2, seed=0).restore({})
