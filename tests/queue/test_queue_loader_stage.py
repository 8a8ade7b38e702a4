"""The store door's delivery (#27): with ``device=`` (or ``pin_memory``) a delivery thread takes
batches ahead of the loop, as DataLoader's does, and the state stays exact: a batch taken
ahead but not returned is named as in flight, returned first, or re-delivered after a restore."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
import torch

from meshfeed.queue import Batch, SampleStore, StoreLoader
from meshfeed.testing import assert_resume_equivalence
from tests.queue.checkpointable import StoreWithLoader

POLL = 0.1  # the delivery thread checks its stop flag this often (meshfeed.delivery)


def _stack(batch: Batch) -> torch.Tensor:
    return torch.as_tensor(batch["x"]).view(-1)


def _store(n: int, *, close: bool = True, tasks: list[str] | None = None) -> SampleStore:
    store = SampleStore(tasks=tasks)
    if n:  # none: a partition nothing was put into yet
        store.put("p", {"x": [torch.tensor([i]) for i in range(n)]})
    if close:
        store.close("p")
    return store


def _loader(store: SampleStore, **kw: Any) -> StoreLoader:
    args: dict[str, Any] = dict(
        task="t", fields=["x"], partition="p", batch_size=2, mesh={"dp": 1}, rank=0,
        device="cpu", collate_fn=_stack,
    )  # fmt: skip
    return StoreLoader(store, **{**args, **kw})


def _consumed(loader: StoreLoader, at_least: int) -> int:
    """The store's consumed count once it reaches ``at_least`` (within 10 s)."""
    deadline = time.monotonic() + 10
    while (seen := loader.stats()["store"]["consumed"]) < at_least:
        assert time.monotonic() < deadline, f"the delivery thread took {seen} samples"
        time.sleep(0.01)
    return seen


def _delivery_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "meshfeed-delivery"]


@pytest.mark.parametrize("prefetch", [1, 3])
def test_the_delivery_thread_takes_batches_ahead_and_the_state_names_them(tmp_path, prefetch):
    store = _store(12, tasks=["t"])  # evicting: a batch lost could not come back
    loader = _loader(store, prefetch=prefetch, device_prefetch=2)
    assert next(loader).tolist() == [0, 1]
    # Taken ahead while the loop does nothing: requested (prefetch) plus held by the thread.
    _consumed(loader, 2 + 2 * max(3, prefetch + 1))
    state = loader.state_dict()  # at once: the thread goes on
    assert state["next"] == 1 and state["requested"] - state["next"] >= 3
    with pytest.raises(ValueError, match="same prefetch, device and device_prefetch"):
        _loader(_store(12), prefetch=prefetch, device=None).load_state_dict(state)
    store.save(tmp_path / "store.pt")
    rest = [b.tolist() for b in loader]  # the same loader goes on with what the thread took
    assert rest == [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    loader.shutdown()
    again_store = SampleStore.load(tmp_path / "store.pt")
    again = _loader(again_store, prefetch=prefetch, device_prefetch=2)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest  # a restore re-delivers them: nothing lost
    assert again.stats()["delivery"]["steps"] == 5
    again.shutdown()
    assert store.stats()["held"] == 0 and again_store.stats()["held"] == 0


def _door(prefetch: int) -> StoreWithLoader:
    """A StoreLoader delivering to ``device="cpu"`` with its store."""
    store = _store(14)
    return StoreWithLoader(store, _loader(store, prefetch=prefetch, device_prefetch=3))


@pytest.mark.parametrize("prefetch", [1, 2])
def test_resume_is_exact_at_every_step_with_the_delivery_thread_of_an_evicting_store(prefetch):
    out = assert_resume_equivalence(lambda: _door(prefetch), num_items=7, max_epochs=1)
    assert [b.tolist() for b in out] == [[i, i + 1] for i in range(0, 14, 2)]


def test_shutdown_stops_a_delivery_thread_waiting_for_producers_at_once():
    store = _store(2, close=False)
    loader = _loader(store, prefetch=2, timeout=60)
    assert next(loader).tolist() == [0, 1]
    time.sleep(0.2)  # the thread now waits in the store for samples nobody puts
    assert _delivery_threads()
    start = time.monotonic()
    loader.shutdown()
    assert time.monotonic() - start < POLL + 1.0
    assert not _delivery_threads()


def test_state_dict_while_the_thread_waits_for_producers_and_then_more_samples(tmp_path):
    store = _store(2, close=False)
    loader = _loader(store, prefetch=2, timeout=math.inf)
    assert next(loader).tolist() == [0, 1]
    time.sleep(0.2)
    start = time.monotonic()
    state = loader.state_dict()  # no wait for the batches in flight: the thread goes on
    assert time.monotonic() - start < 1.0 and _delivery_threads()
    assert state["next"] == 1 and state["requested"] >= 2
    store.save(tmp_path / "store.pt")
    store.put("p", {"x": [torch.tensor([i]) for i in range(2, 6)]})
    store.close("p")
    assert [b.tolist() for b in loader] == [[2, 3], [4, 5]]
    assert loader.stats()["ended"] and loader.stats()["in_flight"] == 0
    loader.shutdown()
    store = SampleStore.load(tmp_path / "store.pt")  # the crash: back to the checkpoint
    store.put("p", {"x": [torch.tensor([i]) for i in range(2, 6)]})
    store.close("p")
    again = _loader(store, prefetch=2, timeout=5)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == [[2, 3], [4, 5]]
    again.shutdown()


def test_a_timeout_on_the_delivery_thread_reaches_the_loop_and_the_loader_goes_on():
    store = _store(2, close=False)
    loader = _loader(store, prefetch=1, timeout=0.3)
    assert next(loader).tolist() == [0, 1]
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        next(loader)
    assert time.monotonic() - start < 0.3 + 1.0
    assert loader.stats()["timeouts"] == 1 and not _delivery_threads()
    store.put("p", {"x": [torch.tensor([2]), torch.tensor([3])]})
    store.close("p")
    assert [b.tolist() for b in loader] == [[2, 3]]
    loader.shutdown()


def test_resize_with_the_delivery_thread_is_refused_by_name_as_prefetch_is():
    # Measured: rounds a leaving rank's thread took ahead were lost in the live store.
    store = _store(12)
    loaders = [_loader(store, batch_size=2, mesh={"dp": 2}, rank=r, prefetch=1) for r in range(2)]
    assert [next(ld).tolist() for ld in loaders] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="device="):
        loaders[0].resize({"dp": 1}, rank=0)
    for ld in loaders:
        ld.shutdown()


def test_resize_with_worker_processes_is_refused_by_name_as_prefetch_is():
    # Workers fetch ahead of the loop (each worker has a batch in flight), as a thread does.
    store = _store(12)
    loader = _loader(store, batch_size=2, rank=0, prefetch=1, num_workers=2, device=None)
    assert next(loader).tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"its service \(WorkerService\)"):
        loader.resize({"dp": 1}, rank=0)
    loader.shutdown()
