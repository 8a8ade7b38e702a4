"""Consumers in Ray actor processes that die: nothing they were owed is lost, all is counted.

The issue's scenario ("4 of 10 samples lost, the store counted them consumed") in both of its
forms: a consumer process dies while its ``get`` waits inside the store actor (the actor gives
the wait up, nothing consumed), and one dies holding a leased batch (the actor notices the
process is gone and the batch returns to ready for another consumer)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from meshfeed.queue import PartitionClosed, SampleStore
from meshfeed.queue.engine.core import StoreOptions
from meshfeed.testing import reset_store

pytestmark = pytest.mark.ray


def _fresh(ray_store: SampleStore, **kwargs: Any) -> SampleStore:
    options = StoreOptions(**kwargs)
    return reset_store(ray_store, options)


class _Consumer:
    """A consumer in its own process (a Ray actor), killed by the test."""

    def get(self, store: SampleStore, n: int, timeout: float) -> list:
        return store.get("t", ["x"], n, "p", timeout=timeout, consumer="doomed").ids


def _until(check: Any, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {limit}s")
        time.sleep(0.05)


@pytest.mark.slow
def test_a_consumer_that_dies_while_its_get_waits_in_the_actor_loses_nothing(ray_store):
    import ray

    store = _fresh(ray_store)
    consumer = ray.remote(num_cpus=0)(_Consumer).remote()
    pending = consumer.get.remote(store, 10, 120.0)
    _until(lambda: store.stats()["waiting_consumers"] == 1, "the consumer's get waiting")
    ray.kill(consumer)
    _until(lambda: store.stats()["waiting_consumers"] == 0, "the actor giving the wait up")
    assert store.stats()["abandoned_waits"] >= 1
    store.put("p", {"x": list(range(10))})
    got = store.get("t", ["x"], 10, "p", timeout=10)
    assert got.ids == list(range(10))  # all 10 re-delivered, none counted for the dead one
    assert store.stats()["consumed"] == {"t": 10}
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pending, timeout=30)


@pytest.mark.slow
def test_a_consumer_that_dies_holding_a_leased_batch_is_reclaimed(ray_store):
    import ray

    store = _fresh(ray_store, lease_timeout=600.0)  # only the death can return it in time
    store.put("p", {"x": list(range(10))})
    consumer = ray.remote(num_cpus=0)(_Consumer).remote()
    owed = ray.get(consumer.get.remote(store, 4, 30.0), timeout=60)
    assert owed == [0, 1, 2, 3] and store.stats()["leases"] == 1
    ray.kill(consumer)
    got = store.get("t", ["x"], 10, "p", timeout=30)  # waits until the actor notices
    assert got.ids == list(range(10))
    stats = store.stats()
    assert stats["lease_expired"] == 4 and stats["consumed"] == {"t": 10}
    store.ack(got)
    assert store.stats()["leases"] == 0


@pytest.mark.slow
def test_a_living_consumer_keeps_its_lease_and_acknowledges_from_another_process(ray_store):
    import ray

    store = _fresh(ray_store, lease_timeout=600.0)
    store.put("p", {"x": list(range(6))})
    consumer = ray.remote(num_cpus=0)(_Consumer).remote()
    try:
        first = ray.get(consumer.get.remote(store, 3, 30.0), timeout=60)
        time.sleep(2.5)  # several liveness checks: a living consumer's lease stays
        assert store.stats()["leases"] == 1 and store.stats()["lease_expired"] == 0
        second = ray.get(consumer.get.remote(store, 3, 30.0), timeout=60)  # acks the first
        assert first + second == list(range(6)) and store.stats()["leases"] == 1
    finally:
        ray.kill(consumer)


class _Producer:
    """A rollout producer in its own process (a Ray actor), killed by the test."""

    def put(self, store: SampleStore, value: int, timeout: float) -> list:
        return store.put("p", {"x": [value]}, timeout=timeout)


@pytest.mark.slow
def test_a_producer_that_dies_while_its_put_waits_for_capacity_stores_nothing(ray_store):
    """A put blocked at capacity whose producer is killed must not land once room is freed:
    the restarted producer puts the sample again, and it is delivered once (#28)."""
    import ray

    store = _fresh(ray_store, capacity=1, tasks=("t",))
    store.put("p", {"x": [0]})
    producer = ray.remote(num_cpus=0)(_Producer).remote()
    pending = producer.put.remote(store, 1, 120.0)
    _until(lambda: store.stats()["waiting_producers"] == 1, "the producer's put waiting")
    ray.kill(producer)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pending, timeout=30)
    assert store.get("t", ["x"], 1, "p", timeout=10)["x"] == [0]  # frees the room it waits for
    _until(lambda: store.stats()["waiting_producers"] == 0, "the actor giving the put up")
    assert store.stats()["produced"] == 1 and store.stats()["held"] == 0  # nothing landed
    store.put("p", {"x": [1]}, timeout=10)  # the restarted producer
    store.close("p")
    assert store.get("t", ["x"], 1, "p", timeout=10)["x"] == [1]
    with pytest.raises(PartitionClosed):  # once, not twice
        store.get("t", ["x"], 1, "p", timeout=10)
    assert store.stats()["abandoned_waits"] >= 1


class _Rollout:
    """A rollout worker writing a sample's fields one put at a time (a partial rollout)."""

    def prompt(self, store: SampleStore, ids: list, version: int) -> None:
        store.put("p", {"prompt": [f"q{k}" for k in ids]}, ids=ids, version=version)

    def finish(self, store: SampleStore, ids: list, version: int) -> None:
        store.put("p", {"answer": [f"a{k}" for k in ids]}, ids=ids, version=version)


@pytest.mark.slow
def test_a_producer_killed_between_two_field_writes_loses_nothing(ray_store):
    """Partial rollouts (#30): a producer writes the prompts, dies before the answers; nothing
    half-written is served; a restarted producer finishes the samples under newer weights and
    each is served once, complete, with the version of its oldest field."""
    import ray

    store = _fresh(ray_store, tasks=("t",))
    first = ray.remote(num_cpus=0)(_Rollout).remote()
    ray.get(first.prompt.remote(store, [0, 1, 2, 3], 0))
    ray.kill(first)  # dies between the two writes
    with pytest.raises(TimeoutError):  # nothing half-written is served
        store.get("t", ["prompt", "answer"], 1, "p", timeout=0.5)
    second = ray.remote(num_cpus=0)(_Rollout).remote()
    try:
        ray.get(second.finish.remote(store, [3, 2, 1, 0], 1))
    finally:
        ray.kill(second)
    store.close("p")
    batch = store.get("t", ["prompt", "answer"], 8, "p", timeout=10)
    assert batch.ids == [0, 1, 2, 3] and batch["answer"] == ["a0", "a1", "a2", "a3"]
    assert batch.versions == [0, 0, 0, 0]
    newest = store.stats()["partitions"]["p"]
    assert newest["samples"] == 0  # served once, then dropped
    with pytest.raises(PartitionClosed):
        store.get("t", ["prompt", "answer"], 1, "p", timeout=5)
