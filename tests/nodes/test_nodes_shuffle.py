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
    state = node.state_dict()
    assert all(isinstance(x, int) for x in state["buffer"])
    other = factory()
    other.load_state_dict(state)
    assert loads[-1] == state["buffer"]
    assert [r["x"] for r in other] == [r["x"] for r in node]


def test_bad_arguments_and_states_are_refused():
    with pytest.raises(ValueError, match="size"):
        ShuffleBuffer(ListNode([1]), size=-1, seed=0)
    with pytest.raises(ValueError, match="both ref= and load="):
        ShuffleBuffer(ListNode([1]), size=2, seed=0, ref=lambda x: x)
    with pytest.raises(ValueError, match="missing 'draws'"):
        ShuffleBuffer(ListNode([1]), size=2, seed=0).load_state_dict(
            {"kind": "node.shuffle", "version": 1}
        )


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 80),
    size=st.integers(0, 20),
    seed=st.integers(0, 2**32),
    chunks=st.lists(st.integers(0, 9), min_size=1, max_size=30),
)
def test_next_many_gives_the_same_items_as_next_whatever_the_chunking(n, size, seed, chunks):
    one = list(ShuffleBuffer(ListNode(list(range(n))), size=size, seed=seed))
    node = ShuffleBuffer(ListNode(list(range(n))), size=size, seed=seed)
    out: list[int] = []
    for k in chunks * 20:
        out += node.next_many(k)
        if k % 3 == 0:
            out += node.next_many(1)
    out += list(node)
    assert out == one


def _state_after(size: int, items: int, k: int) -> dict:
    node = ShuffleBuffer(
        ListNode(list(range(items))),
        size=size,
        seed=1,
        ref=lambda x: x,
        load=lambda refs: list(refs),
    )
    node.next_many(k)
    return node.state_dict()


def _fresh(size: int = 4, items: int = 20) -> ShuffleBuffer:
    return ShuffleBuffer(
        ListNode(list(range(items))), size=size, seed=1, ref=lambda x: x, load=lambda r: list(r)
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: {**s, "buffer": [s["buffer"][0]] * 4}, "more than once"),
        (lambda s: {**s, "buffer": s["buffer"] + [99]}, "holds 5 items but this buffer has size=4"),
        (lambda s: {**s, "buffer": s["buffer"][:2]}, "holds 2 items of 4 while its source"),
        (lambda s: {**s, "draws": 10**30}, "'draws' is 10{30}, outside"),
        (lambda s: {**s, "draws": -1}, "negative"),
        (lambda s: {**s, "source_done": 1}, "'source_done'"),
        (lambda s: {**s, "kind": "node.batcher"}, "kind='node.shuffle'"),
        (lambda s: {**s, "version": 0}, "version=0"),
    ],
)
def test_a_corrupted_buffer_state_is_refused_by_name(change, match):
    state = _state_after(4, 20, 3)
    node = _fresh()
    with pytest.raises(ValueError, match=match):
        node.load_state_dict(change(state))


def test_the_state_holds_one_reference_per_slot_and_stays_small():
    calls = []

    def ref(x: int) -> int:
        calls.append(x)
        return x

    node = ShuffleBuffer(ListNode(list(range(100))), size=8, seed=0, ref=ref, load=list)
    node.next_many(10)
    state = node.state_dict()
    assert len(state["buffer"]) == 8 and len(set(state["buffer"])) == 8
    # ref() runs once per item entering the buffer, never per state
    node.state_dict()
    assert len(calls) == 18


class _KeyedList(ListNode[str]):
    """A RefSource over strings: keys are positions, JSON references are ``[position]``."""

    json_refs = staticmethod(lambda keys: [[k] for k in keys])

    def next_many_refs(self, n: int) -> tuple[list[str], list[int]]:
        lo = self.position
        items = self.next_many(n)
        return items, list(range(lo, lo + len(items)))

    def load_refs(self, refs: list) -> tuple[list[str], list[int]]:
        keys = [r[0] for r in refs]
        return [self.items[k] for k in keys], keys


def _keyed(size: int, n: int = 23) -> ShuffleBuffer:
    return ShuffleBuffer(
        _KeyedList([f"r{i}" for i in range(n)]), size=size, seed=7, source_refs=True
    )


@pytest.mark.parametrize("size", [0, 1, 4, 30])
def test_source_refs_give_the_same_order_as_per_item_refs(size):
    items = [f"r{i}" for i in range(23)]
    per_item = ShuffleBuffer(
        ListNode(items), size=size, seed=7, ref=items.index, load=lambda r: [items[i] for i in r]
    )
    assert list(_keyed(size)) == list(per_item)


@pytest.mark.parametrize("size", [0, 4, 30])
def test_source_refs_resume_exactly_from_every_item(size):
    assert_resume_equivalence(lambda: _keyed(size), num_items=23)


def test_source_refs_snapshot_defers_the_buffer_until_materialised():
    from meshfeed.nodes import Deferred, materialize

    node = _keyed(4)
    [next(node) for _ in range(6)]
    snap = node.snapshot()
    assert isinstance(snap["buffer"], Deferred)
    state = node.state_dict()
    assert materialize(snap) == state
    assert sorted(state["buffer"]) == sorted([[k] for k in node._refs])
    [next(node) for _ in range(3)]  # the snapshot is a copy: later draws leave it alone
    assert materialize(snap) == state


def test_source_refs_need_a_ref_source():
    with pytest.raises(ValueError, match="source_refs=True takes the references"):
        ShuffleBuffer(ListNode([1, 2]), size=2, seed=0, source_refs=True)


def test_the_draw_sequence_is_pinned():
    """The order for a fixed seed, as every release so far wrote it: changing it needs a new
    state version (a checkpoint would resume into another order)."""
    out = list(ShuffleBuffer(ListNode(list(range(20))), size=6, seed=11))
    assert out == [5, 0, 4, 2, 8, 3, 11, 10, 1, 7, 13, 9, 12, 17, 14, 16, 18, 19, 6, 15]
    keyed = ShuffleBuffer(
        _KeyedList([str(i) for i in range(20)]), size=6, seed=11, source_refs=True
    )
    assert [int(x) for x in keyed] == out
