"""Leases: a batch stays owed until acknowledged; an expired or dropped lease re-delivers it.

Behaviour on both backends (``make_store``), the bookkeeping with a fake clock on the core,
the checkpoint of a store with outstanding leases. Consumers in processes that die: see
test_queue_leases_ray.py."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from meshfeed.queue import SampleStore
from meshfeed.queue.engine.core import StoreCore, StoreOptions
from meshfeed.queue.request import GetRequest, PutRequest
from meshfeed.queue.samplers import SequentialSampler


def _put(core: StoreCore, partition: str, rows: dict, ids: Any, groups: Any) -> Any:
    return core.try_put(PutRequest(partition=partition, rows=rows, ids=ids, groups=groups))


SEQ = SequentialSampler()
_ARGS = {"task": "t", "fields": ("x",), "batch_size": 2, "partition": "p", "sampler": SEQ}
_REQ = GetRequest(**_ARGS)


def test_without_lease_timeout_a_get_consumes_at_once_and_has_no_lease(make_store):
    store = make_store()
    store.put("p", {"x": list(range(4))})
    batch = store.get("t", ["x"], 4, "p", timeout=5)
    assert batch.lease is None and store.stats()["leases"] == 0
    store.ack(batch)  # nothing to acknowledge: a no-op
    assert store.stats()["consumed"] == {"t": 4} and store.stats()["lease_expired"] == 0


def test_an_acknowledged_batch_is_consumed_exactly_once(make_store):
    store = make_store(lease_timeout=0.3)
    store.put("p", {"x": list(range(6))})
    first = store.get("t", ["x"], 3, "p", timeout=5)
    assert first.lease is not None and store.stats()["leases"] == 1
    store.ack(first)
    time.sleep(0.5)  # past the timeout: an acknowledged lease never comes back
    second = store.get("t", ["x"], 3, "p", timeout=5)
    store.ack(second.lease)
    store.close("p")
    with pytest.raises(Exception, match="closed"):
        store.get("t", ["x"], 3, "p", timeout=5)
    assert first.ids + second.ids == list(range(6))
    stats = store.stats()
    assert stats["consumed"] == {"t": 6} and stats["lease_expired"] == 0 and stats["leases"] == 0
    with pytest.raises(ValueError, match="not outstanding"):
        store.ack(first)  # twice


def test_an_unacknowledged_batch_returns_after_the_timeout_to_another_consumer(make_store):
    store = make_store(lease_timeout=0.5)
    store.put("p", {"x": list(range(10))})
    lost = store.get("t", ["x"], 4, "p", timeout=5)  # a consumer that never acknowledges
    start = time.monotonic()
    # Another consumer waits for a full batch of 10: it is served only once the lease expires.
    again = store.get("t", ["x"], 10, "p", timeout=10)
    assert time.monotonic() - start >= 0.4
    assert sorted(again.ids) == list(range(10)) and again.ids[:4] == lost.ids  # in order
    stats = store.stats()
    assert stats["lease_expired"] == 4 and stats["consumed"] == {"t": 10}
    with pytest.raises(ValueError, match="expired"):
        store.ack(lost)


def test_the_next_get_of_a_consumer_acknowledges_its_previous_batch(make_store):
    store = make_store(lease_timeout=0.3)
    store.put("p", {"x": list(range(6))})
    a = store.get("t", ["x"], 2, "p", timeout=5, consumer="c0")
    b = store.get("t", ["x"], 2, "p", timeout=5, consumer="c0")  # acknowledges a
    assert store.stats()["leases"] == 1
    time.sleep(0.5)  # b expires, a does not come back
    rest = store.get("t", ["x"], 4, "p", timeout=5, consumer="c1")
    assert rest.ids == [*b.ids, 4, 5] and a.ids == [0, 1]
    assert store.stats()["lease_expired"] == 2


def test_a_consumer_known_dead_is_dropped_at_once(make_store):
    store = make_store(lease_timeout=600)
    store.put("p", {"x": list(range(4))})
    got = store.get("t", ["x"], 3, "p", timeout=5, consumer="w7")
    assert store.drop_consumer("w7") == 3
    assert store.get("t", ["x"], 4, "p", timeout=5).ids == [*got.ids, 3]
    assert store.stats()["lease_expired"] == 3
    with pytest.raises(TypeError, match="consumer must be"):
        store.drop_consumer(1.5)


def test_leased_samples_stay_held_against_capacity_until_acknowledged(make_store):
    store = make_store(capacity=2, tasks=["t"], lease_timeout=60)
    store.put("p", {"x": [0, 1]})
    batch = store.get("t", ["x"], 2, "p", timeout=5)
    with pytest.raises(TimeoutError):
        store.put("p", {"x": [2]}, timeout=0.2)  # still held: the consumer may die
    done = threading.Event()

    def produce() -> None:
        store.put("p", {"x": [2, 3]}, timeout=10)
        done.set()

    thread = threading.Thread(target=produce)
    thread.start()
    time.sleep(0.1)
    assert not done.is_set()
    store.ack(batch)  # frees the capacity and wakes the producer
    thread.join(10)
    assert done.is_set() and store.stats()["held"] == 2


def test_lease_options_are_refused_by_name():
    for bad in (0, -1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="lease_timeout must be"):
            SampleStore(lease_timeout=bad)
    store = SampleStore(lease_timeout=1)
    with pytest.raises(TypeError, match="ack takes the Batch"):
        store.ack(3)  # type: ignore[arg-type]


def test_core_expires_by_the_clock_it_is_given():
    core = StoreCore(StoreOptions(lease_timeout=10.0))
    _put(core, "p", {"x": [0, 1, 2]}, None, None)
    ids, _, _, _ = core.try_get(dataclasses.replace(_REQ, lease="L1"), now=100.0)
    assert ids == [0, 1]
    assert core.next_lease_deadline() == 110.0
    assert core.expire_leases(109.9) == 0 and "L1" in core.leases
    assert core.expire_leases(110.0) == 2 and "L1" not in core.leases
    assert core.stats()["consumed"] == {"t": 0}
    with pytest.raises(ValueError, match="needs a lease id"):
        core.try_get(_REQ, now=200.0)


def test_a_checkpoint_with_outstanding_leases_loads_them_as_ready(tmp_path):
    store = SampleStore(lease_timeout=600)
    store.put("p", {"x": list(range(6))})
    done = store.get("t", ["x"], 2, "p", timeout=5)
    store.ack(done)
    owed = store.get("t", ["x"], 2, "p", timeout=5)  # not acknowledged when saved
    store.save(tmp_path / "s.ckpt")
    state = store.state_dict()
    loaded = SampleStore.load(tmp_path / "s.ckpt")
    assert loaded.options.lease_timeout == 600
    stats = loaded.stats()
    assert stats["consumed"] == {"t": 2} and stats["lease_expired"] == 2 and stats["leases"] == 0
    rest = loaded.get("t", ["x"], 4, "p", timeout=5)
    assert rest.ids == [*owed.ids, 4, 5]
    # The same over load_state_dict on a store rebuilt from the same puts.
    rebuilt = SampleStore(lease_timeout=600)
    rebuilt.put("p", {"x": list(range(6))})
    rebuilt.load_state_dict(state)
    assert rebuilt.get("t", ["x"], 4, "p", timeout=5).ids == [2, 3, 4, 5]


class _LeasedConsumer:
    """A consumer of a leasing store; it acknowledges what it returned before a checkpoint
    (a batch it has not acknowledged is, by definition, one it may not have used)."""

    def __init__(self) -> None:
        self.store = SampleStore(lease_timeout=600)
        self.store.put("p", {"x": list(range(9))})
        self.store.close("p")
        self.last: str | None = None

    def __iter__(self) -> _LeasedConsumer:
        return self

    def __next__(self) -> list:
        try:
            batch = self.store.get("t", ["x"], 2, "p", timeout=5, consumer="c")
        except Exception as exc:  # PartitionClosed: the stream has ended
            raise StopIteration from exc
        self.last = batch.lease
        return batch.ids

    def state_dict(self) -> dict:
        if self.last is not None:
            self.store.ack(self.last)  # outstanding until now: the next get would ack it
            self.last = None
        return {"version": 1, "store": self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state["store"])


def test_a_leasing_consumer_passes_the_resume_harness():
    from meshfeed.testing import assert_resume_equivalence

    ref = assert_resume_equivalence(_LeasedConsumer, num_items=5)
    assert ref == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
