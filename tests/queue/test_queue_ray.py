"""Ray backend specifics: payloads by reference, producers and consumers in other processes."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed.queue import PartitionClosed, SampleStore, StreamingDataLoader
from meshfeed.queue.core import StoreOptions

pytestmark = pytest.mark.ray


def _fresh(ray_store: SampleStore, **kwargs) -> SampleStore:
    options = StoreOptions(**kwargs)
    ray_store._backend.reinit(options)
    return SampleStore._attach("ray", ray_store._backend, options)


def test_large_fields_travel_through_the_object_store_not_the_actor(ray_store):
    store = _fresh(ray_store)
    big = np.random.default_rng(0).random((4, 131072))  # 1 MiB per sample
    store.put("p", {"obs": big, "reward": [0.0, 1.0, 2.0, 3.0]})
    stats = store.stats()
    assert store._backend.held_types() == ["Ref", "float"]  # the actor holds references only
    assert stats["bytes_in_object_store"] == big.nbytes
    assert stats["bytes_held"] < 1024
    batch = store.get("t", ["obs", "reward"], 4, "p", timeout=10)
    assert np.array_equal(batch["obs"], big) and batch["reward"] == [0.0, 1.0, 2.0, 3.0]


class _Worker:
    """A Ray actor process that produces into or consumes from a store it was handed."""

    def produce(self, store: SampleStore, p: int, n: int) -> int:
        for i in range(0, n, 4):
            ids = [f"{p}-{j}" for j in range(i, i + 4)]
            store.put("p", {"obs": np.full((4, 32768), p, dtype=np.float32)}, ids=ids, timeout=60)
            store.put("p", {"reward": [float(p)] * 4}, ids=ids[::-1], timeout=60)
        return n

    def consume(self, store: SampleStore, task: str) -> list:
        seen = []
        while True:
            try:
                batch = store.get(task, ["obs", "reward"], 4, "p", timeout=60)
            except PartitionClosed:
                return seen
            assert batch["obs"].shape == (len(batch), 32768)
            seen.extend(batch.ids)

    def loader_ids(self, store: SampleStore, rank: int) -> list:
        loader = StreamingDataLoader(
            store, "train", ["reward"], 2, "q", mesh={"dp": 2, "tp": 2}, rank=rank, timeout=60
        )
        return [b.ids for b in loader]


@pytest.mark.slow
def test_exactly_once_with_four_producer_and_four_consumer_processes(ray_store):
    import ray

    store = _fresh(ray_store, capacity=32, tasks=["actor", "critic"])
    remote = ray.remote(num_cpus=0)(_Worker)
    workers = [remote.remote() for _ in range(8)]
    try:
        consumers = [
            w.consume.remote(store, t)
            for w, t in zip(workers[4:], ["actor", "critic"] * 2, strict=True)
        ]
        produced = ray.get(
            [w.produce.remote(store, p, 16) for p, w in enumerate(workers[:4])], timeout=120
        )
        store.close("p")
        got = ray.get(consumers, timeout=120)
        expected = sorted(f"{p}-{i}" for p in range(4) for i in range(16))
        assert sum(produced) == 64
        assert sorted(got[0] + got[2]) == expected  # task "actor": every sample exactly once
        assert sorted(got[1] + got[3]) == expected  # task "critic" likewise
        assert store.stats()["held"] == 0 and store.stats()["bytes_in_object_store"] == 0

        # The same processes as the ranks of a dp=2 x tp=2 mesh reading one stream.
        ranks = [w.loader_ids.remote(store, r) for r, w in enumerate(workers[4:])]
        store.put("q", {"reward": [float(i) for i in range(12)]})
        store.close("q")
        out = ray.get(ranks, timeout=120)
        assert out[0] == out[1] and out[2] == out[3]
        assert sorted(k for ids in out[0] + out[2] for k in ids) == list(range(12))
    finally:
        for w in workers:
            ray.kill(w)
