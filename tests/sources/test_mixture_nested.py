"""A Mixture as a source of a Mixture: walked by its own order, so its weights hold inside the
outer one's share (it was walked as a plain concatenation: a 1:9 mixture came out 1:1), resumed
exactly and in O(1) (its counts travel in the checkpoint); its weights are fixed there."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from meshfeed import DataLoader, LazyDataset, Mixture
from meshfeed.testing import assert_resume_equivalence, take

A, B, C, D, E = (np.arange(k * 10_000, k * 10_000 + 500) for k in range(5))


def _name(x: int) -> str:
    return "abcde"[int(x) // 10_000]


def _inner(weights=None) -> Mixture:
    return Mixture({"a": A, "b": B}, weights or {"a": 1, "b": 9}, seed=3)


def _outer(inner, **kw) -> Mixture:
    return Mixture({"ab": inner, "c": C}, {"ab": 1, "c": 1}, seed=0, **kw)


def _loader(mix, **kw) -> DataLoader:
    return DataLoader(mix, batch_size=20, seed=1, mesh={"dp": 1}, rank=0, **kw)


@pytest.mark.parametrize("wrap", [False, True], ids=["mixture", "lazy-mixture"])
def test_the_inner_weights_hold_inside_the_outer_share(wrap):
    inner = _inner()
    source = LazyDataset(inner).map(int) if wrap else inner
    flat = [x for b in take(_loader(_outer(source)), 50) for x in np.asarray(b).tolist()]
    counts = collections.Counter(map(_name, flat))
    assert counts == {"a": 50, "b": 450, "c": 500}
    # each inner source is walked as a permutation: no repeat within its pass
    assert len({x for x in flat if _name(x) == "b"}) == 450


def _five() -> Mixture:
    # four irregular weights: the sequential earliest-deadline interleave, which a resume
    # re-seeds from the counts in the checkpoint
    inner = Mixture({"a": A, "b": B, "d": D, "e": E}, {"a": 1.1, "b": 2.3, "d": 0.7, "e": 3.9})
    return Mixture({"inner": inner, "c": C}, {"inner": 3, "c": 1}, seed=5)


def test_a_nested_mixture_resumes_exactly_at_every_step_and_across_epochs():
    out = assert_resume_equivalence(lambda: _loader(_five(), collate_fn=list), num_items=60)
    assert len(out) == 60


def test_the_checkpoint_carries_the_nested_counts_so_a_resume_is_o1():
    loader = _loader(_five())
    take(loader, 37)
    state = json.loads(json.dumps(loader.state_dict()))
    nested = state["order"]["streams"]["inner"]
    consumed = state["order"]["consumed"]["inner"]
    assert (
        nested["stream_position"] == consumed > 0 and sum(nested["consumed"].values()) == consumed
    )
    resumed = _loader(_five())
    resumed.load_state_dict(state)
    inner_order = resumed.plan.order._own[0]
    assert inner_order.returned_until == consumed  # seeded there, not walked from 0
    assert [b.tolist() for b in take(resumed, 3)] == [b.tolist() for b in take(_loader_at(37), 3)]


def _loader_at(n: int) -> DataLoader:
    loader = _loader(_five())
    take(loader, n)
    return loader


def test_a_nested_mixture_keeps_its_weights_fixed():
    inner = _inner()
    loader = _loader(_outer(inner))
    take(loader, 2)
    with pytest.raises(ValueError, match="source 'ab' of another mixture.*Flatten"):
        inner.reweight(10, {"a": 1, "b": 1})
    scheduled = _inner({0: {"a": 1, "b": 9}, 5: {"a": 1, "b": 1}})
    with pytest.raises(ValueError, match="source 'ab' is a Mixture with a weight schedule"):
        _loader(_outer(scheduled))


def test_a_nested_mixtures_own_epoch_is_not_checked_against_the_global_batch():
    # Its draws are counted in its own draws, not in global batches: an epoch of 7 is fine.
    inner = Mixture({"a": A, "b": B}, {"a": 1, "b": 9}, seed=3, samples_per_epoch=7)
    assert len(take(_loader(_outer(inner)), 3)) == 3
    with pytest.raises(ValueError, match="not a multiple of the global batch size 20"):
        _loader(inner)  # walked by a loader itself, it is checked
