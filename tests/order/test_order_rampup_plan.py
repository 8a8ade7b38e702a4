"""RampupPlan (#32): exactly once over ranks, equal steps, resume, elastic resume, resize."""

from __future__ import annotations

import json

import pytest
import torch

from meshfeed import DataLoader, DataMesh, StreamLoader
from meshfeed.order.batches import ShuffledOrder
from meshfeed.order.rampup import BatchRampup
from meshfeed.order.rampup_plan import RampupPlan
from meshfeed.sources import ShardedStream
from meshfeed.testing import assert_resume_equivalence, take
from tests.dist_utils import run_distributed
from tests.optional import given, settings, st

SEED = 3


def _loader(n=200, *, rank=0, dp=2, batch=8, rampup=(4, 4, 60), **kw):
    return DataLoader(
        list(range(n)), batch_size=batch, mesh={"dp": dp}, rank=rank, rampup=rampup, seed=SEED, **kw
    )


def _epoch(loaders):
    """Every rank's batches of one epoch, as lists."""
    return [[b.tolist() for b in lo] for lo in loaders]


def _check_exactly_once(per_rank, positions_in_order=False):
    """Equal steps on every rank; at each step the ranks' union is one global batch; no sample
    twice. With ``positions_in_order`` (shuffle=False) the global batches are consecutive."""
    steps = {len(r) for r in per_rank}
    assert len(steps) == 1, f"ranks took different numbers of steps: {steps}"
    seen: list[int] = []
    for k in range(steps.pop()):
        union = [i for r in per_rank for i in r[k]]
        if positions_in_order:
            assert union == list(range(len(seen), len(seen) + len(union))), k
        seen.extend(union)
    assert len(seen) == len(set(seen))
    return seen


def test_sizes_follow_megatrons_schedule_on_a_small_example():
    # start 4, +4 every 60 / 3 = 20 consumed samples, up to 8 x 2 = 16 after 60 samples.
    out = _epoch([_loader(shuffle=False, rank=r) for r in range(2)])
    sizes = [len(a) + len(b) for a, b in zip(*out, strict=True)]
    assert sizes[:12] == [4, 4, 4, 4, 4, 8, 8, 8, 12, 12, 16, 16]
    assert set(sizes[10:]) == {16}
    assert all(len(a) == len(b) for a, b in zip(*out, strict=True))  # equal per-rank batches
    _check_exactly_once(out, positions_in_order=True)


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_every_sample_once_per_epoch_over_the_ranks(dp, drop_last):
    loaders = [
        _loader(n=103, rank=r, dp=dp, rampup=(4, 4, 150), drop_last=drop_last) for r in range(dp)
    ]
    for epoch in range(3):  # the ramp spans epochs: consumed samples count across them
        seen = _check_exactly_once(_epoch(loaders))
        assert len(seen) == (103 if not drop_last else loaders[0].plan.consumed(epoch))
    assert {len(lo) for lo in loaders} == {len(loaders[0])}


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4),  # dp
    st.integers(1, 4),  # increments to climb
    st.integers(1, 3),  # start, in multiples of dp
    st.integers(1, 3),  # increment, in multiples of dp
    st.integers(1, 300),  # ramp-up samples
    st.integers(20, 150),  # dataset length
)
def test_exactly_once_and_equal_steps_for_any_divisible_ramp(dp, climbs, s, i, samples, n):
    start, inc = s * dp, i * dp
    G = start + climbs * inc
    plan = RampupPlan(
        ShuffledOrder(n, seed=1, shuffle=False),
        rampup=BatchRampup(start=start, increment=inc, samples=samples),
        global_batch_size=G,
        data_world_size=dp,
        drop_last=False,
    )
    for epoch in range(2):
        step, steps, flat = plan.step_at(epoch, 0), 0, []
        while step is not None:
            assert step.index == steps == plan._steps_before(epoch, step.start)  # walk = count
            parts = [plan.rank_positions(step, d, dp).tolist() for d in range(dp)]
            union, real = [p for part in parts for p in part], step.end - step.start
            lens = [len(p) for p in parts]  # equal, or within one in an epoch's short last batch
            assert max(lens) - min(lens) <= (0 if real % dp == 0 else 1)
            assert len(union) == max(real, dp)  # a last batch below dp ranks is padded
            flat += union[:real]
            step, steps = plan.step_at(epoch, step.end), steps + 1
        assert steps == plan.steps(epoch)
        assert flat == list(range(n))
        assert plan.consumed(epoch) == n


def test_resume_mid_ramp_gives_the_same_remaining_batches():
    # 70 samples per epoch, ramp over 150: checkpoints mid-ramp and across epoch boundaries.
    assert_resume_equivalence(lambda: _loader(n=70, rampup=(4, 4, 150)), num_items=40)
    assert_resume_equivalence(
        lambda: _loader(n=70, rampup=(4, 4, 150), drop_last=False), num_items=40
    )


def test_elastic_resume_on_another_dp_size_serves_the_same_global_batches():
    ref = [_loader(n=160, rank=r, rampup=(4, 4, 100)) for r in range(2)]
    ref_batches = _epoch(ref)
    a = _loader(n=160, rampup=(4, 4, 100))
    take(a, 6)  # mid-ramp (sizes 4, 4, 4, 4, 8, 8 ...)
    state = json.loads(json.dumps(a.state_dict()))
    # On 4 data ranks (batch_size 4: the same final global batch 16) the ramp still divides.
    wide = [_loader(n=160, rank=r, dp=4, batch=4, rampup=(4, 4, 100)) for r in range(4)]
    for lo in wide:
        lo.load_state_dict(state)
    rest = _epoch(wide)
    expected = [sorted(x + y) for x, y in zip(*ref_batches, strict=True)][6:]
    assert [sorted(i for r in rest for i in r[k]) for k in range(len(rest[0]))] == expected


def test_resume_on_a_dp_size_the_ramp_does_not_divide_is_refused_by_name():
    with pytest.raises(ValueError, match=r"global batch 4 of the ramp .* 3 data ranks = 3.*"):
        _loader(n=160, dp=3, batch=4, rampup=(4, 4, 100))  # G = 12, but start 4 on 3 ranks


def test_resize_mid_ramp_continues_exactly():
    ref = _epoch([_loader(n=160, rank=r, rampup=(4, 4, 100)) for r in range(2)])
    loaders = [_loader(n=160, rank=r, rampup=(4, 4, 100)) for r in range(2)]
    first = [take(lo, 5) for lo in loaders]
    with pytest.raises(ValueError, match="global batch 4 of the ramp .* = 8"):
        loaders[0].resize({"dp": 8}, rank=0)  # 8 divides the final 16, not the 4 still ahead
    assert loaders[0].data_world_size == 2  # nothing changed by the refused resize
    state = loaders[0].state_dict()
    for r in range(2):
        loaders[r].resize({"dp": 4}, rank=r)
    joined = [_loader(n=160, rank=r, dp=4, batch=4, rampup=(4, 4, 100)) for r in (2, 3)]
    for lo in joined:  # ranks that join take a peer's position
        lo.load_state_dict(state)
    wide = loaders + joined
    rest = _epoch(wide)
    got = [sorted(i for f in first for i in f[k].tolist()) for k in range(5)]
    got += [sorted(i for r in rest for i in r[k]) for k in range(len(rest[0]))]
    assert got == [sorted(x + y) for x, y in zip(*ref, strict=True)]
    wide[0].resize({"dp": 8}, rank=0)  # past the ramp only the final 16 is ahead: 8 divides it
    assert (wide[0].data_world_size, wide[0].batch_size) == (8, 2)


def test_a_ramp_the_data_ranks_do_not_divide_is_refused_with_the_fixes():
    with pytest.raises(ValueError) as err:
        _loader(dp=4, batch=8, rampup=(6, 2, 60))
    msg = str(err.value)
    assert "global batch 6 of the ramp" in msg and "= 4" in msg
    assert "round_down=True" in msg and "uneven=True" in msg


def test_round_down_matches_megatrons_decrease_batch_size_if_needed():
    rampup = BatchRampup(start=6, increment=2, samples=60, round_down=True)
    out = _epoch([_loader(dp=4, batch=8, rampup=rampup, shuffle=False, rank=r) for r in range(4)])
    sizes = [sum(len(r[k]) for r in out) for k in range(len(out[0]))]
    assert all(s % 4 == 0 for s in sizes)
    # raw sizes 6 + 2 * int(consumed / (60 / 13)): consumed 0, 4, 8, 16 give 6, 6, 8, 12,
    # each rounded down to a multiple of 4 (and the rounded size is what is consumed)
    assert sizes[:4] == [4, 4, 8, 12] and sizes[-1] == 32
    _check_exactly_once(out, positions_in_order=True)


def test_round_down_resume_on_ranks_that_round_otherwise_is_refused():
    rampup = BatchRampup(start=6, increment=2, samples=60, round_down=True)
    a = _loader(dp=2, batch=16, rampup=rampup)
    take(a, 3)
    b = _loader(dp=4, batch=8, rampup=rampup)
    with pytest.raises(ValueError, match="rounds the ramp's global batches to multiples of 2"):
        b.load_state_dict(a.state_dict())


def test_uneven_serves_every_sample_with_equal_steps_and_shares_within_one():
    rampup = BatchRampup(start=5, increment=5, samples=40, uneven=True)
    out = _epoch([_loader(n=97, dp=3, batch=5, rampup=rampup, rank=r) for r in range(3)])
    for k in range(len(out[0])):
        lens = [len(r[k]) for r in out]
        assert max(lens) - min(lens) <= 1
    assert any(len({len(r[k]) for r in out}) > 1 for k in range(len(out[0])))
    _check_exactly_once(out)
    with pytest.raises(ValueError, match="a rank would get an empty batch"):
        _loader(dp=4, rampup=BatchRampup(start=3, increment=1, samples=40, uneven=True))


def test_checkpoint_of_another_ramp_or_of_none_is_refused_by_name():
    plain = DataLoader(list(range(200)), batch_size=8, mesh={"dp": 2}, rank=0, seed=SEED)
    ramped = _loader()
    with pytest.raises(ValueError, match="checkpoint has batch-size ramp None"):
        ramped.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="but this loader has None"):
        plain.load_state_dict(ramped.state_dict())
    with pytest.raises(ValueError, match="'rampup_increment': 4"):
        _loader(rampup=(4, 2, 60)).load_state_dict(ramped.state_dict())
    other = _loader(rampup=(4, 2, 60))
    other.load_state_dict(ramped.state_dict(), allow_global_batch_change=True)  # asked for


def _stream(n_shards=3, rows=37):
    return ShardedStream(
        [lambda s=s: range(s * 1000, s * 1000 + rows) for s in range(n_shards)], seed=5
    )


def test_stream_loader_ramps_exactly_once_and_resumes():
    loaders = [
        StreamLoader(_stream(), batch_size=8, mesh={"dp": 2}, rank=r, rampup=(4, 4, 60))
        for r in range(2)
    ]
    out = _epoch(loaders)
    seen = _check_exactly_once(out)
    assert len(seen) + loaders[0].stats()["unread_rows"] == 111
    assert [len(b) for b in out[0]][:6] == [2, 2, 2, 2, 2, 4]
    assert_resume_equivalence(
        lambda: StreamLoader(_stream(), batch_size=8, mesh={"dp": 2}, rank=1, rampup=(4, 4, 150)),
        num_items=30,
    )


class Items:
    def __len__(self):
        return 150

    def __getitem__(self, i):
        return torch.tensor([i])


def _ramp_rank(rank, world):
    mesh = DataMesh.from_sizes(world_size=world, dp=world)
    loader = DataLoader(Items(), batch_size=4, mesh=mesh, seed=SEED, rampup=(3, 3, 45))
    first = [b.view(-1).tolist() for b in loader]
    loader.set_epoch(1)
    take(loader, 4)
    state = loader.state_dict()
    rest = [b.view(-1).tolist() for b in loader]
    again = DataLoader(Items(), batch_size=4, mesh=mesh, seed=SEED, rampup=(3, 3, 45))
    again.load_state_dict(state)
    resume_ok = [b.view(-1).tolist() for b in again] == rest
    # A rank built with another ramp is refused on every rank before the first batch.
    ramp = (3, 3, 45) if rank else (6, 3, 45)
    odd = DataLoader(Items(), batch_size=4, mesh=mesh, seed=SEED, rampup=ramp, timeout=60)
    try:
        next(iter(odd))
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    return {"epoch0": first, "resume_ok": resume_ok, "refused": refused}


@pytest.mark.slow
def test_three_gloo_ranks_serve_every_sample_once_over_a_ramp():
    results = run_distributed(_ramp_rank, 3)
    per_rank = [r["epoch0"] for r in results]
    seen = _check_exactly_once(per_rank)
    assert 0 <= 150 - len(seen) < 12  # only the last incomplete global batch dropped
    assert [sum(len(r[k]) for r in per_rank) for k in range(6)] == [3, 3, 3, 3, 3, 6]
    assert all(r["resume_ok"] for r in results)
    assert all("disagree on rampup_start: rank i holds [6, 3, 3]" in r["refused"] for r in results)
    sim = [
        DataLoader(Items(), batch_size=4, mesh={"dp": 3}, rank=r, seed=SEED, rampup=(3, 3, 45))
        for r in range(3)
    ]
    assert [[b.view(-1).tolist() for b in lo] for lo in sim] == per_rank


def test_make_plan_ramps_only_when_asked_and_moves_to_other_ranks():
    from meshfeed.options import LoaderOptions
    from meshfeed.order.batches import BatchPlan
    from meshfeed.order.rampup_plan import make_plan

    order = ShuffledOrder(100, seed=0)
    plain = make_plan(order, LoaderOptions(batch_size=4), data_world_size=2)
    assert type(plain) is BatchPlan and plain.global_batch_size == 8 and plain.facts() == {}
    assert plain.with_ranks(4).data_world_size == 4
    ramped = make_plan(order, LoaderOptions(batch_size=4, rampup=(2, 2, 30)), data_world_size=2)
    assert isinstance(ramped, RampupPlan) and ramped.facts()["rampup_start"] == 2
    assert ramped.with_ranks(1).steps(0) == ramped.steps(0)  # the steps never depend on dp
    with pytest.raises(ValueError, match="global batch 2 of the ramp"):
        ramped.with_ranks(4)


def test_a_later_epoch_is_the_same_whether_walked_to_or_jumped_to():
    walked = _loader(n=70, rampup=(4, 4, 150))
    for _ in range(3):
        _epoch([walked])
    jumped = _loader(n=70, rampup=(4, 4, 150))
    jumped.set_epoch(3)  # the samples consumed before epoch 3 are computed, not replayed
    assert _epoch([jumped]) == _epoch([walked])


def test_worker_processes_serve_the_ramp_exactly_once():
    loaders = [_loader(n=90, rank=r, rampup=(4, 4, 60), num_workers=2) for r in range(2)]
    try:
        out = _epoch(loaders)
    finally:
        for lo in loaders:
            lo.shutdown()
    _check_exactly_once(out)
    assert out == _epoch([_loader(n=90, rank=r, rampup=(4, 4, 60)) for r in range(2)])


def test_unserved_counts_each_epochs_dropped_rest_under_the_ramp():
    plan = _loader(n=70, rampup=(4, 4, 150)).plan
    rests = [70 - plan.consumed(e) for e in range(4)]
    assert len(set(rests)) > 1  # the batch size at an epoch's end differs along the ramp
    assert plan.unserved(4) == sum(rests)
