"""The store door on the shared services (#33): ``service=`` and ``num_workers`` make the same
batches as fetching in the loop; worker processes fetch from the embedded store through the
loader's process, in index order; a dropped loader leaves nothing behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
import weakref
from typing import Any

import pytest

from meshfeed.queue import Batch, RankAwareSampler, RequestCancelled, SampleStore, StoreLoader
from meshfeed.queue.loading.reach import LocalDoor
from meshfeed.services import InProcessService, ThreadService, WorkerService
from meshfeed.testing import assert_resume_equivalence
from tests.process_checks import alive
from tests.queue.checkpointable import StoreWithLoader


def _ids(batch: Batch) -> list[Any]:
    return list(batch.ids)


def _loader(store: SampleStore, **kw: Any) -> StoreLoader:
    args: dict[str, Any] = dict(
        task="t", fields=["x"], partition="p", batch_size=5, mesh={"dp": 1}, rank=0,
        timeout=30, collate_fn=_ids,
    )  # fmt: skip
    return StoreLoader(store, **{**args, **kw})


def _produce(store: SampleStore, n: int) -> threading.Thread:
    """Puts samples 0..n-1 one at a time, slowly (the loader's requests wait for them)."""

    def run() -> None:
        for i in range(n):
            store.put("p", {"x": [i]})
            time.sleep(0.002)
        store.close("p")

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "how",
    [
        {"prefetch": 1},
        {"service": InProcessService()},
        {"service": ThreadService(3)},
        {"num_workers": 3, "prefetch": 2},
        {"service": WorkerService(2, prefetch=1, timeout=30, max_chunk=1)},
    ],
    ids=["loop", "in-process", "thread", "3-workers", "worker-service"],
)
def test_every_service_makes_the_batches_of_fetching_in_the_loop_while_producers_put(how):
    """Requests reach the store in index order however many workers ask (a worker's request
    for batch j+1 waits for j's): batch j is always samples 5j..5j+4."""
    store = SampleStore()
    producer = _produce(store, 63)
    with _loader(store, **how) as loader:
        got = list(loader)
    producer.join()
    assert got == [list(range(i, min(i + 5, 63))) for i in range(0, 63, 5)]
    assert multiprocessing.active_children() == []


def _door() -> StoreWithLoader:
    """A StoreLoader with worker processes and its store."""
    store = SampleStore()
    store.put("p", {"x": list(range(40))})
    store.close("p")
    return StoreWithLoader(store, _loader(store, num_workers=2, prefetch=2))


@pytest.mark.slow
def test_worker_processes_fetching_from_the_embedded_store_resume_exactly_at_every_step():
    out = assert_resume_equivalence(
        _door, num_items=8, max_epochs=1, cleanup=lambda door: door.loader.shutdown()
    )
    assert out == [list(range(i, i + 5)) for i in range(0, 40, 5)]
    assert multiprocessing.active_children() == []


def test_a_dropped_loader_is_collected_at_once_and_stops_its_workers_and_door():
    store = SampleStore()
    store.put("p", {"x": list(range(30))})
    loader = _loader(store, num_workers=2)
    assert next(loader) == [0, 1, 2, 3, 4]
    pids = list(loader.service.pids)  # type: ignore[attr-defined]
    address = loader._door.reach.address  # type: ignore[union-attr]
    ref = weakref.ref(loader)
    gc.disable()  # no cycle: reference counting alone collects it
    try:
        del loader
        assert ref() is None
    finally:
        gc.enable()
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(address)  # the door's socket is gone
    assert store.stats()["waiting_consumers"] == 0


def test_the_door_serves_a_walk_in_index_order_and_an_older_walk_at_once():
    store = SampleStore()
    store.put("p", {"x": list(range(6))})
    door = LocalDoor(store)
    results: dict[str, Any] = {}

    def ask(name: str, token: str, index: int, timeout: float = 10) -> None:
        try:
            results[name] = door.reach.connect().get(
                "t", ["x"], 2, "p", RankAwareSampler(data_rank=0), timeout=timeout,
                token=token, batch_index=index,
            )  # fmt: skip
        except Exception as exc:
            results[name] = exc

    def asking(name: str, token: str, index: int) -> threading.Thread:
        thread = threading.Thread(target=ask, args=(name, token, index))
        thread.start()
        time.sleep(0.2)
        assert name not in results  # it waits for its turn
        return thread

    door.open("old", 0)
    old = asking("old", "old", 1)  # batch 0 of the old walk never comes ...
    store.cancel("old")
    door.open("new", 0)  # ... a new walk: the old request is answered (refused) at once
    old.join(5)
    assert isinstance(results["old"], RequestCancelled)
    early = asking("new 1", "new", 1)  # asked first, served second
    ask("new 0", "new", 0)
    early.join(5)
    assert (results["new 0"].ids, results["new 1"].ids) == ([0, 1], [2, 3])
    ask("late", "new", 3, timeout=0.3)  # batch 2 never comes: its own timeout
    assert isinstance(results["late"], TimeoutError)
    assert "batch 3 waited 0.3 s" in str(results["late"])
    door.close()


def test_bad_services_and_options_are_refused_by_name():
    store = SampleStore()
    with pytest.raises(ValueError, match="prefetch=3 would be ignored"):
        _loader(store, service=ThreadService(2), prefetch=3)
    with pytest.raises(TypeError, match="service=object is not a meshfeed.protocols.Bounded"):
        _loader(store, service=object())


def test_the_door_serves_get_to_another_process_and_a_forked_copy_never_closes_it():
    store = SampleStore()
    store.put("p", {"x": [7, 8]})
    door = LocalDoor(store)
    pid = os.fork()
    if pid == 0:  # a worker's copy: closing it must leave the parent's socket alone
        door.close()
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(door.reach.address)
    remote = door.reach.connect()  # what a worker process calls in place of the store
    assert remote.get("t", ["x"], 2, "p", timeout=5).columns["x"] == [7, 8]
    with pytest.raises(TimeoutError):  # the store's own error reaches the caller
        remote.get("t", ["x"], 1, "p", timeout=0.1)
    door.close()
    assert not os.path.exists(door.reach.address)
