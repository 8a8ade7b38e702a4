import numpy as np
import pytest

from meshfeed.order.batches import BatchPlan, ShuffledOrder, rank_bounds
from tests.optional import given, settings, st


def test_rank_bounds_balanced_plus_minus_one():
    bounds = [rank_bounds(10, d, 4) for d in range(4)]
    assert bounds == [(0, 2), (2, 5), (5, 7), (7, 10)]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 500),
    batch=st.integers(1, 16),
    world=st.integers(1, 9),
    seed=st.integers(0, 2**31),
    drop_last=st.booleans(),
)
def test_global_batches_cover_epoch_exactly_once(n, batch, world, seed, drop_last):
    G = batch * world
    plan = BatchPlan(ShuffledOrder(n, seed=seed), global_batch_size=G, drop_last=drop_last)
    seen: list[int] = []
    pos, steps = 0, 0
    while (step := plan.step_at(0, pos)) is not None:
        per_rank = [plan.rank_indices(step, d, world) for d in range(world)]
        assert all(len(x) >= 1 for x in per_rank)  # no rank ever idles
        sizes = [len(x) for x in per_rank]
        assert max(sizes) - min(sizes) <= 1
        real = step.end - step.start
        flat = np.concatenate(per_rank)
        seen.extend(flat[:real].tolist() if real >= world else flat.tolist()[:real])
        pos, steps = step.end, steps + 1
    assert steps == plan.steps(0)
    expected = (n // G) * G if drop_last else n
    assert len(seen) == expected
    assert len(set(seen)) == expected


def test_short_final_batch_pads_by_wrapping_to_epoch_start():
    plan = BatchPlan(ShuffledOrder(9, seed=0, shuffle=False), global_batch_size=8, drop_last=False)
    step = plan.step_at(0, 8)
    assert step is not None and step.end - step.start == 1
    per_rank = [plan.rank_positions(step, d, 4).tolist() for d in range(4)]
    assert per_rank == [[8], [0], [1], [2]]
    assert plan.padding(step, 4) == 3
    assert [plan.rank_padding(step, d, 4) for d in range(4)] == [0, 1, 1, 1]


def test_sequence_of_global_batches_does_not_depend_on_world_size():
    order = ShuffledOrder(1000, seed=5)
    plan = BatchPlan(order, global_batch_size=24)
    for world in (1, 2, 3, 4, 6, 8):
        step = plan.step_at(3, 240)
        assert step is not None
        per_rank = plan.global_indices(step, world)
        merged = np.concatenate([indices for _, indices in per_rank])
        assert np.array_equal(np.concatenate([p for p, _ in per_rank]), np.arange(240, 264))
        assert np.array_equal(merged, order.indices(3, np.arange(240, 264)))


def test_epochs_reshuffle():
    order = ShuffledOrder(100, seed=1)
    a, b = order.indices(0, np.arange(100)), order.indices(1, np.arange(100))
    assert not np.array_equal(a, b) and sorted(a) == sorted(b)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 500),
    batch=st.integers(1, 16),
    world=st.integers(1, 9),
    seed=st.integers(0, 2**31),
)
def test_pad_last_false_truncates_to_equal_rank_lengths_and_reads_each_sample_at_most_once(
    n, batch, world, seed
):
    G = batch * world
    plan = BatchPlan(
        ShuffledOrder(n, seed=seed),
        global_batch_size=G,
        drop_last=False,
        pad_last=False,
        data_world_size=world,
    )
    per_rank: list[list[int]] = [[] for _ in range(world)]
    pos, steps = 0, 0
    while (step := plan.step_at(0, pos)) is not None:
        assert (step.end - step.start) % world == 0 and plan.padding(step, world) == 0
        for d in range(world):
            per_rank[d].extend(plan.rank_indices(step, d, world).tolist())
        pos, steps = step.end, steps + 1
    assert steps == plan.steps(0)
    assert {len(r) for r in per_rank} == {n // world}  # equal lengths on every rank
    flat = [i for r in per_rank for i in r]
    assert len(set(flat)) == len(flat) == n - n % world  # exactly once, the rest left out


def test_41_items_on_4_readers_pad_to_11_or_truncate_to_10_each():
    # torchdata DataLoader2's distributed sharding: 2 ranks x 2 workers -> 10 items per reader.
    def counts(pad_last: bool) -> list[int]:
        plan = BatchPlan(
            ShuffledOrder(41, seed=0),
            global_batch_size=8,
            drop_last=False,
            pad_last=pad_last,
            data_world_size=4,
        )
        out = [0] * 4
        pos = 0
        while (step := plan.step_at(0, pos)) is not None:
            for d in range(4):
                out[d] += len(plan.rank_positions(step, d, 4))
            pos = step.end
        return out

    assert counts(pad_last=True) == [11, 11, 11, 11]  # 41 served, 3 wrapped repeats
    assert counts(pad_last=False) == [10, 10, 10, 10]  # 40 served, 1 left out


def test_bad_data_world_size_is_refused_by_name():
    with pytest.raises(ValueError, match=r"data_world_size=0"):
        BatchPlan(ShuffledOrder(4), global_batch_size=4, data_world_size=0)


@pytest.mark.parametrize(
    ("drop_last", "pad_last", "consumed"), [(True, True, 40), (False, True, 41), (False, False, 40)]
)
def test_consumed_and_unserved_count_what_the_steps_cover(drop_last, pad_last, consumed):
    plan = BatchPlan(
        ShuffledOrder(41, seed=0),
        global_batch_size=8,
        drop_last=drop_last,
        pad_last=pad_last,
        data_world_size=4,
    )
    steps, step = [], plan.step_at(0, 0)
    while step is not None:
        steps.append(step)
        step = plan.step_at(0, step.end)
    assert plan.consumed(0) == steps[-1].end == consumed
    assert plan.unserved(3) == 3 * (41 - consumed)
    assert plan.facts() == {}  # nothing beyond the global batch to record
    wide = plan.with_ranks(8)
    assert (wide.data_world_size, wide.global_batch_size, wide.drop_last) == (8, 8, drop_last)
