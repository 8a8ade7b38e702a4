import multiprocessing
import os
import signal
import time

import pytest

from meshfeed.runtime import WorkerDied, WorkerTimeout
from meshfeed.services import PassService


def _square_init(worker, num_workers, offset):
    state = {"offset": offset, "seen": 0}

    def handle(task):
        if task == "seen":  # a broadcast: how many tasks this worker ran, then reset
            seen, state["seen"] = state["seen"], 0
            return (worker, seen)
        state["seen"] += 1
        if task == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if task == "stuck":
            time.sleep(60)
        if task == "slow-in-0" and worker == 0:
            time.sleep(0.05)
        return task * task + state["offset"] if isinstance(task, int) else task

    return handle


def test_map_yields_every_result_in_task_order_and_broadcast_reaches_every_worker():
    service = PassService(3, timeout=30)
    try:
        service.start(_square_init, 7)
        got = list(service.map(list(range(50))))
        assert got == [(i, i * i + 7) for i in range(50)]
        answers = service.broadcast("seen")
        assert [w for w, _ in answers] == [0, 1, 2]
        assert sum(n for _, n in answers) == 50
        # a second pass on the same workers
        assert [r for _, r in service.map([3, 4])] == [16, 23]
    finally:
        service.shutdown()
    assert not service.started


@pytest.mark.slow
def test_a_slow_worker_takes_fewer_tasks_than_round_robin_would_give_it():
    service = PassService(2, timeout=30)
    try:
        service.start(_square_init, 0)
        out = list(service.map(["slow-in-0"] * 40))
        assert [i for i, _ in out] == list(range(40))
        per_worker = dict(service.broadcast("seen"))
    finally:
        service.shutdown()
    assert per_worker[0] + per_worker[1] == 40
    assert per_worker[0] <= 10 < per_worker[1], per_worker  # round-robin: 20 each


@pytest.mark.parametrize(("task", "error"), [("stuck", WorkerTimeout), ("die", WorkerDied)])
def test_a_stuck_or_dead_worker_raises_within_the_timeout_and_stops_the_workers(task, error):
    service = PassService(2, timeout=1.0)
    service.start(_square_init, 0)
    begin = time.monotonic()
    with pytest.raises(error):
        list(service.map([1, 2, task, 4, 5]))
    assert time.monotonic() - begin < 1.0 + 1.0 + 0.5
    service.shutdown()
    assert not service.started
    assert multiprocessing.active_children() == []
    service.start(_square_init, 1)  # starts afresh after a failure
    try:
        assert [r for _, r in service.map([2])] == [5]
    finally:
        service.shutdown()


def _fails_on_three(worker, num_workers):
    def handle(task):
        if task == 3 or task == ("raise in", worker):
            raise KeyError(f"bad task {task}")
        return task

    return handle


def test_a_map_that_stops_early_stops_the_workers_so_no_stale_result_answers_the_next():
    service = PassService(2, timeout=30)
    try:
        service.start(_fails_on_three)
        with pytest.raises(KeyError, match="bad task 3"):
            list(service.map(list(range(8))))
        assert not service.started  # tasks 4.. were in flight: their workers are gone
        service.start(_fails_on_three)
        it = service.map([0, 1, 2, 4, 5, 6])
        assert next(it) == (0, 0)
        it.close()  # abandoned with tasks in flight
        assert not service.started
        service.start(_fails_on_three)
        with pytest.raises(KeyError, match="bad task"):
            service.broadcast(("raise in", 0))  # worker 1's answer is left unread
        assert not service.started
        service.start(_fails_on_three)
        assert list(service.map([7, 8])) == [(0, 7), (1, 8)]
    finally:
        service.shutdown()


def test_bad_worker_counts_are_refused():
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        PassService(0, timeout=1.0)
