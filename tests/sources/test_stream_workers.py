"""Stream worker processes never hang: stuck, stopped or killed workers end in a clear error."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from functools import partial
from typing import Any

import pytest

from meshfeed.runtime import WorkerError
from meshfeed.sources.stream import ShardedStream
from meshfeed.sources.stream_loader import StreamLoader
from meshfeed.sources.stream_workers import StreamWorkerError
from tests.process_checks import alive, run_script_leaving_workers


def _rows() -> Any:
    yield from range(100)


def _hangs_ignoring_sigterm() -> Any:
    yield 1
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)


def _killed_mid_batch() -> Any:
    yield 1
    os.kill(os.getpid(), signal.SIGKILL)


def _raises_lookup() -> Any:
    yield 1
    raise LookupError("row 2 missing in shard a")


def _worker_pids(lo: StreamLoader) -> list[int]:
    return list(lo._slots.pool.pids)  # type: ignore[union-attr]


@pytest.mark.parametrize("case", ["ignores_sigterm", "sigstop", "sigkill"])
def test_stuck_stopped_or_killed_stream_worker_fails_within_timeout_plus_one_second(case):
    first = {"ignores_sigterm": _hangs_ignoring_sigterm, "sigkill": _killed_mid_batch}
    stream = ShardedStream([first.get(case, _rows), _rows])
    lo = StreamLoader(stream, batch_size=1, num_workers=2, timeout=1.5, shuffle=False, prefetch=1)
    it = iter(lo)
    next(it)  # worker 0's first batch
    if case == "sigstop":
        os.kill(_worker_pids(lo)[0], signal.SIGSTOP)
    pids = _worker_pids(lo)
    start = time.monotonic()
    match = "exited with exit code -9" if case == "sigkill" else "no batch within timeout=1.5s"
    with pytest.raises(StreamWorkerError, match=match):
        for _ in range(100):
            next(it)
    assert time.monotonic() - start < 1.5 + 1.0
    assert multiprocessing.active_children() == []
    assert not any(alive(p) for p in pids)
    lo.shutdown()


def test_stream_worker_exception_keeps_the_original_as_cause():
    lo = StreamLoader(ShardedStream([_raises_lookup, _rows]), batch_size=2, num_workers=2)
    with pytest.raises(StreamWorkerError, match="row 2 missing in shard a") as info:
        list(lo)
    assert isinstance(info.value, WorkerError)
    assert isinstance(info.value.__cause__, LookupError)
    assert "worker traceback" in str(info.value)
    assert multiprocessing.active_children() == []
    lo.shutdown()


_EXIT_SCRIPT = """
import signal, time
from meshfeed.sources.stream import ShardedStream
from meshfeed.sources.stream_loader import StreamLoader

def hang():
    yield 1
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)

lo = StreamLoader(ShardedStream([hang, hang]), batch_size=1, num_workers=2, timeout=60)
it = iter(lo)
next(it)
time.sleep(0.5)
print(" ".join(map(str, lo._slots.pool.pids)), flush=True)
"""


def test_interpreter_exits_with_stream_workers_that_ignore_sigterm(tmp_path):
    run_script_leaving_workers(_EXIT_SCRIPT, tmp_path, timeout=30)


def _raises_at_row_7() -> Any:
    yield from range(100, 107)
    raise LookupError("row 7 missing in shard b")


def _until_error(lo: StreamLoader) -> tuple[list[list[int]], str]:
    got: list[list[int]] = []
    try:
        for batch in lo:
            got.append(batch.tolist())
    except StreamWorkerError as e:
        return got, str(e).splitlines()[0]  # the message; tracebacks differ by a frame
    return got, ""


@pytest.mark.parametrize("prefetch", [2, 3, 5])
def test_chunked_requests_raise_at_the_same_batch_as_single_batch_requests(prefetch):
    """A worker answers a request with several batches; an error in the middle of a chunk is
    held back, so the batches before it arrive and the error comes at the same step."""

    def run(prefetch: int) -> tuple[list[list[int]], str]:
        stream = ShardedStream([_rows, _raises_at_row_7])
        with StreamLoader(
            stream, batch_size=2, num_workers=2, shuffle=False, prefetch=prefetch
        ) as lo:
            return _until_error(lo)

    want, error = run(1)
    assert "row 7 missing in shard b" in error
    assert len(want) == 7  # rows 100..105 in 3 batches of worker 1, interleaved with worker 0
    assert run(prefetch) == (want, error)


@pytest.mark.parametrize("prefetch", [1, 4])
def test_chunked_requests_keep_batches_and_per_batch_states(prefetch):
    stream = ShardedStream([_rows, _rows, _rows], shuffle_buffer=8, rows=[100] * 3)
    with StreamLoader(stream, batch_size=4, num_workers=2, seed=3, prefetch=prefetch) as lo:
        seen = [(b.tolist(), lo.state_dict()) for b in lo]
    with StreamLoader(stream, batch_size=4, num_workers=2, seed=3, prefetch=1) as one:
        ref_out = [(b.tolist(), one.state_dict()) for b in one]
    assert seen == ref_out and len(seen) == 2 * (150 // 4)  # 300 rows split over 2 workers
    # each recorded state resumes at the next batch
    k = 23
    with StreamLoader(stream, batch_size=4, num_workers=2, seed=3, prefetch=prefetch) as lo:
        lo.load_state_dict(seen[k][1])
        assert [b.tolist() for b in lo] == [b for b, _ in seen[k + 1 :]]


def _none_tailed() -> Any:
    """21 rows, the last two of them None: read only when the slot runs out."""
    for r in range(21):
        yield None if r % 5 == 4 or r > 18 else r


@pytest.mark.parametrize("buffer", [0, 6])
def test_in_process_and_worker_states_agree_after_every_batch_and_at_the_end(buffer):
    """In-process slots record live states (no snapshot per batch) and worker slots send
    snapshots; both give the same checkpoint at every step and the same counts at the end
    (rows read while looking for a last batch count as read in both)."""
    stream = ShardedStream([_none_tailed, _none_tailed], shuffle_buffer=buffer)

    def states(workers: int) -> list[tuple[list[int], dict[str, Any], dict[str, Any]]]:
        with StreamLoader(stream, batch_size=4, num_workers=workers, seed=2) as lo:
            out = [(b.tolist(), lo.state_dict(), lo.stats()) for b in lo]
            return [*out, ([], lo.state_dict(), lo.stats())]

    in_process, worker = states(0), states(1)
    assert len(in_process) == 8 + 1  # 32 rows that are not None: 8 batches, then the end
    assert in_process[-1][2]["skipped"] == 2 * (3 + 2)  # every None row was read
    for (b0, s0, st0), (b1, s1, st1) in zip(in_process, worker, strict=True):
        assert (b0, s0, st0) == (b1, s1, st1)


_BROKEN = {"on": True}


def _clean(rows: int) -> Any:
    yield from range(100, 100 + rows)


def _breaks_at_1() -> Any:
    for r in range(20):
        if r == 1 and _BROKEN["on"]:
            raise LookupError("row 1 unreadable")
        yield r


# (buffer, rows of the first shard): the batch after the last good one takes the first
# shard's last two rows, then fails on the second row of the next shard
@pytest.mark.parametrize(("buffer", "first"), [(0, 18), (6, 16)])
@pytest.mark.parametrize("workers", [0, 1])
def test_state_after_a_read_error_is_the_state_of_the_last_batch_returned(buffer, first, workers):
    """The read that raises may have taken rows of a batch never returned (the last rows of
    one shard, then the error in the next); the state saved after the error resumes right
    after the last batch returned, in and out of process."""
    stream = ShardedStream([partial(_clean, first), _breaks_at_1], shuffle_buffer=buffer)
    assert stream.shard_order(0, seed=5, shuffle=True) == [0, 1]
    _BROKEN["on"] = False
    with StreamLoader(stream, batch_size=4, num_workers=workers, seed=5) as lo:
        want = [b.tolist() for b in lo]
    _BROKEN["on"] = True
    got: list[list[int]] = []
    with StreamLoader(stream, batch_size=4, num_workers=workers, seed=5) as lo:
        with pytest.raises((LookupError, StreamWorkerError), match="row 1 unreadable"):
            for b in lo:
                got.append(b.tolist())
        state = lo.state_dict()
    assert 0 < len(got) < len(want) and got == want[: len(got)]
    _BROKEN["on"] = False
    with StreamLoader(stream, batch_size=4, num_workers=workers, seed=5) as lo:
        lo.load_state_dict(state)
        assert [b.tolist() for b in lo] == want[len(got) :]


def test_state_after_a_collate_error_without_buffer_resumes_after_the_last_batch():
    calls = {"n": 0}

    def collate(rows: list[int]) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("collate failed")
        return rows

    stream = ShardedStream([_rows])
    with StreamLoader(stream, batch_size=4, num_workers=0, collate_fn=collate) as lo:
        with pytest.raises(ValueError, match="collate failed"):
            list(lo)
        state = lo.state_dict()
    with StreamLoader(stream, batch_size=4, num_workers=0) as lo:
        lo.load_state_dict(state)
        assert next(iter(lo)).tolist() == [8, 9, 10, 11]


def test_state_after_a_collate_error_in_process_is_refused_not_guessed():
    calls = {"n": 0}

    def collate(rows: list[int]) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("collate failed")
        return rows

    stream = ShardedStream([_rows], shuffle_buffer=6)
    with StreamLoader(stream, batch_size=4, num_workers=0, collate_fn=collate) as lo:
        with pytest.raises(ValueError, match="collate failed"):
            list(lo)
        with pytest.raises(ValueError, match="no longer known exactly"):
            lo.state_dict()
