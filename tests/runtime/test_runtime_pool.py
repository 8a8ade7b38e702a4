import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from meshfeed.runtime import (
    PoolClosed,
    WorkerDied,
    WorkerError,
    WorkerPool,
    WorkerTimeout,
    available_cores,
    call,
)
from meshfeed.runtime.transport import SMALL
from tests.process_checks import alive

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _assert_no_children(pids: list[int]) -> None:
    assert mp.active_children() == []
    assert not any(alive(pid) for pid in pids)


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def _ignore_sigterm_and_hang() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _sleep_forever()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _batch(i: int, n: int) -> dict:
    return {
        "i": i,
        "name": f"batch-{i}",
        "x": torch.arange(n, dtype=torch.int64) + i,
        "h": torch.full((3, 5), i, dtype=torch.bfloat16),
        "a": np.arange(n, dtype=np.float32) * i,
        "t": (torch.arange(2 * n, dtype=torch.int32) + i).reshape(2, n).t(),  # not contiguous
        "m": torch.arange(n) % 3 == i % 3,  # bool
    }


class CustomError(Exception):
    pass


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


def _raise(exc: BaseException) -> None:
    raise exc


def _raise_two_args() -> None:
    raise NeedsTwoArgs("x", "y")


def _scaled_init(worker: int, num_workers: int, factor: int):
    def handler(task: int) -> tuple[int, int, int]:
        return worker, num_workers, task * factor

    return handler


def _failing_init(worker: int, num_workers: int):
    raise CustomError(f"cannot open the dataset in worker {worker}")


@pytest.mark.parametrize("n", [10, SMALL, 300_000])
def test_results_come_back_in_submission_order_with_exact_tensors(n):
    with WorkerPool(2, timeout=30) as pool:
        pool.start(call)
        got = list(pool.map(((_batch, (i, n)) for i in range(12)), window=5))
    for i, b in enumerate(got):
        ref = _batch(i, n)
        assert b["i"] == i and b["name"] == ref["name"]
        assert torch.equal(b["x"], ref["x"]) and b["x"].dtype == torch.int64
        assert b["h"].dtype == torch.bfloat16 and torch.equal(b["h"], ref["h"])
        assert np.array_equal(b["a"], ref["a"])
        assert torch.equal(b["t"], ref["t"]) and b["t"].shape == (n, 2)
        assert torch.equal(b["m"], ref["m"]) and b["m"].dtype == torch.bool


def test_per_worker_init_and_addressed_workers():
    with WorkerPool(3, timeout=30) as pool:
        pool.start(_scaled_init, 10)
        for w in (2, 0, 1, 2):
            pool.send(w, w + 1)
        assert pool.recv(2) == (2, 3, 30)
        assert pool.recv(0) == (0, 3, 10)
        assert pool.recv(2) == (2, 3, 30)
        assert pool.recv(1) == (1, 3, 20)


def _sleeping_init(worker: int, num_workers: int):
    def handler(seconds: float) -> int:
        time.sleep(seconds)
        return worker

    return handler


def test_wait_any_returns_the_first_ready_workers_and_a_dead_one():
    with WorkerPool(2, timeout=30) as pool:
        pool.start(_sleeping_init)
        assert pool.wait_any([0, 1], 0.01) == []  # nothing outstanding: nothing to wait for
        pool.send(0, 5.0)
        pool.send(1, 0.05)
        began = time.monotonic()
        assert pool.wait_any([0, 1], 10) == [1]  # woken by worker 1, not after worker 0
        assert time.monotonic() - began < 4
        assert pool.recv(1) == 1
        assert pool.wait_any([0, 1], 0.05) == []  # worker 0 still sleeps
        os.kill(pool.pids[0], signal.SIGKILL)
        assert pool.wait_any([0], 10) == [0]  # a death is ready too: recv reports it
        with pytest.raises(WorkerDied):
            pool.recv(0)


def test_a_shutdown_from_another_thread_ends_a_waiting_result_with_pool_closed():
    # It once cleared the pool's state under the waiting thread: a bare KeyError('readers').
    import threading

    with WorkerPool(1, timeout=30) as pool:
        pool.start(_sleeping_init)
        pool.submit(2.0)
        closer = threading.Timer(0.2, pool.shutdown)
        closer.start()
        began = time.monotonic()
        with pytest.raises(PoolClosed, match=r"was shut down while a result was awaited"):
            pool.result()
        assert time.monotonic() - began < 1.9  # woken by the shutdown, not by the result
        closer.join()
        with pytest.raises(PoolClosed, match=r"A new iter\(loader\) continues"):
            pool.result()  # and later calls say so too, until it starts again
        pool.start(_sleeping_init)
        pool.submit(0.0)
        assert pool.result() == 0


def test_received_batch_is_private_and_survives_the_worker():
    pool = WorkerPool(1, timeout=30)
    pool.start(call)
    got = []
    for i in range(8):  # slots are reused many times over
        pool.submit((_batch, (i, 100_000)))
        got.append(pool.result())
        got[-1]["x"].zero_()  # writing a received batch touches no slot
    pool.submit((_batch, (99, 100_000)))
    last = pool.result()
    pids = pool.pids
    pool.shutdown()
    _assert_no_children(pids)
    assert torch.equal(last["x"], torch.arange(100_000) + 99)
    assert all(int(b["x"].abs().sum()) == 0 for b in got)


def test_batch_sent_before_its_worker_died_is_still_delivered():
    pool = WorkerPool(1, timeout=30)
    pool.start(call)
    for i in range(3):  # the first large result sizes the slots; the next ones use them
        pool.submit((_batch, (i, 100_000)))
        pool.result()
    assert pool._state["readers"][0].slots  # the batch below travels through a slot
    pool.submit((_batch, (7, 100_000)))
    pool.submit((_kill_self, ()))
    proc = pool._state["procs"][0]
    proc.join(timeout=10)
    assert proc.exitcode == -9  # dead before its batch is read
    got = pool.result()
    assert torch.equal(got["x"], torch.arange(100_000) + 7)
    with pytest.raises(WorkerDied):
        pool.result()
    assert mp.active_children() == []


def test_handler_exception_keeps_its_type_and_the_worker_traceback():
    with WorkerPool(2, timeout=30) as pool:
        pool.start(call)
        pool.submit((_raise, (CustomError("bad sample 7"),)))
        pool.submit((_raise_two_args, ()))
        with pytest.raises(CustomError, match="bad sample 7") as info:
            pool.result()
        assert "worker traceback" in str(info.value) and "_raise" in str(info.value)
        with pytest.raises(WorkerError, match="NeedsTwoArgs") as info2:
            pool.result()
        assert type(info2.value) is WorkerError
        pool.submit((pow, (3, 2)))
        assert pool.result() == 9  # a raising handler does not stop its worker


def test_init_failure_is_reported_on_the_first_request():
    with WorkerPool(1, timeout=30) as pool:
        pool.start(_failing_init)
        pool.send(0, 1)
        with pytest.raises(CustomError, match="cannot open the dataset in worker 0"):
            pool.recv(0)


def test_unpicklable_init_under_spawn_names_importable_functions():
    pool = WorkerPool(1, timeout=30, start_method="spawn")
    with pytest.raises(TypeError, match="spawned workers need importable functions"):
        pool.start(lambda w, k: lambda t: t)
    assert not pool.started and mp.active_children() == []


def test_killed_worker_mid_task_raises_at_once_and_pool_restarts():
    pool = WorkerPool(2, timeout=30)
    pool.start(call)
    pids = pool.pids
    pool.submit((pow, (2, 3)))
    pool.submit((_kill_self, ()))
    assert pool.result() == 8
    start = time.monotonic()
    with pytest.raises(WorkerDied, match="exited unexpectedly with exit code -9") as info:
        pool.result()
    assert time.monotonic() - start < 2
    assert info.value.worker == 1 and info.value.exitcode == -9
    _assert_no_children(pids)
    assert not pool.started
    pool.start(call)  # restartable
    pool.submit((pow, (5, 2)))
    assert pool.result() == 25
    pool.shutdown()


@pytest.mark.parametrize("case", ["ignores_sigterm", "sigstop"])
def test_stuck_worker_times_out_within_timeout_plus_one_second(case):
    pool = WorkerPool(2, timeout=1.5)
    pool.start(call)
    pids = pool.pids
    if case == "ignores_sigterm":
        pool.submit((_ignore_sigterm_and_hang, ()))
    else:
        pool.submit((time.sleep, (0.2,)))
        os.kill(pids[0], signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match="produced nothing within timeout=1.5s"):
        pool.result()
    elapsed = time.monotonic() - start
    assert elapsed < 1.5 + 1.0
    _assert_no_children(pids)


def test_shutdown_escalates_to_sigkill_for_stuck_and_stopped_workers():
    pool = WorkerPool(2, timeout=30, grace=0.3)
    pool.start(call)
    pids = pool.pids
    pool.submit((_ignore_sigterm_and_hang, ()))
    time.sleep(0.3)  # let it install the handler
    os.kill(pids[1], signal.SIGSTOP)
    start = time.monotonic()
    pool.shutdown()
    assert time.monotonic() - start < 3 * 0.3 + 1.0
    _assert_no_children(pids)


def test_no_timeout_means_no_limit():
    for timeout in (None, math.inf):
        with WorkerPool(1, timeout=timeout) as pool:
            pool.start(call)
            pool.submit((time.sleep, (0.1,)))
            assert pool.result() is None


_EXIT_SCRIPT = """
import os, signal, time
from meshfeed.runtime import WorkerPool, call

def hang():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)

pool = WorkerPool(2, timeout=60)
pool.start(call)
pool.submit((hang, ()))
pool.submit((time.sleep, (0.1,)))
time.sleep(0.5)
os.kill(pool.pids[1], signal.SIGSTOP)
print(" ".join(map(str, pool.pids)), flush=True)
# leave without shutdown(): the interpreter must still exit
"""


@pytest.mark.slow
def test_interpreter_exits_with_a_worker_ignoring_sigterm_and_one_stopped(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT))
    env = {**os.environ, "PYTHONPATH": SRC}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=20, env=env
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 15
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        WorkerPool(0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        WorkerPool(1, timeout=0)
    with pytest.raises(ValueError, match="start_method='nope' is not available"):
        WorkerPool(1, start_method="nope")
    with pytest.raises(RuntimeError, match="send\\(\\) before start\\(\\)"):
        WorkerPool(1).submit(1)


def test_available_cores_follows_the_affinity_mask():
    assert available_cores() == len(os.sched_getaffinity(0))


_INITIALISED: list[str] = []


def _remember(tag: str) -> None:
    _INITIALISED.append(tag)


def _initialised() -> list[str]:
    return list(_INITIALISED)


def test_call_runs_an_initializer_once_per_worker():
    with WorkerPool(2, timeout=30) as pool:
        pool.start(call, _remember, "store-connected")
        for _ in range(4):
            pool.submit((_initialised, ()))
        assert [pool.result() for _ in range(4)] == [["store-connected"]] * 4


def test_a_kept_result_views_a_slot_that_is_never_reused_while_it_lives():
    import gc

    pool = WorkerPool(1, timeout=30, ring=3)
    pool.start(call)
    for i in range(3):  # the first large result sizes the slots
        pool.submit((_batch, (i, 100_000)))
        pool.result()
    pool.submit((_batch, (5, 100_000)))
    kept = pool.result()
    reader = pool._state["readers"][0]
    assert reader.lent  # viewed in place, not copied
    for i in range(40):  # every other slot cycles many times over meanwhile
        pool.submit((_batch, (100 + i, 100_000)))
        pool.result()
    assert torch.equal(kept["x"], torch.arange(100_000) + 5)
    assert len(reader.slots) <= 3
    del kept
    gc.collect()
    assert not reader.lent  # back to the worker once the last view is gone
    held = []
    for i in range(10):  # results kept beyond the ring are copied out, so slots still cycle
        pool.submit((_batch, (200 + i, 100_000)))
        held.append(pool.result())
    # at most `ring` slots lent, and `ring` more for the worker to write into
    assert len(reader.lent) <= 3 and len(reader.slots) <= 6
    pids = pool.pids
    pool.shutdown()  # slots unlinked while results still view some of them
    _assert_no_children(pids)
    assert all(torch.equal(b["x"], torch.arange(100_000) + 200 + i) for i, b in enumerate(held))


def test_many_tasks_in_one_message_come_back_one_by_one_with_their_errors_in_place():
    pool = WorkerPool(2, timeout=30)
    pool.start(call)
    tasks = [(_batch, (i, 50_000)) for i in range(6)]
    tasks[3] = (_raise, (CustomError("task 3 is bad"),))
    pool.submit_many(tasks)
    for i in range(6):
        if i == 3:
            with pytest.raises(CustomError, match="task 3 is bad"):
                pool.result()
            continue
        assert torch.equal(pool.result()["x"], torch.arange(50_000) + i)
    assert pool.outstanding() == 0 and pool.task_seconds > 0
    pool.shutdown()


def test_task_seconds_follows_a_cheaper_reply_at_once_and_a_dearer_one_slowly():
    # A worker's first tasks run cold; averaging them in kept messages small for hundreds of
    # cheap tasks (#27).
    pool = WorkerPool(1, timeout=30)
    pool.start(call)
    pool.submit((time.sleep, (0.2,)))
    pool.result()
    assert pool.task_seconds >= 0.2
    pool.submit((int, (1,)))
    pool.result()
    assert pool.task_seconds < 0.05
    cheap = pool.task_seconds
    pool.submit((time.sleep, (0.2,)))
    pool.result()
    assert cheap < pool.task_seconds < 0.2 * 0.2 + cheap + 0.05
    pool.shutdown()


def test_slots_for_a_larger_message_are_made_before_it_is_sent():
    pool = WorkerPool(1, timeout=30, ring=2)
    pool.start(call)
    pool.submit((_batch, (0, 50_000)))  # 400 KB: in-band once, then slots of 512 KiB
    pool.result()
    assert pool.task_bytes >= 400_000
    pool.submit_many([(_batch, (i, 50_000)) for i in range(8)])
    reader = pool._state["readers"][0]
    assert max(s.size for s in reader.slots.values()) >= 8 * 400_000  # made before the reply
    assert [int(pool.result()["x"][0]) for _ in range(8)] == list(range(8))
    pool.shutdown()
