"""A walk that only the cycle collector can free (an iterator kept in a cycle, such as a
trainer's ``self.it`` where the trainer is in one) is ended without making the code the
collection interrupted wait, on every door.

The collector runs on whatever thread allocates, inside whatever that thread is doing: here it
holds a lock of the user's that the loader's delivery thread waits for (a dataset, stream or
``collate_fn`` that takes it; a logging handler's lock is a common one). Ending the walk joins
that thread, which cannot go on until the collection ends: the collection waited for the
loader's ``timeout`` (60 s here, 300 s by default); where it held the store's own lock, forever
(``tests/queue/test_store_loader_shutdown.py``). Now that end runs on the ``meshfeed-reaper``
thread once the collection ends (:mod:`meshfeed.lifecycle`), and nothing is left behind.
"""

from __future__ import annotations

import gc
import multiprocessing
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from meshfeed import DataLoader, StreamLoader
from meshfeed.delivered import Delivered
from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.services import ThreadService
from meshfeed.sources import ShardedStream

#: The loader's own bound on waits: the old collection waited this long.
TIMEOUT = 60.0


class _Gate:
    """The first item read passes; every later one takes ``lock`` (held by the test while it
    collects)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting = threading.Event()
        self.reads = 0

    def __call__(self, i: int) -> int:
        self.reads += 1
        if self.reads > 1:
            self.waiting.set()
            with self.lock:
                pass
        return i


class _Items:
    def __init__(self, gate: _Gate) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([self.gate(i)])


def _map_style(gate: _Gate) -> Any:
    return DataLoader(_Items(gate), batch_size=1, device="cpu", timeout=TIMEOUT)


def _stream(gate: _Gate) -> Any:
    def shard() -> Any:
        return ({"x": torch.tensor([gate(i)])} for i in range(16))

    return StreamLoader(
        ShardedStream([shard], rows=[16]), batch_size=1, device="cpu", timeout=TIMEOUT
    )


def _store_loader(n: int, **kwargs: Any) -> StoreLoader:
    """A StoreLoader with a delivery thread over a closed partition of ``n`` samples."""
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": list(range(n))})
    store.close("p")
    return StoreLoader(
        store, task="t", fields=["x"], partition="p", mesh={"dp": 1}, rank=0, device="cpu",
        **kwargs,
    )  # fmt: skip


def _store(gate: _Gate) -> Any:
    return _store_loader(
        16, batch_size=1, timeout=TIMEOUT,
        collate_fn=lambda batch: torch.tensor([gate(batch.ids[0])]),
    )  # fmt: skip


DOORS: dict[str, Callable[[_Gate], Any]] = {
    "DataLoader": _map_style,
    "StreamLoader": _stream,
    "StoreLoader": _store,
}


def _delivery_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "meshfeed-delivery"]


@pytest.mark.parametrize("door", DOORS)
def test_a_walk_collected_in_a_cycle_does_not_make_the_collection_wait(door):
    before = set(_delivery_threads())
    gate = _Gate()
    gate.lock.acquire()  # the delivery thread stops at its second item, waiting for it
    try:
        loader = DOORS[door](gate)
        it = iter(loader)
        first = next(it)
        assert (first["x"] if isinstance(first, dict) else first).numel() == 1
        assert gate.waiting.wait(10), "the delivery thread did not go on to its next item"
        # A StoreLoader is its own iterator; a DataLoader's walk is an object of its own
        # (the loader stays: its delivery thread reads its plan).
        kept = None if it is loader else loader
        del loader
        cycle: list[Any] = [it]
        cycle.append(cycle)  # only the cycle collector can free the walk
        ref = weakref.ref(it)
        gc.disable()  # collected below, on this thread, and nowhere else
        try:
            del it, first, cycle
            start = time.monotonic()
            gc.collect()
            took = time.monotonic() - start
        finally:
            gc.enable()
        assert took < 5, f"the collection waited {took:.1f} s for the loader's threads"
    finally:
        gate.lock.release()
    deadline = time.monotonic() + 10
    while (set(_delivery_threads()) - before or ref() is not None) and time.monotonic() < deadline:
        time.sleep(0.02)
        gc.collect()
    assert not set(_delivery_threads()) - before, "the delivery thread was left running"
    assert ref() is None, "the walk was kept after its shutdown"
    if kept is not None:
        kept.shutdown()


def _numbers(**kwargs: Any) -> Callable[[Any], Any]:
    return lambda on_step: DataLoader(list(range(64)), batch_size=2, on_step=on_step, **kwargs)


def _stream_numbers(on_step: Any) -> Any:
    stream = ShardedStream([_rows], rows=[64])
    return StreamLoader(stream, batch_size=2, device="cpu", on_step=on_step)


def _rows() -> Any:
    return iter(range(64))


def _store_numbers(on_step: Any) -> Any:
    return _store_loader(64, batch_size=2, prefetch=2, on_step=on_step)


TRAINERS: dict[str, Callable[[Any], Any]] = {
    "DataLoader, delivery thread": _numbers(device="cpu"),
    "DataLoader, fetch thread": _numbers(service=ThreadService(prefetch=2)),
    "DataLoader, workers and delivery thread": _numbers(device="cpu", num_workers=2),
    "StreamLoader, delivery thread": _stream_numbers,
    "StoreLoader, fetch and delivery threads": _store_numbers,
    "Delivered over a DataLoader": lambda on_step: Delivered(
        DataLoader(list(range(64)), batch_size=2), device="cpu", on_step=on_step
    ),
}


class _Trainer:
    """A trainer as one writes it: its loader reports to its method (a cycle), and it keeps
    the loader's iterator part way through an epoch."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        self.loader = make(self.log)
        self.it = iter(self.loader)
        self.model = torch.zeros(1 << 20)  # what a leak would keep: 4 MiB here, a model there
        self.steps = 0

    def log(self, timing: Any) -> None:
        self.steps += 1


def _meshfeed_threads() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith("meshfeed") and t.name != "meshfeed-reaper"
    }


@pytest.mark.parametrize("make", TRAINERS.values(), ids=TRAINERS.keys())
def test_a_dropped_trainer_is_collected_with_its_loader_part_way_through_a_walk(make):
    # The loader's own threads held it (the delivery thread its telemetry and so its on_step,
    # the fetch thread its plan): a trainer dropped part way through an epoch stayed alive
    # with its model, its threads and its worker processes until the process ended.
    before = _meshfeed_threads()
    children = set(multiprocessing.active_children())  # an earlier test's, not ours
    trainer = _Trainer(make)
    next(trainer.it)
    next(trainer.it)
    assert trainer.steps == 2
    ref = weakref.ref(trainer)
    del trainer
    deadline = time.monotonic() + 10
    while (ref() is not None or _meshfeed_threads() - before) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    assert ref() is None, "the trainer was kept alive by its loader's threads"
    assert not _meshfeed_threads() - before, "the loader's threads were left running"
    deadline = time.monotonic() + 10
    while set(multiprocessing.active_children()) - children and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not set(multiprocessing.active_children()) - children, "workers left running"


def test_using_a_loader_starts_no_reaper():
    # Started only when a collection hands it something: a thread started with the first
    # loader made every later fork of a worker process warn on Python 3.12 ("multi-threaded,
    # use of fork() may lead to deadlocks in the child").
    code = (
        "import threading, meshfeed\n"
        "loader = meshfeed.DataLoader(list(range(32)), batch_size=4, num_workers=2, device='cpu')\n"
        "assert sum(1 for _ in loader) == 8\n"
        "loader.shutdown()\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "['MainThread']", out.stdout + out.stderr
