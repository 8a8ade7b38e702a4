"""A closed partition drained by eviction frees its per-sample tables (memory per step of the
README pattern, one partition per RL step, does not grow with the samples put), and a
compacted partition behaves as before: late puts refused, gets end, state round trip."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch

from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.queue.engine.core import PartitionClosed


def _step(store: SampleStore, i: int, n: int) -> None:
    part = f"step-{i}"
    store.put(part, {"x": torch.zeros(n, 2)}, ids=[f"{i}/{k}" for k in range(n)])
    store.close(part)
    with StoreLoader(store, task="actor", fields=["x"], partition=part, batch_size=32) as ld:
        for _ in ld:
            pass


def _bytes_per_step(n: int, steps: int = 60) -> float:
    store = SampleStore(tasks=["actor"])
    for i in range(10):
        _step(store, i, n)
    gc.collect()
    tracemalloc.start()
    try:
        m0 = tracemalloc.get_traced_memory()[0]
        for i in range(10, 10 + steps):
            _step(store, i, n)
        gc.collect()
        m1 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert store.stats()["held"] == 0
    return (m1 - m0) / steps


def test_drained_partitions_do_not_keep_per_sample_memory():
    # Each partition keeps a small, fixed record (stats and state_dict name it); what it
    # held per sample goes: 8x the samples per step must not cost more per step.
    small, large = _bytes_per_step(64), _bytes_per_step(512)
    assert large < 8_000, large  # was ~50 KB per step (~100 B per sample put)
    assert large - small < 2_000, (small, large)


def _drained(store: SampleStore, part: str = "p") -> None:
    store.put(part, {"x": torch.arange(40.0).reshape(20, 2)}, ids=[f"k{k}" for k in range(20)])
    store.close(part)
    with StoreLoader(store, task="actor", fields=["x"], partition=part, batch_size=4) as ld:
        assert sum(len(b["x"]) for b in ld) == 20


def test_compacted_partition_frees_tables_and_behaves_the_same():
    store = SampleStore(tasks=["actor"])
    _drained(store)
    part = store._backend.core.partitions["p"]
    # The emptied tables are freed (a dict that held 20 keys is bigger than an empty one).
    assert len(part.samples) == 0
    assert part.samples.__sizeof__() == {}.__sizeof__()
    for pending in part.pending.values():
        assert pending.__sizeof__() == {}.__sizeof__()
    for consumed in part.consumed.values():
        assert consumed.__sizeof__() == set().__sizeof__()
    stats = store.stats()
    assert stats["held"] == 0 and stats["produced"] == 20
    assert stats["partitions"]["p"]["samples"] == 0
    assert stats["partitions"]["p"]["closed"] is True
    assert stats["partitions"]["p"]["fields"] == {"x": 0}
    with pytest.raises(ValueError, match="is closed"):
        store.put("p", {"x": torch.zeros(1, 2)})
    with pytest.raises(PartitionClosed, match="closed and drained"):
        store.get("actor", ["x"], 4, "p", timeout=1)
    with pytest.raises(PartitionClosed, match="closed and drained"):
        store.get("other", ["x"], 4, "p", timeout=1)  # a task new to it: nothing pending
    state = store.state_dict()
    other = SampleStore(tasks=["actor"])
    _drained(other)
    other.load_state_dict(state)
    assert other.state_dict() == state
    restored = other.stats()["partitions"]["p"]
    assert (restored["samples"], restored["closed"]) == (0, True)
    with pytest.raises(ValueError, match="is closed"):
        other.put("p", {"x": torch.zeros(1, 2)})


def test_drained_then_closed_partition_is_compacted():
    store = SampleStore(tasks=["actor"])
    store.put("p", {"x": torch.zeros(20, 2)}, ids=[f"k{k}" for k in range(20)])
    for _ in range(5):
        store.get("actor", ["x"], 4, "p", timeout=1)
    part = store._backend.core.partitions["p"]
    assert len(part.samples) == 0 and part.samples.__sizeof__() > {}.__sizeof__()
    store.close("p")
    assert part.samples.__sizeof__() == {}.__sizeof__()
    with pytest.raises(ValueError, match="is closed"):
        store.put("p", {"x": torch.zeros(1, 2)})
    with pytest.raises(PartitionClosed, match="closed and drained"):
        store.get("actor", ["x"], 4, "p", timeout=1)
