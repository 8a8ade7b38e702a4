"""A batch-size ramp checks only the sizes still ahead on a resize (#32).

Once the ramp is over every global batch is ``G``; a resize (or a rank that rejoins with a peer's
state) onto data ranks that divide ``G`` but not the ramp's long-past start size was refused
before (every size of the ramp was checked). Megatron's calculator accepts that run
(``consumed > samples``: size ``G``). The sizes from the samples consumed on are checked now; a
fresh loader still checks every size, naming how to resume a checkpoint past them.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshfeed import DataLoader
from meshfeed.order.rampup import BatchRampup
from meshfeed.testing import take

SEED = 5
N, G, RAMP = 600, 32, (4, 4, 60)  # 4, +4 every 60 / 7 samples, up to 32; past it after 7 steps


def _loader(dp: int, rank: int = 0, *, mesh: Any = None, rampup: Any = RAMP) -> DataLoader:
    return DataLoader(
        list(range(N)),
        batch_size=G // dp,
        mesh=mesh or {"dp": dp},
        rank=rank,
        seed=SEED,
        rampup=rampup,
    )


def _global(steps: int, start: int = 0, rampup: Any = RAMP) -> list[list[int]]:
    """The uninterrupted run's global batches ``start`` .. ``start + steps`` (one data rank)."""
    return [b.tolist() for b in take(_loader(1, rampup=rampup), start + steps)[start:]]


def _joined(loaders: list[DataLoader], steps: int) -> list[list[int]]:
    """``steps`` global batches: every data rank's batch, in rank order."""
    per_rank = [take(lo, steps) for lo in loaders]
    return [sum((per_rank[r][s].tolist() for r in range(len(loaders))), []) for s in range(steps)]


def test_resize_past_the_ramp_onto_ranks_dividing_only_the_final_batch_is_exact():
    two = [_loader(2, r) for r in range(2)]
    got = _joined(two, 8)
    assert two[0].position > RAMP[2]  # the ramp is over: every batch ahead is G
    state = two[0].state_dict()
    for r in range(2):
        two[r].resize({"dp": 8}, rank=r)  # 8 divides 32, not the start 4
    # The ranks that join: built on data ranks the whole ramp divides (the same world of 8, the
    # rest on another axis), the state loaded, then resized: the workaround the build names.
    joined = []
    for r in range(2, 8):
        lo = DataLoader(
            list(range(N)),
            batch_size=G // 2,
            mesh={"dp": 2, "tp": 4},
            rank=r,
            seed=SEED,
            rampup=RAMP,
        )
        lo.load_state_dict(state)
        lo.resize({"dp": 8}, rank=r)
        joined.append(lo)
    eight = two + joined
    assert {lo.batch_size for lo in eight} == {4}
    got += _joined(eight, 5)
    assert got == _global(13)
    assert len({x for b in got for x in b}) == sum(map(len, got))  # every sample once


def test_resize_onto_ranks_a_size_still_ahead_does_not_divide_is_refused_moving_nothing():
    want = _global(5)
    loader = _loader(2)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]  # 12 samples consumed: 8, 12, ..., 32 ahead
    with pytest.raises(ValueError) as err:
        loader.resize({"dp": 8}, rank=0)
    msg = str(err.value)
    assert "global batch 12 of the ramp" in msg and "still ahead after 12 consumed samples" in msg
    assert "dividing 4" in msg and f"after {RAMP[2]} consumed samples" in msg
    assert (loader.data_world_size, loader.batch_size) == (2, G // 2)
    got += [next(it).tolist() for _ in range(2)]  # the live iterator goes on, on 2 ranks
    assert got == [b[: len(b) // 2] for b in want]


def test_a_rejoining_rank_is_checked_from_its_peers_position():
    past = _loader(2, 1)
    take(past, 8)
    behind = _loader(2)
    take(behind, 2)  # its own position is mid-ramp; the peer's is past it
    behind.resize({"dp": 8}, rank=0, state=past.state_dict())
    assert behind.position == past.position and behind.batch_size == 4
    assert take(behind, 1)[0].tolist() == _global(1, start=8)[0][:4]

    mid = _loader(2, 1)
    take(mid, 3)
    ahead = _loader(2)
    take(ahead, 8)
    with pytest.raises(ValueError, match="still ahead after 12 consumed samples"):
        ahead.resize({"dp": 8}, rank=0, state=mid.state_dict())
    assert (ahead.data_world_size, ahead.batch_size, ahead.position) == (2, G // 2, 104)


def test_a_checkpoint_of_a_run_resized_past_the_ramp_resumes_on_other_ranks():
    loader = _loader(2)
    take(loader, 8)
    loader.resize({"dp": 8}, rank=0)
    take(loader, 1)
    state = loader.state_dict()
    assert state["data_world_size"] == 8
    back = _loader(2, 1)  # a data-parallel size the whole ramp divides
    back.load_state_dict(state)
    assert take(back, 2)[1].tolist() == _global(1, start=10)[0][G // 2 :]


def test_a_loader_resized_past_the_ramp_refuses_to_go_back_into_it():
    # Its plan was checked from where it was resized: a mid-ramp checkpoint, or an earlier
    # epoch, would cut a size the 8 ranks do not divide into unequal per-rank batches.
    loader = _loader(2)
    for _ in loader:  # epoch 0 to its end: at epoch 1, position 0
        pass
    loader.resize({"dp": 8}, rank=0)
    mid = _loader(2, 1)
    take(mid, 3)
    with pytest.raises(ValueError, match="global batch 12 of the ramp .* still ahead after 12"):
        loader.load_state_dict(mid.state_dict())
    with pytest.raises(ValueError, match="global batch 4 of the ramp .* = 8"):
        loader.set_epoch(0)
    assert (loader.epoch, loader.position, loader.data_world_size) == (1, 0, 8)
    past = _loader(2, 1)
    take(past, 9)
    loader.load_state_dict(past.state_dict())  # past the ramp: loads
    assert take(loader, 1)[0].tolist() == _global(1, start=9)[0][:4]


def test_an_uneven_ramp_takes_more_ranks_than_its_start_once_past_it():
    rampup = BatchRampup(start=3, increment=5, samples=30, uneven=True)  # 3, 8, ..., 28
    loader = DataLoader(
        list(range(N)), batch_size=14, mesh={"dp": 2}, rank=0, seed=SEED, rampup=rampup
    )
    take(loader, 6)
    assert loader.position > 30
    loader.resize({"dp": 4}, rank=0)  # 3 samples on 4 ranks: long past
    whole = DataLoader(
        list(range(N)), batch_size=28, mesh={"dp": 1}, rank=0, seed=SEED, rampup=rampup
    )
    assert take(loader, 1)[0].tolist() == take(whole, 7)[6].tolist()[:7]
    with pytest.raises(ValueError, match="a rank would get an empty batch"):
        DataLoader(list(range(N)), batch_size=7, mesh={"dp": 4}, rank=0, rampup=rampup)


def test_a_fresh_loader_still_checks_every_size_and_names_how_to_resume_past_them():
    with pytest.raises(ValueError) as err:
        _loader(8)
    msg = str(err.value)
    assert "global batch 4 of the ramp" in msg and "= 8" in msg
    assert "load_state_dict, then resize(mesh) onto the 8" in msg


def test_megatron_accepts_the_sizes_served_after_the_resize():
    calculator = pytest.importorskip(
        "megatron.core.num_microbatches_calculator",
        reason="megatron-core is a peer test dependency: pip install '.[peers]'",
    )
    loader = _loader(2)
    take(loader, 8)
    loader.resize({"dp": 8}, rank=0)
    calc = calculator.RampupBatchsizeNumMicroBatchesCalculator(G, 1, 8, False, 1, *RAMP)
    consumed = loader.position
    for batch in take(loader, 4):
        calc.update(consumed, consistency_check=True)  # asserts the size divides on dp=8
        assert calc.get_current_running_global_batch_size() == len(batch) * 8 == G
        consumed += G
