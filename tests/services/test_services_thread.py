"""ThreadService: one background thread, ``prefetch`` tasks ahead, the in-process results in
order; on every door (a map-style dataset, a stream, a sample store)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from meshfeed import DataLoader, StreamLoader
from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.services import InProcessService, ThreadService
from meshfeed.sources import ShardedStream
from meshfeed.tasks import FetchEvents, FetchTask
from meshfeed.testing import assert_resume_equivalence


def _task(step: int) -> FetchTask:
    return FetchTask(0, step, np.zeros(0, np.int64), np.zeros(0, np.int64))


class _Steps:
    """A fetcher returning its task's step; raises at ``fail_at``; waits on ``gate`` at
    ``wait_at`` (the thread is then inside a task)."""

    seed, worker_id, num_workers = 0, 0, 0

    def __init__(self, fail_at: int = -1, wait_at: int = -1) -> None:
        self.fail_at, self.wait_at = fail_at, wait_at
        self.gate, self.inside = threading.Event(), threading.Event()
        self.made: list[int] = []

    def __call__(self, task: FetchTask) -> tuple[int, FetchEvents]:
        if task.step == self.fail_at:
            raise KeyError(f"sample of step {task.step}")
        if task.step == self.wait_at:
            self.inside.set()
            self.gate.wait(10)
        self.made.append(task.step)
        return task.step, FetchEvents()


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "meshfeed-fetch"]


@pytest.mark.parametrize("prefetch", [1, 3])
def test_results_come_in_task_order_and_never_more_than_prefetch_ahead(prefetch):
    service = ThreadService(prefetch)
    assert service.in_flight == prefetch
    service.start(_Steps())
    pulled: list[int] = []

    def tasks():
        for step in range(50):
            pulled.append(step)
            yield _task(step)

    out = []
    for step, _ in service.map(tasks()):
        time.sleep(0.001)  # the thread gets ahead if it may
        assert len(pulled) - step <= prefetch
        out.append(step)
    assert out == list(range(50))
    deadline = time.monotonic() + 5
    while _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads()  # a map's thread ends with its map


def test_an_error_comes_in_order_after_the_batches_before_it_and_stops_the_thread():
    fetcher = _Steps(fail_at=3)
    service = ThreadService(4)
    service.start(fetcher)
    out = []
    with pytest.raises(KeyError, match="sample of step 3"):
        for step, _ in service.map(_task(s) for s in range(10)):
            out.append(step)
    assert out == [0, 1, 2]
    time.sleep(0.2)
    assert fetcher.made == [0, 1, 2]  # nothing made after the failed task


def test_closing_a_map_waits_for_its_thread_to_end_the_task_it_is_making():
    fetcher = _Steps(wait_at=2)
    service = ThreadService(3)
    service.start(fetcher)
    results = service.map(_task(s) for s in range(100))
    assert next(results)[0] == 0
    assert fetcher.inside.wait(5)  # the thread is inside task 2
    started = time.monotonic()
    threading.Timer(0.3, fetcher.gate.set).start()  # which ends 0.3 s from now
    results.close()
    assert time.monotonic() - started >= 0.2  # it waited for task 2
    assert not _threads()  # gone when close() returned
    assert max(fetcher.made) <= 3  # task 2, and at most the one it had taken before the stop


def test_a_task_longer_than_join_is_left_to_end_on_its_own_with_a_warning(caplog):
    fetcher = _Steps(wait_at=1)
    service = ThreadService(2, join=0.1)
    service.start(fetcher)
    results = service.map(_task(s) for s in range(100))
    assert next(results)[0] == 0
    assert fetcher.inside.wait(5)  # the thread is inside task 1, which waits for the gate
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="meshfeed.services.thread"):
        results.close()
    assert time.monotonic() - started < 2  # no hang: it waited join=0.1 s
    assert "did not stop within 0.1 s" in caplog.text and _threads()
    fetcher.gate.set()
    deadline = time.monotonic() + 5
    while _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads()  # it ended once its task did


def test_map_before_start_and_a_bad_prefetch_are_refused_by_name():
    with pytest.raises(RuntimeError, match="before start"):
        next(iter(ThreadService(2).map(iter([_task(0)]))))
    with pytest.raises(ValueError, match="prefetch=0"):
        ThreadService(0)
    for join in (-1, float("inf"), float("nan"), "2", True):
        with pytest.raises(ValueError, match="join="):
            ThreadService(2, join=join)


def _store() -> SampleStore:
    store = SampleStore()
    store.put("p", {"x": list(range(23))})
    store.close("p")
    return store


def _three_doors(service_for):
    """The batches of a DataLoader, a StreamLoader and a StoreLoader with ``service_for()``."""
    data = np.arange(40)
    mapped = [b.tolist() for b in DataLoader(data, batch_size=4, seed=3, service=service_for())]
    stream = ShardedStream([lambda: range(0, 9), lambda: range(20, 31)])
    streamed = [
        b.tolist() for b in StreamLoader(stream, batch_size=3, seed=1, service=service_for())
    ]
    with StoreLoader(
        _store(), task="t", fields=["x"], partition="p", batch_size=5, mesh={"dp": 1}, rank=0,
        service=service_for(),
    ) as loader:  # fmt: skip
        stored = [b.ids for b in loader]
    return mapped, streamed, stored


def test_every_door_gives_the_in_process_batches_through_a_thread_service():
    assert _three_doors(lambda: ThreadService(3)) == _three_doors(InProcessService)


def test_a_data_loader_on_a_thread_service_resumes_exactly_at_every_step():
    out = assert_resume_equivalence(
        lambda: DataLoader(np.arange(30), batch_size=4, seed=1, service=ThreadService(2)),
        num_items=12,
    )
    assert len(out) == 12
