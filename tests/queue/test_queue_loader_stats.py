"""StoreLoader.stats() and epochs(): what the loader did, and the one epoch of a stream."""

from __future__ import annotations

import pytest

from meshfeed.loader_base import LoaderBase
from meshfeed.options import LoaderOptions
from meshfeed.queue import CollateError, SampleStore, StoreLoader


def _loader(store: SampleStore, **kwargs) -> StoreLoader:
    defaults = {"task": "t", "fields": ["x"], "partition": "p", "mesh": {"dp": 1}, "rank": 0}
    return StoreLoader(store, **{**defaults, **kwargs})


@pytest.mark.parametrize("prefetch", [1, 3])
def test_stats_count_batches_samples_and_the_stores_view_of_the_task(prefetch):
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": list(range(7))})
    store.close("p")
    loader = _loader(store, batch_size=3, prefetch=prefetch, timeout=5)
    before = loader.stats()
    assert before["batches"] == before["samples"] == 0 and not before["ended"]
    assert before["store"] == {
        "consumed": 0, "redelivered": 0, "waiting_consumers": 0, "samples": 7, "closed": True
    }  # fmt: skip
    assert [len(b) for b in loader] == [3, 3, 1]
    stats = loader.stats()
    assert (stats["batches"], stats["samples"], stats["in_flight"]) == (3, 7, 0)
    assert stats["ended"] and stats["epoch"] == 0 and stats["timeouts"] == 0
    assert stats["store"]["consumed"] == 7 and stats["store"]["samples"] == 0
    assert stats["next_seconds"] >= 0.0


def test_stats_count_timeouts_and_collate_errors():
    store = SampleStore()
    loader = _loader(store, batch_size=2, prefetch=1, timeout=0.2)
    with pytest.raises(TimeoutError):
        next(loader)
    assert loader.stats()["timeouts"] == 1

    def bad(batch):
        raise RuntimeError("bad batch")

    store.put("p", {"x": [1, 2]})
    failing = _loader(store, task="u", batch_size=2, prefetch=1, timeout=5, collate_fn=bad)
    with pytest.raises(CollateError):
        next(failing)
    assert failing.stats()["collate_errors"] == 1 and failing.stats()["batches"] == 0


def test_a_restored_loader_counts_the_batches_it_redelivers():
    store = SampleStore()
    store.put("p", {"x": list(range(6))})
    first = _loader(store, batch_size=2, prefetch=3, timeout=5)
    assert next(first).ids == [0, 1]
    state = first.state_dict()
    first.shutdown()
    again = _loader(store, batch_size=2, prefetch=3, timeout=5)
    again.load_state_dict(state)
    assert again.stats()["redelivered"] == 0  # counted as they are returned
    assert [next(again).ids for _ in range(2)] == [[2, 3], [4, 5]]  # were in flight
    assert again.stats()["redelivered"] == 2


def test_epochs_yields_the_one_epoch_of_a_stream_and_refuses_more():
    store = SampleStore()
    store.put("p", {"x": list(range(4))})
    store.close("p")
    loader = _loader(store, batch_size=2, prefetch=1, timeout=5)
    seen = [(epoch, batch.ids) for epoch in loader.epochs(1) for batch in loader]
    assert seen == [(0, [0, 1]), (0, [2, 3])]
    assert list(loader.epochs(1)) == []  # the stream has ended: nothing more to read
    assert list(_loader(store, batch_size=2).epochs(0)) == []
    with pytest.raises(ValueError, match="one epoch"):
        list(loader.epochs(2))
    with pytest.raises(ValueError, match="num_epochs must be an int >= 0"):
        list(loader.epochs(-1))


def test_the_store_loader_is_a_loader_base_with_one_validated_options_object():
    store = SampleStore()
    loader = _loader(store, batch_size=2, prefetch=3, timeout=7)
    assert isinstance(loader, LoaderBase)
    assert isinstance(loader.options, LoaderOptions)
    assert (loader.options.batch_size, loader.options.prefetch) == (2, 3)
    assert loader.options.on_error == "raise" and loader.timeout == 7.0
    assert loader.data_world_size == 1 and loader.epoch == 0
    loader.set_epoch(0)  # the one epoch: a no-op
    with pytest.raises(ValueError, match=r"one epoch \(got set_epoch\(1\)\)"):
        loader.set_epoch(1)
    with loader:
        pass
    with pytest.raises(RuntimeError, match="was shut down"):
        next(loader)
    loader.shutdown()  # idempotent
