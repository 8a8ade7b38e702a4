"""Ray backend specifics: payloads travel by reference; named stores; pickled handles.

Producers and consumers in other processes: see test_queue_distributed.py."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed.queue import SampleStore
from meshfeed.queue.engine.core import StoreOptions
from meshfeed.testing import reset_store, store_chunk_kinds, store_held_types


def _fresh(ray_store: SampleStore, **kwargs) -> SampleStore:
    options = StoreOptions(**kwargs)
    return reset_store(ray_store, options)


@pytest.mark.ray
def test_large_fields_travel_through_the_object_store_not_the_actor(ray_store):
    store = _fresh(ray_store)
    big = np.random.default_rng(0).random((4, 131072))  # 1 MiB per sample
    store.put("p", {"obs": big, "reward": [0.0, 1.0, 2.0, 3.0]})
    stats = store.stats()
    assert store_held_types(store) == ["Cell", "float"]  # rows of a chunk...
    assert store_chunk_kinds(store) == ["RemoteChunk"]  # ...the actor holds its reference only
    assert stats["bytes_in_object_store"] == big.nbytes
    assert stats["bytes_held"] < 1024
    batch = store.get("t", ["obs", "reward"], 4, "p", timeout=10)
    assert np.array_equal(batch["obs"], big) and batch["reward"] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.ray
def test_connect_to_an_unknown_store_name_fails_clearly(ray_session):
    with pytest.raises(ValueError, match="no SampleStore named 'nope'"):
        SampleStore.connect("nope")


def test_a_name_needs_the_ray_backend():
    with pytest.raises(ValueError, match="pass backend='ray'"):
        SampleStore("embedded", name="x")


@pytest.mark.ray
def test_a_checkpoint_restores_into_a_ray_store_and_continues(ray_store, tmp_path):
    from meshfeed.queue.checkpoints.state import read_checkpoint

    source = SampleStore()
    source.put("p", {"obs": np.arange(6 * 20000.0).reshape(6, 20000), "r": list(range(6))})
    first = source.get("t", ["obs", "r"], 2, "p", timeout=1)
    source.save(tmp_path / "s.ckpt")
    store = _fresh(ray_store)
    store._backend.restore(*read_checkpoint(tmp_path / "s.ckpt"))  # what load(backend="ray") does
    assert store_held_types(store) == ["Ref", "int"]  # large fields went to the object store
    store.close("p")
    rest = store.get("t", ["obs", "r"], 10, "p", timeout=10)
    assert first.ids + rest.ids == list(range(6))
    assert np.array_equal(rest["obs"], np.arange(6 * 20000.0).reshape(6, 20000)[2:])
