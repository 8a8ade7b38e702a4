"""Ray data plane: large columns go to the object store once per put, the store actor holds
their references only, consumers fetch them directly, and a chunk lives exactly as long as a
task may still read it, even after its producer exited."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed.queue import SampleStore
from meshfeed.queue.backends.ray import PROBE_INTERVAL
from meshfeed.queue.engine.columns import Runs
from meshfeed.queue.engine.core import StoreOptions
from meshfeed.queue.request import GetRequest
from meshfeed.testing import refresh_chunks, reset_store, store_chunk_kinds, store_live_chunks

pytestmark = pytest.mark.ray

ROWS, WIDTH = 64, 4096  # 16 KiB float32 rows: a 1 MiB chunk per put


def _fresh(ray_store: SampleStore, **kwargs: Any) -> SampleStore:
    options = StoreOptions(**kwargs)
    return reset_store(ray_store, options)


def _column(seed: int) -> torch.Tensor:
    return torch.arange(ROWS * WIDTH, dtype=torch.float32).reshape(ROWS, WIDTH) + seed


class _Producer:
    def produce(self, store: SampleStore) -> list:
        return store.put("p", {"obs": _column(7), "r": list(range(ROWS))})


class _Reader:
    def read(self, store: SampleStore, seed: int = 7) -> tuple[list, float]:
        batch = store.get("t", ["obs"], ROWS, "p", timeout=30)
        return batch.ids, float((batch["obs"] - _column(seed)).abs().sum())


@pytest.mark.slow
def test_a_chunk_outlives_the_producer_that_put_it(ray_store):
    import ray

    store = _fresh(ray_store)
    producer = ray.remote(num_cpus=0)(_Producer).remote()
    assert ray.get(producer.produce.remote(store), timeout=60) == list(range(ROWS))
    ray.kill(producer)  # the process that put the column is gone
    reader = ray.remote(num_cpus=0)(_Reader).remote()  # a consumer in a third process
    try:
        ids, diff = ray.get(reader.read.remote(store), timeout=60)
    finally:
        ray.kill(reader)
    assert ids == list(range(ROWS)) and diff == 0.0


def test_the_actor_hands_out_references_and_the_consumer_fetches_the_rows(ray_store):
    import ray

    store = _fresh(ray_store)
    store.put("p", {"obs": _column(0)})
    assert store_chunk_kinds(store) == ["RemoteChunk"]
    assert store.stats()["bytes_held"] == 0
    assert store.stats()["bytes_in_object_store"] == ROWS * WIDTH * 4
    request = GetRequest(task="peek", fields=("obs",), batch_size=8, partition="p", timeout=10)
    reply = store._backend.actor.get.remote(request, None)
    ok, (ids, rows, lease, parts, versions) = ray.get(reply)
    assert ok and ids == list(range(8)) and lease is None and parts is versions is None
    column = rows["obs"]
    assert type(column) is Runs  # no tensor bytes in the actor's reply...
    assert [type(piece).__name__ for piece, _ in column.runs] == ["ObjectRef"]
    assert column.runs[0][1] == list(range(8))  # ...only which rows of which chunk
    batch = store.get("t", ["obs"], 8, "p", timeout=10)
    assert torch.equal(batch["obs"], _column(0)[:8])


def test_rows_of_several_chunks_and_of_small_inline_ones_gather_in_order(ray_store):
    store = _fresh(ray_store)
    small = np.full((2, WIDTH), -1.0, dtype=np.float32)  # 32 KiB: travels inline
    big = _column(3).numpy()
    store.put("p", {"obs": big[:32]}, ids=list(range(0, 64, 2)))
    store.put("p", {"obs": small}, ids=[1, 3])
    store.put("p", {"obs": big[32:]}, ids=list(range(5, 69, 2)))
    batch = store.get("t", ["obs"], 6, "p", timeout=10)
    assert batch.ids == [0, 2, 4, 6, 8, 10]  # sequential over production order: chunk 1 first
    assert np.array_equal(batch["obs"], big[:6])
    every = store.get("t", ["obs"], 58, "p", timeout=10)
    expect = {**{2 * i: big[i] for i in range(32)}, 1: small[0], 3: small[1]}
    expect.update({5 + 2 * i: big[32 + i] for i in range(32)})
    assert all(np.array_equal(every["obs"][j], expect[k]) for j, k in enumerate(every.ids))


def test_a_chunk_is_released_once_every_task_consumed_every_row(ray_store):
    store = _fresh(ray_store, tasks=("actor", "critic"))
    store.put("p", {"obs": _column(0)})
    assert store_live_chunks(store) == 1
    store.get("actor", ["obs"], ROWS, "p", timeout=10)
    store.get("critic", ["obs"], ROWS - 1, "p", timeout=10)
    assert store_live_chunks(store) == 1  # the critic may still read the last row
    store.get("critic", ["obs"], 1, "p", timeout=10)
    assert store_live_chunks(store) == 0 and store.stats()["bytes_in_object_store"] == 0
    store.put("q", {"obs": _column(1)})
    store.put("r", {"obs": _column(2)})
    assert store_live_chunks(store) == 2
    store.clear("q")
    store.delete("r", list(range(ROWS)))
    assert store_live_chunks(store) == 0


def test_tensor_columns_come_back_as_writable_tensors_of_their_dtype(ray_store):
    store = _fresh(ray_store)
    halves = torch.arange(ROWS * WIDTH, dtype=torch.float32).reshape(ROWS, WIDTH)
    store.put("p", {"f": _column(0), "b": halves.to(torch.bfloat16)})  # bf16: no numpy dtype
    batch = store.get("t", ["f", "b"], 16, "p", timeout=10)
    assert batch["f"].dtype == torch.float32 and batch["b"].dtype == torch.bfloat16
    assert torch.equal(batch["f"], _column(0)[:16])
    assert torch.equal(batch["b"], halves[:16].to(torch.bfloat16))
    batch["f"][0, 0] = -1.0  # the consumer's own memory, not the object store's
    again = store.peek("p", [0], ["f"])
    assert again["f"][0, 0] == 0.0 and again["f"].dtype == torch.float32


class _Owner:
    """A producer process that puts one chunk and reports the reference it handed over."""

    def produce(self, store: SampleStore) -> list:
        return store.put("p", {"obs": _column(5)})


def _handed_out_ref(store: SampleStore) -> Any:
    ok, (_, rows, _, _, _) = ray_get(
        store._backend.actor.get.remote(
            GetRequest(task="peek", fields=("obs",), batch_size=1, partition="p", timeout=10)
        )
    )
    assert ok
    return rows["obs"].runs[0][0]


def ray_get(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=60)


def _wait_for(predicate: Any, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
def test_a_live_producer_keeps_its_chunk_and_the_actor_copies_nothing(ray_store):
    import ray

    store = _fresh(ray_store)
    producer = ray.remote(num_cpus=0)(_Owner).remote()
    try:
        adopted = store.stats()["adopted_chunks"]  # counts over the actor's life
        ray_get(producer.produce.remote(store))
        ref = _handed_out_ref(store)
        time.sleep(PROBE_INTERVAL * 2.5)  # the watcher probed the producer at least twice
        assert store.stats()["adopted_chunks"] == adopted  # written once: by the producer
        assert _handed_out_ref(store) == ref
        assert torch.equal(store.get("t", ["obs"], ROWS, "p", timeout=10)["obs"], _column(5))
    finally:
        ray.kill(producer)


@pytest.mark.slow
def test_the_chunk_of_a_producer_seen_dead_is_adopted_and_still_read(ray_store):
    import ray

    store = _fresh(ray_store)
    producer = ray.remote(num_cpus=0)(_Owner).remote()
    adopted = store.stats()["adopted_chunks"]
    ray_get(producer.produce.remote(store))
    before = _handed_out_ref(store)
    ray.kill(producer)
    assert _wait_for(lambda: store.stats()["adopted_chunks"] == adopted + 1)
    after = _handed_out_ref(store)
    assert after != before  # now the actor's own object
    reader = ray.remote(num_cpus=0)(_Reader).remote()  # a consumer in a third process
    try:
        ids, diff = ray_get(reader.read.remote(store, 5))
    finally:
        ray.kill(reader)
    assert ids == list(range(ROWS)) and diff == 0.0


@pytest.mark.slow
def test_refresh_hands_out_the_adopted_chunk_of_a_dead_producer(ray_store):
    import ray

    store = _fresh(ray_store)
    producer = ray.remote(num_cpus=0)(_Owner).remote()
    adopted = store.stats()["adopted_chunks"]
    ray_get(producer.produce.remote(store))
    old = _handed_out_ref(store)
    ray.kill(producer)
    assert _wait_for(lambda: refresh_chunks(store, [old])[0] != old)
    (new,) = refresh_chunks(store, [old])
    assert store.stats()["adopted_chunks"] == adopted + 1
    assert np.array_equal(ray_get(new), _column(5).numpy())
    unknown = ray.put(0)
    assert refresh_chunks(store, [unknown]) == [unknown]  # not a chunk of this store


def test_a_consumer_whose_fetch_fails_asks_the_actor_for_the_current_references(
    ray_store, monkeypatch
):
    import ray

    store = _fresh(ray_store)
    store.put("p", {"obs": _column(2)})
    real_get, failed, refreshed = ray.get, [], []

    def get_once_lost(refs: Any, *args: Any, **kwargs: Any) -> Any:
        if type(refs) is list and not failed:  # the consumer's fetch of the chunks
            failed.append(refs)
            raise ray.exceptions.OwnerDiedError(refs[0].hex(), None, "")
        return real_get(refs, *args, **kwargs)

    actor = store._backend.actor
    real_refresh = actor.refresh

    class _Actor:  # the store actor, recording refresh calls
        def __getattr__(self, name: str) -> Any:
            if name == "refresh":
                refreshed.append(name)
                return real_refresh
            return getattr(actor, name)

    monkeypatch.setattr(ray, "get", get_once_lost)
    monkeypatch.setattr(store._backend, "actor", _Actor())
    batch = store.get("t", ["obs"], ROWS, "p", timeout=10)
    assert failed and refreshed == ["refresh"]  # the fetch failed once, then asked the actor
    assert torch.equal(batch["obs"], _column(2))  # the producer lives: the same chunk


def test_small_tensor_columns_travel_inline_and_come_back_as_writable_tensors(ray_store):
    import warnings

    store = _fresh(ray_store)
    tokens = torch.arange(64 * 8, dtype=torch.int64).reshape(64, 8)
    wide = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    halves = torch.linspace(0, 1, 64 * 8).reshape(64, 8).to(torch.bfloat16)  # no numpy dtype
    columns = {"tokens": tokens, "view": wide[:, ::2], "b": halves}  # a strided view too
    store.put("p", columns)
    assert store_chunk_kinds(store) == ["Chunk"]  # all inline, none in the object store
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable NumPy array" warning
        batch = store.get("t", ["tokens", "view", "b"], 64, "p", timeout=10)
    for name, expected in columns.items():
        got = batch[name]
        assert type(got) is torch.Tensor and got.dtype == expected.dtype
        assert torch.equal(got, expected), name
    batch["tokens"][0, 0] = -1  # the consumer's own memory
    assert store.peek("p", [0], ["tokens"])["tokens"][0, 0] == 0
