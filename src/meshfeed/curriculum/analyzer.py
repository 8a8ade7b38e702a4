"""The offline analyzer: run metric functions over a dataset, in parallel, into metric indexes.

The dataset is cut into fixed chunks of ``chunk_size`` samples (by default
:func:`default_chunk_size`, a function of the length only). Chunks are spread over
torch.distributed ranks (contiguous ranges, when a process group is initialised) and, inside
each rank, over worker processes: at most the cores this process may use
(:func:`worker_count`), each given its next chunk as soon as it returns one, so a worker slowed
by other load on the machine takes fewer chunks instead of holding the pass back. Results are
merged in chunk order, so per-sample values are bit-identical for any number of workers or
ranks. Integer accumulations (token histograms) are exact in any order: each worker keeps one
running sum per pass and returns it once. Float accumulations are returned per chunk and summed
in chunk order (they can differ in the last bits between different *rank* counts, never
between worker counts).

Metrics that ``require`` accumulated ones (vocabulary rarity needs the token histogram) run in a
second pass once the accumulated arrays are reduced on every rank. Their ``prepare`` runs once
per rank, in the main process; its result reaches the workers through the pool's per-worker
start function (inherited under ``fork``, pickled once per worker under ``spawn``, so metric
functions must then be importable). Workers are a :class:`~meshfeed.runtime.WorkerPool`: a
stuck metric fails the run after ``timeout`` and a dead worker at once, never a hang.

>>> from meshfeed.curriculum import analyze, seqlen
>>> result = analyze([[1, 2], [3], [4, 5, 6]], [seqlen()], progress=False)
>>> result["seqlen"].values.tolist(), result["seqlen"].order.tolist()
([2, 1, 3], [1, 0, 2])
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.curriculum.index import MetricIndex, content_fingerprint, save_accumulated
from meshfeed.curriculum.metrics import AccumulatedMetric, SampleMetric
from meshfeed.progress import Progress
from meshfeed.runtime import WorkerPool, WorkerTimeout, available_cores

__all__ = ["analyze", "default_chunk_size", "worker_count"]

Metric = SampleMetric | AccumulatedMetric
_ChunkOut = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]

_CHUNKS_PER_PASS = 64
_MIN_CHUNK = 256
_MAX_CHUNK = 4096

# Set in each worker by _start_worker (its arguments are inherited, not pickled, under fork).
_WORK: tuple[Any, list[SampleMetric], list[AccumulatedMetric], dict[str, Any]] | None = None


# A worker's running sums of its integer accumulations in the current pass: integer sums are
# exact in any order, so each worker adds its chunks into one array and returns it once per
# pass (on "flush") instead of one array per chunk. Float sums still travel per chunk, to be
# added in chunk order.
_LOCAL: dict[str, np.ndarray] = {}


def _exact(acc: AccumulatedMetric) -> bool:
    return np.dtype(acc.dtype).kind in "iub"


def _zeros(accs: list[AccumulatedMetric]) -> dict[str, np.ndarray]:
    return {a.name: np.zeros(a.size, dtype=a.dtype) for a in accs}


def _init_worker(
    dataset: Any, samples: list[SampleMetric], accs: list[AccumulatedMetric], ctx: dict[str, Any]
) -> None:
    global _WORK, _LOCAL
    _WORK = (dataset, samples, accs, ctx)
    _LOCAL = _zeros([a for a in accs if _exact(a)])


_Passes = list[tuple[list[SampleMetric], list[AccumulatedMetric]]]
_PASSES: _Passes = []


def _start_worker(
    worker: int, num_workers: int, dataset: Any, passes: _Passes, first: int, ctx: dict[str, Any]
) -> Callable[[Any], Any]:
    # The metrics come with the start arguments (inherited under fork: local functions work).
    global _PASSES
    _PASSES = passes
    samples, accs = passes[first]
    _init_worker(dataset, samples, accs, ctx)
    return _handle


def _handle(task: Any) -> _ChunkOut | dict[str, np.ndarray] | None:
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


def _run_chunk(chunk: tuple[int, int], into: dict[str, np.ndarray]) -> _ChunkOut:
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


def default_chunk_size(n: int) -> int:
    """Samples per work item when ``chunk_size`` is not given: about 64 chunks per pass
    (so work spreads evenly over the workers and the last chunk is a small tail), at least
    256 samples (so a chunk outweighs its message and result) and at most 4,096 (so a chunk's
    result stays small). A function of the dataset length only: the chunks, and with them
    the output, are the same for every number of workers."""
    return min(_MAX_CHUNK, max(_MIN_CHUNK, -(-n // _CHUNKS_PER_PASS)))


def worker_count(requested: int, *, cores: int, chunks: int) -> int:
    """Worker processes to start for ``-j requested``: never more than the ``cores`` this
    process may run on (on CPU-bound metrics more workers only add start-up and switching
    costs, so ``-j`` above the cores runs as ``-j cores``), nor more than there are chunks;
    0 runs in this process."""
    return max(0, min(requested, cores, chunks))


def _split_metrics(metrics: Sequence[Metric]) -> tuple[list[SampleMetric], list[AccumulatedMetric]]:
    samples: list[SampleMetric] = []
    accs: dict[str, AccumulatedMetric] = {}
    for m in metrics:
        if isinstance(m, SampleMetric):
            samples.append(m)
            for a in m.requires:
                accs.setdefault(a.name, a)
        elif isinstance(m, AccumulatedMetric):
            accs.setdefault(m.name, m)
        else:
            raise TypeError(
                f"metrics must be SampleMetric or AccumulatedMetric (got {m!r}); build them "
                "with seqlen(), vocab_rarity(), SampleMetric(name=..., fn=...)"
            )
    names = [m.name for m in samples] + list(accs)
    if len(set(names)) != len(names):
        raise ValueError(f"metric names must be unique (got {names})")
    return samples, list(accs.values())


def _dist_info() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Workers:
    """The analyzer's pool, started once and reused by every pass where it can be."""

    def __init__(self, workers: int, dataset: Any, passes: _Passes, **pool_options: Any):
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

    def merge(self, out: _ChunkOut, size: int) -> None:
        for name, v in out[0].items():
            self.values[name].append(v)
        for name, part in out[1].items():
            self.sums[name] += part
        self.bar.update(size)

    def result(self) -> _ChunkOut:
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
    workers: _Workers,
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


def _pass(
    workers: _Workers | None,
    index: int,
    dataset: Any,
    chunks: list[tuple[int, int]],
    samples: list[SampleMetric],
    accs: list[AccumulatedMetric],
    ctx: dict[str, Any],
    *,
    timeout: float,
    bar: Progress,
) -> _ChunkOut:
    """Run one pass over ``chunks``: per-sample values concatenated, accumulations summed.

    Both are merged in chunk order, so the result does not depend on the number of workers.
    """
    out = _PassOutput(samples, accs, bar)
    exact = {a.name: out.sums[a.name] for a in accs if _exact(a)}
    if workers is None:
        _init_worker(dataset, samples, accs, ctx)
        for start, stop in chunks:
            out.merge(_run_chunk((start, stop), exact), stop - start)
    else:
        _pass_on_workers(workers, index, chunks, ctx, exact, out, timeout)
    return out.result()


def _gather(local: _ChunkOut, world: int) -> list[_ChunkOut]:
    """Every rank's pass output, in rank order (ranks own contiguous chunk ranges)."""
    if world == 1:
        return [local]
    from meshfeed.dist import all_gather_objects

    return all_gather_objects(local)


def _check_options(num_workers: int, chunk_size: int | None, timeout: float) -> None:
    if num_workers < 0 or (chunk_size is not None and chunk_size < 1) or not timeout > 0:
        raise ValueError(
            f"need num_workers >= 0, chunk_size >= 1 (or None: automatic) and timeout > 0 "
            f"(got {num_workers=}, {chunk_size=}, {timeout=})"
        )


def _rank_chunks(n: int, chunk_size: int | None, rank: int, world: int) -> list[tuple[int, int]]:
    """This rank's contiguous share of the dataset's fixed chunks."""
    size = default_chunk_size(n) if chunk_size is None else chunk_size
    all_chunks = [(s, min(s + size, n)) for s in range(0, n, size)]
    lo, hi = rank * len(all_chunks) // world, (rank + 1) * len(all_chunks) // world
    return all_chunks[lo:hi]


def _plan_passes(samples: list[SampleMetric], accs: list[AccumulatedMetric]) -> _Passes:
    """The first pass computes what needs no accumulation; a second one, when needed, the
    sample metrics that ``require`` an accumulation."""
    first = [m for m in samples if not m.requires]
    second = [m for m in samples if m.requires]
    return [(first, accs), (second, [])] if second else [(first, accs)]


def _make_workers(
    num_workers: int,
    chunks: int,
    dataset: Any,
    passes: _Passes,
    timeout: float,
    mp_context: str | None,
) -> _Workers | None:
    """One pool for every pass (workers are started once); None to run in this process."""
    count = worker_count(num_workers, cores=available_cores(), chunks=chunks)
    if count == 0:
        return None
    return _Workers(count, dataset, passes, timeout=timeout, start_method=mp_context)


def _merge_ranks(
    parts: list[_ChunkOut], values: dict[str, np.ndarray], accumulated: dict[str, np.ndarray]
) -> None:
    """Write every rank's pass output (in rank order) into ``values`` and ``accumulated``."""
    offsets = dict.fromkeys(values, 0)
    for part_values, part_sums in parts:
        for name, v in part_values.items():
            values[name][offsets[name] : offsets[name] + len(v)] = v
            offsets[name] += len(v)
        for name, part in part_sums.items():
            accumulated[name] += part


def _analyze_pass(
    workers: _Workers | None,
    index: int,
    passes: _Passes,
    dataset: Any,
    mine: list[tuple[int, int]],
    accumulated: dict[str, np.ndarray],
    *,
    n: int,
    world: int,
    timeout: float,
    show: bool,
) -> _ChunkOut:
    """Pass ``index`` over this rank's chunks, under its own progress bar."""
    pass_samples, pass_accs = passes[index]
    ctx = {m.name: m.context(accumulated) for m in pass_samples if m.requires}
    # One bar per pass, each counting the dataset's samples once (a metric that
    # ``requires`` an accumulation reads every sample a second time).
    desc = f"analyze pass {index + 1}/{len(passes)}" if len(passes) > 1 else "analyze"
    with Progress(total=n, desc=desc, unit="samples", enabled=show) as bar:
        local = _pass(
            workers,
            index,
            dataset,
            mine,
            pass_samples,
            pass_accs,
            ctx,
            timeout=timeout,
            bar=bar,
        )
        bar.update((n - sum(b - a for a, b in mine)) if world > 1 else 0)
    return local


def _results(
    samples: list[SampleMetric],
    values: dict[str, np.ndarray],
    accumulated: dict[str, np.ndarray],
    fp: dict[str, Any],
) -> dict[str, MetricIndex | np.ndarray]:
    result: dict[str, MetricIndex | np.ndarray] = dict(accumulated)
    for m in samples:
        result[m.name] = MetricIndex.from_values(m.name, values[m.name], fingerprint=fp)
    return result


def _stop_in_background(stack: contextlib.ExitStack, pool: WorkerPool) -> None:
    # The workers' exit (their address spaces are torn down: milliseconds each) runs while
    # the indexes are sorted; shutdown is bounded (about 3 * grace) and joined before the
    # stack closes, or raises.
    stopper = threading.Thread(target=pool.shutdown, name="meshfeed-analyzer-stop", daemon=True)
    stopper.start()
    stack.callback(stopper.join)


def _save_results(
    result: dict[str, MetricIndex | np.ndarray],
    output_dir: str | os.PathLike[str] | None,
    fp: dict[str, Any],
    rank: int,
    world: int,
) -> None:
    """Rank 0 saves every metric under ``output_dir``; the other ranks wait for it."""
    if output_dir is None:
        return
    if rank == 0:
        root = Path(output_dir)
        for name, item in result.items():
            if isinstance(item, MetricIndex):
                item.save(root / name)
            else:
                save_accumulated(root / name, name, item, fp)
    if world > 1:
        from meshfeed.dist import barrier

        barrier()


def analyze(
    dataset: Any,
    metrics: Sequence[Metric],
    *,
    output_dir: str | os.PathLike[str] | None = None,
    num_workers: int = 0,
    chunk_size: int | None = None,
    progress: bool = True,
    mp_context: str | None = None,
    timeout: float = 3600.0,
) -> dict[str, MetricIndex | np.ndarray]:
    """Compute ``metrics`` over ``dataset`` (``len`` + ``__getitem__``); return and save them.

    Returns ``{name: MetricIndex}`` for sample metrics and ``{name: array}`` for accumulated
    ones (including those pulled in by ``requires``). With ``output_dir`` each metric is saved
    to ``output_dir/<name>/`` (by rank 0 only under torch.distributed). ``num_workers=0`` runs
    in this process; more workers than the available cores start only as many as there are
    cores. ``chunk_size=None`` picks :func:`default_chunk_size` of the dataset's length.
    ``timeout`` bounds the wait for any one chunk, so a stuck worker fails the run instead of
    hanging it. Under torchrun every rank must call this with the same arguments.
    """
    _check_options(num_workers, chunk_size, timeout)
    samples, accs = _split_metrics(metrics)
    if not samples and not accs:
        raise ValueError("analyze() needs at least one metric, e.g. metrics=[seqlen()]")
    n = len(dataset)
    if n == 0:
        raise ValueError("analyze() got an empty dataset; there is nothing to index")
    fp = content_fingerprint(dataset)
    rank, world = _dist_info()
    mine = _rank_chunks(n, chunk_size, rank, world)

    values: dict[str, np.ndarray] = {m.name: np.empty(n, dtype=m.dtype) for m in samples}
    accumulated: dict[str, np.ndarray] = {a.name: np.zeros(a.size, dtype=a.dtype) for a in accs}
    passes = _plan_passes(samples, accs)
    workers = _make_workers(num_workers, len(mine), dataset, passes, timeout, mp_context)
    with contextlib.ExitStack() as stack:
        if workers is not None:
            stack.callback(workers.pool.shutdown)
        for index in range(len(passes)):
            local = _analyze_pass(
                workers,
                index,
                passes,
                dataset,
                mine,
                accumulated,
                n=n,
                world=world,
                timeout=timeout,
                show=progress and rank == 0,
            )
            _merge_ranks(_gather(local, world), values, accumulated)
        if workers is not None:
            _stop_in_background(stack, workers.pool)
        result = _results(samples, values, accumulated, fp)
    _save_results(result, output_dir, fp, rank, world)
    return result
