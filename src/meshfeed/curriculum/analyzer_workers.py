"""The analyzer's passes: chunk execution, in this process or on a pool of worker processes.

A pass runs the metrics of one analysis pass over a rank's chunks. Without workers each chunk
runs here; with a :class:`Workers` pool each chunk goes to whichever worker is free (a slowed
worker takes fewer chunks) and results are merged in chunk order, so the output does not depend
on who computed what. Integer accumulations are summed in each worker and returned once per
pass (exact in any order); float ones travel per chunk, to be added in chunk order. Every wait
on a worker is bounded by the pool's ``timeout``: a stuck metric fails the pass, never hangs it.

Worker state lives in module globals set by the pool's start function (inherited under
``fork``; under ``spawn`` this module is imported in the worker and the metrics pickled).
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from meshfeed.curriculum.metrics import AccumulatedMetric, SampleMetric
from meshfeed.progress import Progress
from meshfeed.runtime import WorkerPool, WorkerTimeout

__all__ = ["ChunkOut", "Passes", "Workers", "run_pass"]

ChunkOut = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]

# Set in each worker by _start_worker (its arguments are inherited, not pickled, under fork).
_WORK: tuple[Any, list[SampleMetric], list[AccumulatedMetric], dict[str, Any]] | None = None


# A worker's running sums of its integer accumulations in the current pass: integer sums are
# exact in any order, so each worker adds its chunks into one array and returns it once per
# pass (on "flush") instead of one array per chunk. Float sums still travel per chunk, to be
# added in chunk order.
_LOCAL: dict[str, np.ndarray] = {}


def _is_exact(acc: AccumulatedMetric) -> bool:
    return np.dtype(acc.dtype).kind in "iub"


def _zeros(accs: list[AccumulatedMetric]) -> dict[str, np.ndarray]:
    return {a.name: np.zeros(a.size, dtype=a.dtype) for a in accs}


def _init_worker(
    dataset: Any, samples: list[SampleMetric], accs: list[AccumulatedMetric], ctx: dict[str, Any]
) -> None:
    global _WORK, _LOCAL
    _WORK = (dataset, samples, accs, ctx)
    _LOCAL = _zeros([a for a in accs if _is_exact(a)])


Passes = list[tuple[list[SampleMetric], list[AccumulatedMetric]]]
_PASSES: Passes = []


def _start_worker(
    worker: int, num_workers: int, dataset: Any, passes: Passes, first: int, ctx: dict[str, Any]
) -> Callable[[Any], Any]:
    # The metrics come with the start arguments (inherited under fork: local functions work).
    global _PASSES
    _PASSES = passes
    samples, accs = passes[first]
    _init_worker(dataset, samples, accs, ctx)
    return _handle


def _handle(task: Any) -> ChunkOut | dict[str, np.ndarray] | None:
    """A chunk ``(start, stop)``; ``("pass", index, ctx)`` starting pass ``index``; or
    ``("flush",)``, which returns the integer sums of this worker's chunks and resets them."""
    global _LOCAL
    if task[0] == "pass":
        assert _WORK is not None  # internal invariant: set by _start_worker
        samples, accs = _PASSES[task[1]]
        _init_worker(_WORK[0], samples, accs, task[2])
        return None
    if task[0] == "flush":
        out, _LOCAL = _LOCAL, {k: np.zeros_like(v) for k, v in _LOCAL.items()}
        return out
    return _run_chunk(task, _LOCAL)


def _run_chunk(chunk: tuple[int, int], into: dict[str, np.ndarray]) -> ChunkOut:
    """Values of the chunk's samples; its accumulations are added into ``into`` where that
    has the metric's array, else returned (float sums: the caller adds them in chunk order)."""
    assert _WORK is not None  # internal invariant: set by _init_worker
    start, stop = chunk
    dataset, samples, accs, ctx = _WORK
    values = {m.name: np.empty(stop - start, dtype=m.dtype) for m in samples}
    sums = _chunk_sums(accs, into)
    items = [dataset[i] for i in range(start, stop)]
    for m in samples:
        values[m.name][:] = _sample_values(m, items, ctx)
    for a in accs:
        _accumulate(a, sums[a.name], items)
    return values, {k: v for k, v in sums.items() if k not in into}


def _chunk_sums(
    accs: list[AccumulatedMetric], into: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Each accumulation's array for a chunk: the one in ``into`` where it has it, else zeros."""
    return {a.name: into[a.name] if a.name in into else _zeros([a])[a.name] for a in accs}


def _sample_values(m: SampleMetric, items: list[Any], ctx: dict[str, Any]) -> Any:
    """The metric's values of ``items`` (its batch function where it has one)."""
    args = (ctx[m.name],) if m.requires else ()
    if m.batch_fn is not None:
        return m.batch_fn(items, *args)
    return [m.fn(item, *args) for item in items]


def _accumulate(a: AccumulatedMetric, acc: np.ndarray, items: list[Any]) -> None:
    """Add ``items`` into the accumulation ``acc`` (its batch function where it has one)."""
    if a.batch_fn is not None:
        a.batch_fn(acc, items)
        return
    for item in items:
        a.fn(acc, item)


class Workers:
    """The analyzer's pool, started once and reused by every pass where it can be."""

    def __init__(self, workers: int, dataset: Any, passes: Passes, **pool_options: Any):
        self.pool = WorkerPool(workers, name="meshfeed-analyzer-worker", **pool_options)
        self.dataset, self.passes = dataset, passes

    def begin(self, index: int, ctx: dict[str, Any]) -> WorkerPool:
        pool = self.pool
        if not pool.started:
            pool.start(_start_worker, self.dataset, self.passes, index, ctx)
            return pool
        try:
            pickle.dumps(ctx)
        except Exception:  # e.g. a local object from prepare: start workers that inherit it
            pool.shutdown()
            pool.start(_start_worker, self.dataset, self.passes, index, ctx)
            return pool
        for w in range(pool.num_workers):
            pool.send(w, ("pass", index, ctx))
        for w in range(pool.num_workers):
            pool.recv(w)
        return pool


# Chunks queued per worker: one running, two waiting, so a worker never idles while the
# parent is busy or has not yet noticed its last result (a default chunk can take as little
# as a few milliseconds).
_DEPTH = 3
# How far (in chunks) dispatch may run ahead of the oldest chunk not merged yet: bounds the
# results held for the in-order merge when one worker is slow.
_AHEAD_PER_WORKER = 8
# The longest single wait on the busy workers (one poll over all of them, woken by the first
# result or death): an unlimited pool timeout still checks in hourly.
_SLICE_MAX = 3600.0


class _Dispatch:
    """The state of one :func:`_dispatch`: each worker's queued chunks, the results not
    merged yet, and the next chunk to send and to merge."""

    def __init__(self, pool: WorkerPool, chunks: list[tuple[int, int]]):
        k = pool.num_workers
        self.pool, self.chunks, self.k = pool, chunks, k
        self.queued: list[deque[int]] = [deque() for _ in range(k)]
        self.since = [0.0] * k  # when the worker's oldest queued chunk could start
        self.done: dict[int, Any] = {}
        self.next_chunk = self.next_merge = 0
        self.ahead = _AHEAD_PER_WORKER * k

    def refill_all(self) -> None:
        for w in range(self.k):
            self.refill(w)

    def refill(self, w: int) -> None:
        if not self.queued[w]:
            self.since[w] = time.monotonic()
        # near the end of the pass queue less, so no worker is left holding the last chunks
        # while another runs dry
        depth = _DEPTH if len(self.chunks) - self.next_chunk > self.k * _DEPTH else 2
        limit = min(len(self.chunks), self.next_merge + self.ahead)
        while len(self.queued[w]) < depth and self.next_chunk < limit:
            self.pool.send(w, self.chunks[self.next_chunk])
            self.queued[w].append(self.next_chunk)
            self.next_chunk += 1

    def take(self, w: int) -> None:
        self.done[self.queued[w].popleft()] = self.pool.recv(w)
        self.since[w] = time.monotonic()

    def ready(self) -> list[int] | None:
        """The workers to receive from now; None when a wait ran out with none ready."""
        busy = [w for w in range(self.k) if self.queued[w]]
        ready = [w for w in busy if self.pool.ready(w)]  # a result, or a dead worker to report
        if ready:
            return ready
        if len(busy) == 1:
            return busy  # nothing to balance: recv blocks, bounded by the pool's timeout
        return self._wait(busy)

    def _wait(self, busy: list[int]) -> list[int] | None:
        # one wait on every busy worker at once, until the earliest pool deadline
        pool = self.pool
        late = min(self.since[w] for w in busy) + pool.timeout - time.monotonic()
        ready = pool.wait_any(busy, max(0.0, min(late, _SLICE_MAX)))
        if ready:
            return ready
        now = time.monotonic()
        for w in busy:
            if now - self.since[w] > pool.timeout:
                self.take(w)  # waits out the pool's own deadline, then raises
        return None

    def merged(self) -> Iterator[tuple[int, Any]]:
        while self.next_merge in self.done:
            yield self.next_merge, self.done.pop(self.next_merge)
            self.next_merge += 1


def _dispatch(pool: WorkerPool, chunks: list[tuple[int, int]]) -> Iterator[tuple[int, Any]]:
    """``(chunk index, result)`` in chunk order; each chunk goes to whichever worker is free.

    Round-robin hands every worker the same number of chunks, so a pass lasts as long as the
    slowest worker's share: on a machine whose cores are shared with other processes one
    descheduled worker held the other back. Here a worker gets its next chunk as soon as one
    of its results arrives, results are merged in chunk order (so the output does not depend
    on who computed what), and the pool's ``timeout`` still bounds every wait: a worker with
    no result for that long is received from, which raises ``WorkerTimeout``.
    """
    d = _Dispatch(pool, chunks)
    d.refill_all()
    while d.next_merge < len(chunks):
        ready = d.ready()
        if ready is None:
            continue
        for w in ready:
            d.take(w)
        yield from d.merged()
        d.refill_all()


class _PassOutput:
    """One pass's per-sample values and accumulated sums, merged in chunk order."""

    def __init__(self, samples: list[SampleMetric], accs: list[AccumulatedMetric], bar: Progress):
        self.samples, self.bar = samples, bar
        self.values: dict[str, list[np.ndarray]] = {m.name: [] for m in samples}
        self.sums = {a.name: np.zeros(a.size, dtype=a.dtype) for a in accs}

    def merge(self, out: ChunkOut, size: int) -> None:
        for name, v in out[0].items():
            self.values[name].append(v)
        for name, part in out[1].items():
            self.sums[name] += part
        self.bar.update(size)

    def result(self) -> ChunkOut:
        empty = {m.name: np.empty(0, dtype=m.dtype) for m in self.samples}
        values = {k: np.concatenate(v) if v else empty[k] for k, v in self.values.items()}
        return values, self.sums


def _flush(pool: WorkerPool, exact: dict[str, np.ndarray]) -> None:
    """Add every worker's integer sums of this pass into ``exact``."""
    for w in range(pool.num_workers):
        pool.send(w, ("flush",))
    for w in range(pool.num_workers):
        for name, part in pool.recv(w).items():
            exact[name] += part


def _pass_on_workers(
    workers: Workers,
    index: int,
    chunks: list[tuple[int, int]],
    ctx: dict[str, Any],
    exact: dict[str, np.ndarray],
    out: _PassOutput,
    timeout: float,
) -> None:
    try:
        pool = workers.begin(index, ctx)
        for k, part in _dispatch(pool, chunks):
            out.merge(part, chunks[k][1] - chunks[k][0])
        if exact:
            _flush(pool, exact)
    except WorkerTimeout as e:
        raise TimeoutError(
            f"an analyzer worker spent more than timeout={timeout}s on a chunk of at most "
            f"{max(b - a for a, b in chunks)} samples; a metric function is stuck, or raise "
            "timeout"
        ) from e


def run_pass(
    workers: Workers | None,
    index: int,
    dataset: Any,
    chunks: list[tuple[int, int]],
    samples: list[SampleMetric],
    accs: list[AccumulatedMetric],
    ctx: dict[str, Any],
    *,
    timeout: float,
    bar: Progress,
) -> ChunkOut:
    """Run one pass over ``chunks``: per-sample values concatenated, accumulations summed.

    Both are merged in chunk order, so the result does not depend on the number of workers.
    """
    out = _PassOutput(samples, accs, bar)
    exact = {a.name: out.sums[a.name] for a in accs if _is_exact(a)}
    if workers is None:
        _init_worker(dataset, samples, accs, ctx)
        for start, stop in chunks:
            out.merge(_run_chunk((start, stop), exact), stop - start)
    else:
        _pass_on_workers(workers, index, chunks, ctx, exact, out, timeout)
    return out.result()
