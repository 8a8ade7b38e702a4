"""meshfeed's batch-size ramp against Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.

Megatron's calculator runs as shipped in megatron-core, driven the way its training loop drives
it: before every step ``update(consumed_train_samples, consistency_check=True)``, after it
``consumed_train_samples += current running global batch``. meshfeed's loader must serve the
same global batch at every step, and refuse (by name, at construction) the ramps Megatron's
consistency check rejects. Skipped, with the reason, when megatron-core is not importable.
"""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    calculator = pytest.importorskip(
        "megatron.core.num_microbatches_calculator",
        reason="megatron-core is a peer test dependency: pip install '.[peers]'",
    )

from meshfeed import DataLoader
from meshfeed.order.batches import ShuffledOrder
from meshfeed.order.rampup import BatchRampup
from meshfeed.order.rampup_plan import RampupPlan
from tests.optional import given, settings, st


def megatron_sizes(G, mbs, dp, start, inc, samples, *, decrease=False, steps=60, check=True):
    """Megatron's running global batch at each of ``steps`` training steps (``check``: its
    consistency check, which asserts that each size divides into micro-batches x dp)."""
    calc = calculator.RampupBatchsizeNumMicroBatchesCalculator(
        G, mbs, dp, decrease, 1, start, inc, samples
    )
    consumed, sizes = 0, []
    for _ in range(steps):
        calc.update(consumed, consistency_check=check)
        running = calc.get_current_running_global_batch_size()
        assert running == calc.get() * mbs * dp or not check  # micro-batches x mbs x dp
        sizes.append(running)
        consumed += running
    return sizes


def meshfeed_sizes(G, mbs, dp, start, inc, samples, *, decrease=False, steps=60):
    """The loader's global batch at each step: rank 0's batch times dp (equal per-rank)."""
    rampup = BatchRampup(
        start=start, increment=inc, samples=samples, micro_batch_size=mbs, round_down=decrease
    )
    n = sum(megatron_sizes(G, mbs, dp, start, inc, samples, decrease=decrease, steps=steps))
    loader = DataLoader(list(range(n)), batch_size=G // dp, mesh={"dp": dp}, rank=0, rampup=rampup)
    return [len(b) * dp for b in loader][:steps]


CONFIGS = [
    # G, micro_batch, dp, start, increment, ramp-up samples, decrease_batch_size_if_needed
    (256, 2, 4, 32, 32, 3000, False),  # GPT-3's shape, scaled down
    (4, 1, 1, 1, 1, 10, False),  # 10 / 3 samples per increment: float boundaries
    (14, 1, 1, 1, 1, 27, False),  # at 26 consumed, int(26 / (27 / 13)) = 12, but 26*13//27 = 13
    (128, 2, 8, 16, 16, 1000, False),
    (96, 1, 3, 3, 3, 777, False),
    (32, 1, 4, 6, 2, 60, True),  # rounded down to multiples of 4
    (66, 4, 3, 18, 6, 500, True),  # rounded to multiples of 12, the final 66 too
]


@pytest.mark.parametrize(("G", "mbs", "dp", "start", "inc", "samples", "decrease"), CONFIGS)
def test_the_loader_serves_megatrons_global_batch_at_every_step(
    G, mbs, dp, start, inc, samples, decrease
):
    args = (G, mbs, dp, start, inc, samples)
    expected = megatron_sizes(*args, decrease=decrease)
    assert len(set(expected)) > 1  # a real ramp
    assert meshfeed_sizes(*args, decrease=decrease) == expected
    if args == (14, 1, 1, 1, 1, 27):  # Megatron's float division, not exact arithmetic
        assert expected[8] == 13


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),  # dp
    st.integers(1, 2),  # micro-batch
    st.integers(1, 12),  # start
    st.integers(1, 12),  # increment
    st.integers(1, 6),  # increments to climb
    st.integers(1, 400),  # ramp-up samples
    st.booleans(),  # decrease_batch_size_if_needed
)
def test_sizes_match_megatron_or_both_refuse(dp, mbs, start, inc, climbs, samples, decrease):
    G = start + climbs * inc
    if G % dp:
        return  # the loader's global batch is batch_size x dp (refused before any ramp)
    if decrease and start < mbs * dp:
        return  # Megatron would run 0 micro-batches forever; meshfeed refuses (tested below)
    rampup = BatchRampup(
        start=start, increment=inc, samples=samples, micro_batch_size=mbs, round_down=decrease
    )
    order = ShuffledOrder(10**9, seed=0, shuffle=False)
    try:
        plan = RampupPlan(order, rampup=rampup, global_batch_size=G, data_world_size=dp)
    except ValueError as exc:
        assert "does not divide into micro_batch_size" in str(exc)
        bad = {x for x in range(start, G + 1, inc) if x % (mbs * dp)}
        assert bad  # refused only for a size of the schedule that does not divide
        # Megatron asserts at the first such size its run reaches. meshfeed checks every size
        # up front (a ramp whose steps outgrow its increments can skip one in a single epoch,
        # but where epochs end depends on drop_last): stricter, never later.
        steps = samples // start + climbs + 2  # past the ramp: each step consumes >= start
        reached = megatron_sizes(G, mbs, dp, start, inc, samples, steps=steps, check=False)
        if bad & set(reached):
            with pytest.raises(AssertionError, match="not divisible"):
                megatron_sizes(G, mbs, dp, start, inc, samples, steps=steps)
        return
    expected = megatron_sizes(G, mbs, dp, start, inc, samples, decrease=decrease, steps=80)
    got, step = [], plan.step_at(0, 0)
    while step is not None and len(got) < 80:
        got.append(step.end - step.start)
        step = plan.step_at(0, step.end)
    assert got == expected


def test_a_ramp_that_rounds_to_nothing_is_refused_where_megatron_would_stall():
    with pytest.raises(ValueError, match="rounds down to 0"):
        DataLoader(
            list(range(100)),
            batch_size=8,
            mesh={"dp": 4},
            rank=0,
            rampup=BatchRampup(start=2, increment=2, samples=50, round_down=True),
        )
