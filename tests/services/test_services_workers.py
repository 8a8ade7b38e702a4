import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
import torch

from meshfeed import DataLoader, SampleError
from meshfeed.services import WorkerError, WorkerService
from meshfeed.tasks import FetchEvents, FetchTask
from meshfeed.testing import assert_resume_equivalence, assert_same, take
from tests.process_checks import alive, run_script_leaving_workers


class Items:
    def __init__(self, n, fail_at=None, die_at=None, exc=ValueError):
        self.n, self.fail_at, self.die_at, self.exc = n, fail_at, die_at, exc

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise self.exc(f"cannot decode sample {i}")
        if i == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"i": i, "pid": os.getpid(), "x": torch.arange(3) + i}


def _without_pid(batches):
    return [{k: v for k, v in b.items() if k != "pid"} for b in batches]


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_workers_give_exactly_the_output_of_no_workers(num_workers):
    ref = _without_pid(
        take(DataLoader(Items(50), batch_size=4, mesh={"dp": 2}, rank=1, seed=5), 30)
    )
    with DataLoader(
        Items(50), batch_size=4, mesh={"dp": 2}, rank=1, seed=5, num_workers=num_workers
    ) as lo:
        got = take(lo, 30)
    assert_same(ref, _without_pid(got))
    pids = {int(b["pid"][0]) for b in got}
    assert len(pids) == num_workers and os.getpid() not in pids


def test_batch_i_is_made_by_worker_i_mod_k():
    with DataLoader(Items(40), batch_size=2, num_workers=2, prefetch=3) as lo:
        pids = [int(b["pid"][0]) for b in take(lo, 8)]
    assert pids[0::2] == [pids[0]] * 4 and pids[1::2] == [pids[1]] * 4 and pids[0] != pids[1]


def test_exact_resume_with_workers_across_epochs():
    def factory():
        return DataLoader(Items(21), batch_size=2, mesh={"dp": 2}, rank=0, num_workers=2, seed=1)

    assert_resume_equivalence(
        factory,
        num_items=14,
        cleanup=lambda lo: lo.shutdown(),
        equal=lambda a, b, p: assert_same(_without_pid([a]), _without_pid([b]), p),
    )


def test_worker_exception_is_reraised_with_worker_traceback():
    lo = DataLoader(
        Items(16, fail_at=5), batch_size=4, shuffle=False, num_workers=2, on_error="raise"
    )
    with pytest.raises(SampleError, match="sample 5 .* ValueError: cannot decode sample 5") as info:
        list(lo)
    assert "worker traceback" in str(info.value) and "__getitem__" in str(info.value)
    lo.shutdown()


def test_killed_worker_is_reported_not_hung():
    lo = DataLoader(Items(32, die_at=9), batch_size=4, shuffle=False, num_workers=2, timeout=30)
    with pytest.raises(WorkerError, match="exited unexpectedly with exit code -9"):
        list(lo)
    lo.shutdown()


def test_stalled_worker_times_out():
    class Slow(Items):
        def __getitem__(self, i):
            if i == 3:
                import time

                time.sleep(30)
            return i

    lo = DataLoader(Slow(8), batch_size=4, shuffle=False, num_workers=1, timeout=1.0)
    with pytest.raises(WorkerError, match="produced nothing for step 0 within timeout=1.0s"):
        list(lo)
    lo.shutdown()


def test_abandoned_iteration_then_new_one_stays_aligned():
    ref = _without_pid(take(DataLoader(Items(40), batch_size=2), 12))
    with DataLoader(Items(40), batch_size=2, num_workers=2, prefetch=3) as lo:
        first = take(lo, 3)  # leaves prefetched batches in flight
        rest = take(lo, 9)
    assert_same(ref, _without_pid(first + rest))


def test_worker_service_validates_arguments():
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        WorkerService(0)
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        WorkerService(2, prefetch=0)


def _collate_fails(batch):
    raise KeyError("no field 'y' in this batch")


def test_a_worker_error_names_the_service_by_its_name():
    # The argument checks once reused the name ``name`` for their loop, so every pool was
    # called "max_chunk" and its errors said "raised in max_chunk 0".
    service = WorkerService(1, timeout=30, name="my-loader")
    with (
        DataLoader(Items(8), batch_size=2, service=service, collate_fn=_collate_fails) as lo,
        pytest.raises(KeyError, match=r"raised in my-loader 0; worker traceback"),
    ):
        take(lo, 1)


# ---------------------------------------------------------------------- errors, restart, hangs


class FailsOnce(Items):
    """Sample 9 raises in the first worker process that reads it, then works."""

    def __init__(self, n, flag):
        super().__init__(n)
        self.flag = flag

    def __getitem__(self, i):
        if i == 9 and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            raise ValueError("transient failure on sample 9")
        return super().__getitem__(i)


def test_loader_iterated_again_after_a_worker_error_restarts_and_continues(tmp_path):
    ref = _without_pid(take(DataLoader(Items(24), batch_size=4, shuffle=False), 6))
    lo = DataLoader(
        FailsOnce(24, str(tmp_path / "flag")),
        batch_size=4,
        shuffle=False,
        num_workers=2,
        on_error="raise",
    )
    got = []
    with pytest.raises(SampleError, match="transient failure on sample 9"):
        for b in lo:
            got.append(b)
    assert len(got) == 2 and lo.position == 8
    rest = list(lo)  # no "map() before start()": fresh workers, from the saved position
    assert_same(ref, _without_pid(got + rest))
    lo.shutdown()


def test_worker_killed_mid_batch_fails_at_once_and_leaves_no_process():
    lo = DataLoader(Items(32, die_at=9), batch_size=4, shuffle=False, num_workers=2, timeout=30)
    got = []
    start = time.monotonic()
    with pytest.raises(WorkerError, match="exited unexpectedly"):
        for b in lo:
            got.append(b)
    assert time.monotonic() - start < 5  # noticed through the sentinel, not the 30 s timeout
    assert [int(b["i"][0]) for b in got] == [0, 4]
    assert multiprocessing.active_children() == []
    lo.shutdown()


def _ignores_sigterm_and_hangs(i):
    if i == 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    return i


class Hangs(Items):
    def __getitem__(self, i):
        return _ignores_sigterm_and_hangs(i)


class SlowAtStepOne(Items):
    """Step 1 (indices 2 and 3) takes a second, so a SIGSTOP lands while it is being made."""

    def __getitem__(self, i):
        if i == 2:
            time.sleep(1.0)
        return super().__getitem__(i)


@pytest.mark.parametrize("case", ["ignores_sigterm", "sigstop"])
def test_stuck_or_stopped_worker_fails_within_timeout_plus_one_second(case):
    dataset = Hangs(16) if case == "ignores_sigterm" else SlowAtStepOne(16)
    lo = DataLoader(dataset, batch_size=2, shuffle=False, num_workers=2, timeout=1.5)
    it = iter(lo)
    next(it)
    pids = list(lo.service._pool.pids)
    if case == "sigstop":
        os.kill(pids[1], signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="produced nothing for step 1 within timeout=1.5s"):
        next(it)
    assert time.monotonic() - start < 1.5 + 1.0
    assert multiprocessing.active_children() == []
    assert not any(alive(p) for p in pids)
    lo.shutdown()


_EXIT_SCRIPT = """
import signal, time
from meshfeed import DataLoader

class Hangs:
    def __len__(self):
        return 16
    def __getitem__(self, i):
        if i >= 2:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(1)
        return i

lo = DataLoader(Hangs(), batch_size=2, shuffle=False, num_workers=2, timeout=60)
it = iter(lo)
print(next(it).tolist(), " ".join(map(str, lo.service._pool.pids)), flush=True)
time.sleep(0.5)
# leave with both workers stuck and ignoring SIGTERM, without shutdown()
"""


@pytest.mark.slow
def test_interpreter_exits_with_workers_that_ignore_sigterm(tmp_path):
    stdout = run_script_leaving_workers(_EXIT_SCRIPT, tmp_path, timeout=30)
    assert stdout.startswith("[0, 1]")


def test_lambda_collate_fn_under_spawn_says_spawned_workers_need_importable_functions():
    # Refused when the loader is built, before any worker process starts.
    with pytest.raises(TypeError, match="spawned workers need importable functions"):
        DataLoader(
            Items(8),
            batch_size=2,
            num_workers=1,
            multiprocessing_context="spawn",
            collate_fn=lambda items: items,
        )
    assert multiprocessing.active_children() == []


class _WaitAt:
    """A fetcher whose task ``at`` waits (up to 2 s) for a marker file, and notes when it
    gave up waiting; the other tasks are cheap."""

    seed, worker_id, num_workers = 0, 0, 0

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at = marker, at

    def __call__(self, task):
        if task.step == self.at:
            deadline = time.monotonic() + 2.0
            while not os.path.exists(self.marker):
                if time.monotonic() > deadline:
                    open(self.marker + ".gave-up", "w").close()
                    break
                time.sleep(0.01)
        return task.step, FetchEvents()


@pytest.mark.parametrize("max_chunk", [1, 16])
def test_with_max_chunk_1_a_batch_never_waits_behind_a_later_one(tmp_path, max_chunk, monkeypatch):
    """A store batch may wait for producers: with ``max_chunk=1`` every result travels as soon
    as it is made; cheap batches otherwise travel up to 16 to a message, behind the slowest."""
    import meshfeed.services.workers

    # Messages of max_chunk batches once one was timed, however slow this machine is today:
    # batches 2-17, 18-33, ..., 194-209 travel together (199 behind 200) when chunked.
    monkeypatch.setattr(meshfeed.services.workers, "_CHUNK_SECONDS", 10.0)
    marker = str(tmp_path / "go")
    service = WorkerService(1, prefetch=2, timeout=30, max_chunk=max_chunk)
    assert service.in_flight == 2 * max_chunk + 1
    with pytest.raises(ValueError, match="max_chunk=0"):
        WorkerService(1, max_chunk=0)
    service.start(_WaitAt(marker, at=200))
    pulled = []

    def tasks():
        for step in range(240):
            pulled.append(step)
            yield FetchTask(0, step, np.zeros(0, np.int64), np.zeros(0, np.int64))

    for step, _ in service.map(tasks()):
        assert len(pulled) - step <= service.in_flight  # never further ahead than it says
        if step == 199:
            open(marker, "w").close()  # batch 200 may go on now
    service.shutdown()
    # Batch 199 reached the loop while batch 200 still waited, only when unchunked.
    assert os.path.exists(marker + ".gave-up") == (max_chunk > 1)


class _Mixed:
    """Samples whose dtypes differ by index (a stack promotes them), with bf16 and numpy
    fields: what a worker stacks into its reply slot must equal what in-process gives."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((2048,), float(i), dtype=torch.float64 if i % 5 == 0 else torch.float32)
        return {"x": x, "h": torch.ones(2048, dtype=torch.bfloat16) * i, "a": np.arange(2048) + i}


def test_batches_stacked_into_the_workers_slots_equal_the_in_process_ones():
    got = list(DataLoader(_Mixed(), batch_size=8, seed=2, num_workers=2))
    want = list(DataLoader(_Mixed(), batch_size=8, seed=2))
    assert_same(got, want)
    assert [b["x"].dtype for b in got] == [b["x"].dtype for b in want]


class _KeepsLast:
    """A collate_fn that keeps the batches it made (as a packer keeps its leftover) and
    checks, after making each new one, that nothing wrote over them meanwhile."""

    def __init__(self):
        self.kept = []

    def __call__(self, items):
        from meshfeed import default_collate

        batch = default_collate(items)
        intact = all(torch.equal(last, copy) for last, copy in self.kept)
        self.kept.append((batch, batch.clone()))
        return {"x": batch, "intact": intact}


def test_a_user_collate_fn_never_gets_memory_of_the_reply_slots():
    data = np.arange(64 * 2048, dtype=np.int64).reshape(64, 2048)  # 128 KiB batches
    loader = DataLoader(data, batch_size=8, seed=1, num_workers=1, collate_fn=_KeepsLast())
    intact = [bool(b["intact"]) for _ in range(3) for b in loader]  # each batch dropped
    assert len(intact) == 24 and all(intact)
    loader.shutdown()


class _DiesOnSend:
    """A worker pool whose worker is found dead when task ``dead`` is sent to it (its death
    shows first when sending, not when awaiting a result); results are the tasks' steps."""

    started, task_seconds = True, 0.0

    def __init__(self, dead: int) -> None:
        from collections import deque

        self.dead, self.results, self.shut = dead, deque(), False

    def submit_many(self, tasks) -> None:
        from meshfeed.runtime.failures import WorkerDied

        if any(t.step == self.dead for t in tasks):
            raise WorkerDied(
                "meshfeed-worker 0 (pid 1) exited unexpectedly with exit code 4",
                worker=0, pid=1, exitcode=4,
            )  # fmt: skip
        self.results.extend(t.step for t in tasks)

    def result(self) -> int:
        return self.results.popleft()

    def shutdown(self) -> None:
        self.shut = True


def test_a_worker_found_dead_when_sending_keeps_the_batch_in_hand_and_names_the_step():
    """The death surfaced raw (no step, no advice), and the batch already received was
    dropped (made again on the next iteration: no data lost, work lost)."""
    from types import SimpleNamespace

    service = WorkerService(1, prefetch=1)
    pool = _DiesOnSend(3)
    got = []
    with pytest.raises(WorkerError, match="step 3") as e:
        for step in service._run(pool, iter(SimpleNamespace(step=i) for i in range(8))):  # type: ignore[arg-type]
            got.append(step)
    assert got == [0, 1, 2]  # the batch in hand when the death showed is returned
    assert "iterating the loader again starts fresh workers" in str(e.value)
    assert pool.shut  # the next map() starts fresh workers
    service.shutdown()
