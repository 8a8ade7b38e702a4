"""A Mixture pickles (spawned worker processes, Ray actors): the loaders' orders it holds
weakly for ``reweight`` stay behind. It could not be pickled at all (a WeakSet), so
``num_workers`` with ``multiprocessing_context="spawn"`` (macOS's default) failed on any
mixture."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from meshfeed import DataLoader, LazyDataset, Mixture
from meshfeed.testing import take


def _mixture() -> Mixture:
    weights = {0: {"a": 1, "b": 1}, 3: {"a": 1, "b": 3}}
    return Mixture({"a": np.arange(100), "b": np.arange(1000, 1100)}, weights, seed=0)


def test_a_mixture_round_trips_through_pickle_without_its_orders():
    mix = _mixture()
    loader = DataLoader(mix, batch_size=8, seed=1)  # registers an order with the mixture
    copy = pickle.loads(pickle.dumps(mix))
    assert copy.schedule == mix.schedule and copy.fingerprint == mix.fingerprint
    assert [copy[i] for i in (0, 150)] == [mix[i] for i in (0, 150)]
    assert len(copy._orders) == 0 and len(mix._orders) == 1 and loader.order is not None
    copy.reweight(9, {"a": 0, "b": 1})  # the copy is a mixture of its own
    assert len(copy.schedule) == 3 and len(mix.schedule) == 2


@pytest.mark.slow
@pytest.mark.parametrize("lazy", [False, True])
def test_spawned_workers_serve_a_mixture_as_the_loop_does(lazy):
    def make(**kw):
        data = LazyDataset(_mixture()).map(int) if lazy else _mixture()
        return DataLoader(data, batch_size=8, seed=1, warn_wait_share=None, **kw)

    spawned = make(num_workers=1, multiprocessing_context="spawn", timeout=120)
    try:
        got = [np.asarray(b).tolist() for b in take(spawned, 6)]
    finally:
        spawned.shutdown()
    assert got == [np.asarray(b).tolist() for b in take(make(), 6)]
