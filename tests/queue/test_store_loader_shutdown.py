"""StoreLoader: ``shutdown()`` during a ``next()``, and a batch refused by ``on_step``.

The guarantees of the map-style loader (``tests/test_shutdown_mid_next.py``,
``tests/test_telemetry_accuracy.py``), checked on the store's own walk:

- ``shutdown()`` from another thread while a ``next()`` waits for the store (empty, no
  producer) ends that ``next()`` at once with a clear error, consuming nothing, and leaves no
  meshfeed thread behind; the state stays at the last batch returned (nothing lost), and a
  ``next()`` that was still starting its walk (its service, its requests) does not hang either,
  nor reports the stream ended.
- A batch whose ``on_step`` raised is not counted: steps, counts, state and phases as before
  it; it is returned next, and its phases count once in the end.

Every wait is bounded (``join(timeout)``, deadlines), so a broken guarantee fails, never hangs.
"""

from __future__ import annotations

import gc
import math
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from meshfeed.queue import Batch, SampleStore, StoreLoader
from meshfeed.queue.engine.wakeups import RequestCancelled
from meshfeed.services.base import InProcessService
from meshfeed.services.thread import ThreadService
from tests.queue.test_queue_loader_stage import _stack, _store
from tests.queue.test_store_tokens_bounded import _kept

SHUT_DOWN = r"StoreLoader \(task 't'\) was shut down"
#: How long a next() may take to end once shutdown() returned (the threads poll every 0.05 s).
PROMPT = 2.0

CONFIGS = [
    pytest.param({"prefetch": 1}, id="in-process"),
    pytest.param({"prefetch": 2}, id="fetch-thread"),
    pytest.param({"prefetch": 1, "device": "cpu"}, id="delivery-thread"),
    pytest.param({"prefetch": 2, "device": "cpu"}, id="fetch-and-delivery-threads"),
]


def _loader(store: SampleStore, **kw: Any) -> StoreLoader:
    args: dict[str, Any] = dict(
        task="t", fields=["x"], partition="p", batch_size=2, mesh={"dp": 1}, rank=0,
        collate_fn=_stack, timeout=math.inf,  # only shutdown() can end a wait
    )  # fmt: skip
    return StoreLoader(store, **{**args, **kw})


def _threads(before: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """meshfeed's threads started since ``before`` but the process's one idle reaper
    (:mod:`meshfeed.lifecycle`)."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("meshfeed") and t.name != "meshfeed-reaper" and t not in before
    ]


def _until(condition: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _no_threads_left(before: frozenset[threading.Thread]) -> None:
    _until(lambda: not _threads(before), PROMPT, f"threads left running: {_threads(before)}")


class _Reader:
    """``next(loader)`` on a daemon thread: what it returned or raised, and when it ended."""

    def __init__(self, loader: StoreLoader) -> None:
        self.loader = loader
        self.started = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(5)

    def _run(self) -> None:
        self.started.set()
        try:
            self.result = next(self.loader)
        except BaseException as exc:
            self.error = exc
        self.ended_at = time.monotonic()

    def join(self) -> None:
        self.thread.join(PROMPT + 3)
        assert not self.thread.is_alive(), "next() still waits after shutdown()"


# ---------------------------------------------------------------- shutdown() during next()
@pytest.mark.parametrize("kw", [*CONFIGS, pytest.param({"num_workers": 1}, id="worker")])
def test_shutdown_from_another_thread_while_next_waits_for_the_store(kw):
    before = frozenset(threading.enumerate())
    store = _store(2, close=False)  # one batch, then nothing: no producer
    loader = _loader(store, **kw)
    try:
        assert next(loader).tolist() == [0, 1]
        reader = _Reader(loader)
        _until(lambda: store.stats()["waiting_consumers"] >= 1, 5, "no request waits")
        time.sleep(0.1)  # the reader is inside next(), waiting for the store
        assert reader.thread.is_alive() and reader.error is None
        start = time.monotonic()
        loader.shutdown()
        reader.join()
        assert reader.ended_at is not None and reader.ended_at - start < PROMPT
        # A clear error in place of the batch: the request was cancelled (the store's own
        # word), or with workers the pool was shut down while it waited.
        assert isinstance(reader.error, RequestCancelled | RuntimeError), repr(reader.error)
        assert "shutdown()" in str(reader.error) or "shut down" in str(reader.error)
        assert "meshfeed-delivery" not in _threads(before)  # joined before next() raised
        _no_threads_left(before)
        _until(lambda: not store.stats()["waiting_consumers"], PROMPT, "requests left waiting")
        # Nothing counted, nothing consumed past the batch returned.
        stats = loader.stats()
        assert stats["batches"] == 1 and stats["delivery"]["steps"] == 1
        assert not stats["ended"] and stats["store"]["consumed"] == 2
        state = loader.state_dict()
        assert state["next"] == 1 and not state["ended"]
        with pytest.raises(RuntimeError, match=SHUT_DOWN):
            next(loader)
        loader.shutdown()  # a second shutdown() is fine
        # Nothing lost: a loader built from the state continues once producers come.
        again = _loader(store, **kw)
        again.load_state_dict(state)
        store.put("p", {"x": [torch.tensor([2]), torch.tensor([3])]})
        store.close("p")
        assert [b.tolist() for b in again] == [[2, 3]]
        again.shutdown()
        _no_threads_left(before)
    finally:
        loader.shutdown()
        store.shutdown()  # wakes anything a failed check left waiting


class _Gate:
    """Holds ``next()`` inside one step of starting its walk until released."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.entered.set()
        assert self.release.wait(10), "never released"


def _gated(base: type, gate: _Gate, where: str) -> Any:
    class Gated(base):
        def start(self, fetcher: Any) -> None:
            if where == "start":
                gate.hold()
            super().start(fetcher)

        def map(self, tasks: Any) -> Any:
            if where == "map":
                gate.hold()
            return super().map(tasks)

    return Gated()


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("base", [InProcessService, ThreadService])
@pytest.mark.parametrize("where", ["start", "map"])
def test_shutdown_while_next_starts_its_walk_neither_hangs_nor_ends_the_stream(where, base, device):
    # shutdown() came before the walk's requests had a token to cancel ("start": the
    # service starting, e.g. worker processes) or before they were made ("map"): the walk
    # once went on with a fresh token and waited in the store forever, or saw its requests
    # halted as the end of the stream and said so (ended, and its state too).
    before = frozenset(threading.enumerate())
    store, gate = _store(0, close=False), _Gate()
    loader = _loader(store, service=_gated(base, gate, where), device=device)
    try:
        reader = _Reader(loader)
        assert gate.entered.wait(5)
        loader.shutdown()
        gate.release.set()
        reader.join()
        assert isinstance(reader.error, RuntimeError), repr(reader.error)
        assert reader.error.args and "was shut down" in reader.error.args[0], repr(reader.error)
        _no_threads_left(before)
        assert not store.stats()["waiting_consumers"] and store.stats()["consumed"] == {}
        stats, state = loader.stats(), loader.state_dict()
        assert not stats["ended"] and not state["ended"] and state["next"] == 0
        with pytest.raises(RuntimeError, match=SHUT_DOWN):
            next(loader)
    finally:
        gate.release.set()
        loader.shutdown()
        store.shutdown()


@pytest.mark.parametrize("kw", CONFIGS)
def test_shutdown_from_on_step_reads_nothing_more(kw):
    before = frozenset(threading.enumerate())
    store = _store(24)
    box: dict[str, Any] = {}

    def on_step(timing):
        if timing.steps == 2:  # "stop at step N"
            box["loader"].shutdown()
            box["threads"] = _threads(before)  # right after shutdown() returned
            box["consumed"] = store.stats()["consumed"]["t"]
            box["next"] = box["loader"].state_dict()["next"]

    loader = box["loader"] = _loader(store, on_step=on_step, **kw)
    try:
        got = [next(loader).tolist(), next(loader).tolist()]  # the second counted already
        assert got == [[0, 1], [2, 3]] and box["next"] == 2 == loader.state_dict()["next"]
        assert box["threads"] == []  # joined before shutdown() returned, as DataLoader's
        with pytest.raises(RuntimeError, match=SHUT_DOWN):
            next(loader)
        _no_threads_left(before)
        time.sleep(0.2)
        assert store.stats()["consumed"]["t"] == box["consumed"]  # no read after shutdown()
        assert not store.stats()["waiting_consumers"]
    finally:
        loader.shutdown()
        store.shutdown()


@pytest.mark.parametrize("kw", CONFIGS[1:])  # those with a thread waiting in the store
def test_a_dropped_loader_stops_its_threads_and_requests(kw):
    before = frozenset(threading.enumerate())
    store = _store(2, close=False)
    loader = _loader(store, **kw)
    try:
        assert next(loader).tolist() == [0, 1]
        _until(lambda: store.stats()["waiting_consumers"] >= 1, 5, "no request waits")
        del loader
        gc.collect()
        _no_threads_left(before)
        _until(lambda: not store.stats()["waiting_consumers"], PROMPT, "requests left waiting")
        assert store.stats()["consumed"]["t"] == 2
    finally:
        store.shutdown()


def test_a_loader_the_cycle_collector_finds_while_the_store_is_locked_does_not_hang():
    # The collector runs on whatever thread allocates, here inside a store operation that
    # holds the store's lock (a request reading its rows): the shutdown of a loader it finds
    # there cancels that loader's requests, which takes the same lock. It waited for itself
    # forever (seen with 6 ranks' loaders per step); now the reaper thread runs it after.
    store = _store(2, close=False)
    loader = _loader(store)
    assert next(loader).tolist() == [0, 1]  # a walk, with its token in the store
    assert _kept(store) == 1
    loader.itself = loader  # type: ignore[attr-defined]  # only the cycle collector frees it
    ref = weakref.ref(loader)
    done = threading.Event()

    def collect_holding_the_lock() -> None:
        with store._backend.lock:  # type: ignore[attr-defined]
            gc.collect()
        done.set()

    gc.disable()  # collected there, nowhere else
    try:
        del loader
        threading.Thread(target=collect_holding_the_lock, daemon=True).start()
        assert done.wait(10), "a collection inside the store's lock waited for itself"
        _until(lambda: _kept(store) == 0, 10, "the collected loader's token was kept")
        _until(lambda: gc.collect() >= 0 and ref() is None, 10, "the loader was kept")
    finally:
        gc.enable()
        if done.is_set():
            store.shutdown()


# ---------------------------------------------------------------- a refused on_step
def _slow_collate(batch: Batch) -> torch.Tensor:
    time.sleep(0.1 if batch.ids == [2, 3] else 0.01)  # the second batch: 0.1 s
    return _stack(batch)


def _phases(loader: StoreLoader) -> dict[str, float]:
    return dict(loader.stats()["delivery"]["phases"])


@pytest.mark.parametrize("refusals", [1, 2])
@pytest.mark.parametrize("kw", CONFIGS)
def test_a_batch_refused_by_on_step_is_not_counted_and_its_phases_count_once(kw, refusals):
    calls: list[int] = []

    def on_step(timing):
        calls.append(timing.steps)
        if 2 <= len(calls) <= 1 + refusals:  # the second batch, ``refusals`` times
            raise ValueError("exporter down")

    store = _store(8)
    loader = _loader(store, collate_fn=_slow_collate, on_step=on_step, **kw)
    try:
        assert next(loader).tolist() == [0, 1]
        one, counts = _phases(loader), loader.stats()
        for _ in range(refusals):
            with pytest.raises(ValueError, match="exporter down"):
                next(loader)
            # State and stats as before the refused batch: its phases too.
            refused, stats = _phases(loader), loader.stats()
            for phase in ("fetch", "collate", "produce", "pin", "device_copy"):
                assert refused[phase] == pytest.approx(one[phase], abs=1e-9), phase
            assert stats["delivery"]["steps"] == 1 and loader.state_dict()["next"] == 1
            assert (stats["batches"], stats["samples"]) == (counts["batches"], counts["samples"])
            assert (stats["batches"], stats["samples"]) == (1, 2)
        rest = [b.tolist() for b in loader]  # the refused batch first, then the rest
        assert rest == [[2, 3], [4, 5], [6, 7]]
        assert calls == [1, *[2] * refusals, 2, 3, 4]
        stats = loader.stats()
        assert stats["delivery"]["steps"] == 4 and (stats["batches"], stats["samples"]) == (4, 8)
        assert stats["ended"] and loader.state_dict()["next"] == 4
        # The refused batch was made once (it is kept, not fetched again): its 0.1 s counts
        # once, neither lost with the phases taken back nor counted twice.
        end = _phases(loader)
        once = 0.1 + 3 * 0.01
        assert 0.08 <= end["produce"] < once + 0.1, end
        if kw["prefetch"] == 1:  # made while the loop (or its delivery thread) waited
            assert once <= end["produce"], end
    finally:
        loader.shutdown()
        store.shutdown()
