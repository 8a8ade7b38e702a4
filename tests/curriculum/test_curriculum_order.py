"""GatedOrder: a growing pool walked so every eligible sample comes before any repeat."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed.curriculum import GatedOrder
from meshfeed.order.batches import rank_bounds
from tests.optional import given, settings, st


def _order(entry: list[int], *, g: int, per_epoch: int | None = None, seed: int = 0) -> GatedOrder:
    entry_arr = np.sort(np.asarray(entry, dtype=np.int64))
    # A scrambled pool order, so ranks and dataset indices differ.
    pool_order = np.random.default_rng(7).permutation(len(entry_arr)).astype(np.int64)
    return GatedOrder(
        pool_order=pool_order,
        entry_steps=entry_arr,
        global_batch_size=g,
        samples_per_epoch=per_epoch or g * 5,
        seed=seed,
    )


def _walk(order: GatedOrder, num_positions: int) -> np.ndarray:
    """Dataset indices of global positions 0 .. num_positions - 1, crossing epochs."""
    per = order.samples_per_epoch
    g = np.arange(num_positions)
    out = np.empty(num_positions, dtype=np.int64)
    for epoch in np.unique(g // per):
        mask = g // per == epoch
        out[mask] = order.indices(int(epoch), g[mask] % per)
    return out


entries = st.lists(st.integers(0, 12), min_size=1, max_size=60).map(lambda xs: [0, *xs])


@settings(max_examples=50, deadline=None)
@given(entry=entries, g=st.integers(1, 9), seed=st.integers(0, 2**32))
def test_every_eligible_sample_is_used_before_any_repeat(entry: list[int], g: int, seed: int):
    order = _order(entry, g=g, seed=seed)
    entry_of = dict(zip(order.pool_order.tolist(), np.sort(entry).tolist(), strict=True))
    drawn = _walk(order, 4 * len(entry) + 40 * g)
    used: set[int] = set()
    for p, x in enumerate(drawn.tolist()):
        step = p // g
        eligible = {i for i, e in entry_of.items() if e <= step}
        if eligible <= used:  # the reference: a new round only once everything is used
            used = set()
        assert x in eligible, f"position {p}: sample {x} (entry {entry_of[x]}) not eligible"
        assert x not in used, f"position {p}: sample {x} repeated before the pool was used up"
        used.add(x)


@settings(max_examples=40, deadline=None)
@given(entry=entries, g=st.integers(1, 9))
def test_pool_is_monotone_and_a_prefix_of_the_entry_order(entry: list[int], g: int):
    order = _order(entry, g=g)
    sizes = [order.pool_size(t) for t in range(20)]
    assert sizes == sorted(sizes)
    assert sizes[0] >= 1 and sizes[-1] == len(entry)
    for t, size in enumerate(sizes):
        assert size == sum(e <= t for e in entry)


@settings(max_examples=30, deadline=None)
@given(entry=entries, g=st.integers(1, 9), seed=st.integers(0, 2**32))
def test_indices_are_a_pure_function_of_position(entry: list[int], g: int, seed: int):
    order = _order(entry, g=g, seed=seed)
    everything = _walk(order, 3 * order.samples_per_epoch)
    fresh = _order(entry, g=g, seed=seed)
    # "Resume" anywhere = recompute from the position, in any chunking and order.
    for start in range(0, len(everything), 7):
        epoch, pos = divmod(start, fresh.samples_per_epoch)
        stop = min(pos + 7, fresh.samples_per_epoch)
        got = fresh.indices(epoch, np.arange(stop - 1, pos - 1, -1))[::-1]
        assert got.tolist() == everything[start : start + stop - pos].tolist()


def test_simulated_ranks_slice_the_same_global_batch():
    entry = [0] * 20 + [2] * 30 + [5] * 50
    order = _order(entry, g=12, per_epoch=48)
    for world in (1, 2, 3, 4):
        for epoch in range(3):
            for start in range(0, 48, 12):
                ranks = [
                    order.indices(epoch, start + np.arange(*rank_bounds(12, d, world)))
                    for d in range(world)
                ]
                whole = order.indices(epoch, start + np.arange(12))
                assert np.concatenate(ranks).tolist() == whole.tolist()


def test_segment_table_is_small_even_with_a_tiny_early_pool():
    # One sample eligible for 10**4 steps of 4096: a per-round table would have 4 * 10**7 rows.
    entry = np.concatenate([[0], np.full(999, 10_000)])
    order = GatedOrder(
        pool_order=np.arange(1000),
        entry_steps=entry,
        global_batch_size=4096,
        samples_per_epoch=4096 * 100,
        seed=0,
    )
    assert order.num_segments <= 4
    assert set(order.indices(3, np.arange(4096)).tolist()) == {0}
    late = order.indices(10_000 // 100, np.arange(4096))  # epoch 100 = step 10_000
    assert set(late.tolist()) == set(range(1000))


def test_seeds_change_the_order_but_not_the_pool():
    entry = [0] * 10 + [1] * 10
    a, b = _order(entry, g=5, seed=1), _order(entry, g=5, seed=2)
    pa, pb = _walk(a, 40), _walk(b, 40)
    assert pa.tolist() != pb.tolist()
    # Step 0 draws from the same 10-sample pool; the pool grows at step 1 and the first 20
    # positions then use every eligible sample exactly once, whatever the seed.
    first = set(a.pool_order[:10].tolist())
    assert set(pa[:5].tolist()) <= first and set(pb[:5].tolist()) <= first
    assert sorted(pa[:20].tolist()) == sorted(pb[:20].tolist()) == list(range(20))


def test_no_eligible_sample_at_step_zero_is_refused():
    with pytest.raises(ValueError, match="no sample is eligible at step 0"):
        GatedOrder(
            pool_order=np.arange(3),
            entry_steps=np.array([1, 1, 2]),
            global_batch_size=2,
            samples_per_epoch=4,
            seed=0,
        )


def test_positions_outside_the_epoch_are_refused():
    order = _order([0, 0, 0], g=2, per_epoch=4)
    with pytest.raises(IndexError, match=r"positions must lie in \[0, 4\)"):
        order.indices(0, np.array([4]))


def test_describe_reports_the_last_returned_step():
    order = GatedOrder(
        pool_order=np.arange(6),
        entry_steps=np.array([0, 0, 1, 1, 3, 3]),
        global_batch_size=2,
        samples_per_epoch=4,
        seed=0,
        difficulties=lambda step: {"m": step},
    )
    assert order.describe(0, 0) == {
        "kind": "curriculum_order",
        "version": 2,
        "step": -1,
        "pool_size": 2,
        "difficulty": {"m": 0},
    }
    assert order.describe(0, 4)["step"] == 1
    facts = order.describe(1, 4)  # epoch 1 ends at global position 8: step 3 was last
    assert facts == {
        "kind": "curriculum_order",
        "version": 2,
        "step": 3,
        "pool_size": 6,
        "difficulty": {"m": 3},
    }
    order.validate(facts)
    with pytest.raises(ValueError, match="version=1"):
        order.validate(
            {"version": 1, "step": 3, "pool_size": 6, "difficulty": {"m": 3}}
            | {"kind": "curriculum_order"}
        )


@settings(max_examples=50, deadline=None)
@given(entry=entries, g=st.integers(1, 9), seed=st.integers(0, 2**32))
def test_newly_eligible_samples_are_drawn_before_older_ones_repeat_and_never_wait_a_round(
    entry: list[int], g: int, seed: int
):
    """A pool change starts a round over the unused rest plus the new samples: no lag."""
    order = _order(entry, g=g, seed=seed)
    entry_of = dict(zip(order.pool_order.tolist(), np.sort(entry).tolist(), strict=True))
    drawn = _walk(order, 4 * len(entry) + 40 * g).tolist()
    unused: set[int] = set()
    for p, x in enumerate(drawn):
        step = p // g
        eligible = {i for i, e in entry_of.items() if e <= step}
        if p % g == 0 or not unused:
            # The reference: the set a round draws from is everything eligible not yet used
            # since the last time the pool was used up; new samples join it at once.
            unused |= {i for i in eligible if entry_of[i] == step} if p % g == 0 else set()
            if not unused:
                unused = set(eligible)
        assert x in unused, f"position {p}: {x} is not in the current round {sorted(unused)}"
        unused.discard(x)


def test_chains_of_pool_changes_stay_small_and_exact():
    entry = np.repeat(np.arange(200), 50)  # the pool grows by 50 at every one of 200 steps
    order = GatedOrder(
        pool_order=np.arange(len(entry)),
        entry_steps=entry,
        global_batch_size=64,
        samples_per_epoch=64 * 400,
        seed=3,
    )
    assert order.num_segments <= 3 * 200 + 1
    drawn = order.indices(0, np.arange(64 * 400))
    for step in range(400):
        batch = drawn[step * 64 : (step + 1) * 64]
        assert batch.max() < 50 * (step + 1)  # never above the pool of its step
    used: set[int] = set()
    for p, x in enumerate(drawn.tolist()):
        eligible = min(50 * (p // 64 + 1), 10_000)
        if len(used) == eligible:  # everything eligible was used: a repeat may start
            used = set()
        assert x not in used, f"position {p}: {x} repeated with {eligible - len(used)} unused"
        used.add(x)


def _deep_chain_order(cls: type[GatedOrder] = GatedOrder) -> GatedOrder:
    """2,000 samples at step 1, then 20 more at each of 100 steps, batches of 32: the pool
    grows in the middle of one long round, so chains of stopped rounds reach 99 levels."""
    entry = np.concatenate([np.zeros(2000, np.int64), np.repeat(np.arange(1, 101), 20)])
    return cls(
        pool_order=np.random.default_rng(11).permutation(len(entry)),
        entry_steps=entry,
        global_batch_size=32,
        samples_per_epoch=32 * 150,
        seed=2026,
        first_step=1,
    )


def test_the_order_is_the_one_earlier_versions_drew():
    """Checkpoints name ORDER_VERSION, not the code: a faster walk must draw the same samples.
    The digest is of what the element-by-element walk of version 2 drew (before runs were
    walked as ranges)."""
    import hashlib

    order = _deep_chain_order()
    rounds = order._rounds
    depth = [0] * len(rounds)
    for row in range(len(rounds)):
        parent = int(rounds[row, 3])
        depth[row] = 0 if parent < 0 else depth[parent] + 1
    assert max(depth) == 99
    drawn = np.concatenate([order.indices(e, np.arange(32 * 150)) for e in range(2)])
    assert drawn[:6].tolist() == [1537, 1345, 1357, 2469, 2929, 145]
    digest = hashlib.sha256(drawn.astype("<i8").tobytes()).hexdigest()[:16]
    assert digest == "a955077ab376dba1"


@settings(max_examples=60, deadline=None)
@given(
    entry=st.lists(st.integers(0, 40), min_size=1, max_size=400).map(lambda xs: [0, *xs]),
    g=st.integers(1, 64),
    seed=st.integers(0, 2**40),
    starts=st.lists(st.integers(0, 6000), min_size=1, max_size=4),
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=4),
)
def test_runs_walked_as_ranges_draw_what_the_walk_position_by_position_draws(
    entry: list[int], g: int, seed: int, starts: list[int], lengths: list[int]
):
    order = _order(entry, g=g, seed=seed)
    runs = [np.arange(s, s + n) for s, n in zip(starts, lengths, strict=False)]
    flat = np.concatenate([*runs, np.arange(4 * g * 5)])  # runs, then a walk from 0
    assert np.array_equal(order.stream_ranks(flat), order._walk_positions(flat))
    scattered = np.random.default_rng(seed).integers(0, 6000, size=200)
    assert np.array_equal(order.stream_ranks(scattered), order._walk_positions(scattered))


def test_a_deep_chain_walked_as_ranges_matches_position_by_position():
    order = _deep_chain_order()
    for lo, n in [(0, 32 * 150), (32 * 149, 32), (12_345, 1), (32 * 300 + 7, 500)]:
        flat = np.arange(lo, lo + n)
        assert np.array_equal(order.stream_ranks(flat), order._walk_positions(flat))
