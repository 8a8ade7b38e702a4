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
    sums = {a.name: into.get(a.name) for a in accs}
    sums.update(_zeros([a for a in accs if sums[a.name] is None]))
    items = [dataset[i] for i in range(start, stop)]
    for m in samples:
        args = (ctx[m.name],) if m.requires else ()
        if m.batch_fn is not None:
            values[m.name][:] = m.batch_fn(items, *args)
        else:
            values[m.name][:] = [m.fn(item, *args) for item in items]
    for a in accs:
        acc = sums[a.name]
        assert acc is not None  # filled above
        if a.batch_fn is not None:
            a.batch_fn(acc, items)
        else:
            for item in items:
                a.fn(acc, item)
    return values, {k: v for k, v in sums.items() if v is not None and k not in into}


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


def _dispatch(pool: WorkerPool, chunks: list[tuple[int, int]]) -> Iterator[tuple[int, Any]]:
    """``(chunk index, result)`` in chunk order; each chunk goes to whichever worker is free.

    Round-robin hands every worker the same number of chunks, so a pass lasts as long as the
    slowest worker's share: on a machine whose cores are shared with other processes one
    descheduled worker held the other back. Here a worker gets its next chunk as soon as one
    of its results arrives, results are merged in chunk order (so the output does not depend
    on who computed what), and the pool's ``timeout`` still bounds every wait: a worker with
    no result for that long is received from, which raises ``WorkerTimeout``.
    """
    k = pool.num_workers
    queued: list[deque[int]] = [deque() for _ in range(k)]
    since = [0.0] * k  # when the worker's oldest queued chunk could start
    done: dict[int, Any] = {}
    next_chunk = next_merge = 0
    ahead = _AHEAD_PER_WORKER * k

    def refill(w: int) -> None:
        nonlocal next_chunk
        if not queued[w]:
            since[w] = time.monotonic()
        # near the end of the pass queue less, so no worker is left holding the last chunks
        # while another runs dry
        depth = _DEPTH if len(chunks) - next_chunk > k * _DEPTH else 2
        while len(queued[w]) < depth and next_chunk < min(len(chunks), next_merge + ahead):
            pool.send(w, chunks[next_chunk])
            queued[w].append(next_chunk)
            next_chunk += 1

    def take(w: int) -> None:
        done[queued[w].popleft()] = pool.recv(w)
        since[w] = time.monotonic()

    for w in range(k):
        refill(w)
    while next_merge < len(chunks):
        busy = [w for w in range(k) if queued[w]]
        ready = [w for w in busy if pool.ready(w)]  # a result, or a dead worker to report
        if not ready and len(busy) == 1:
            ready = busy  # nothing to balance: recv blocks, bounded by the pool's timeout
        elif not ready:
            # one wait on every busy worker at once, until the earliest pool deadline
            now = time.monotonic()
            late = min(since[w] for w in busy) + pool.timeout - now
            ready = pool.wait_any(busy, max(0.0, min(late, _SLICE_MAX)))
            if not ready:
                now = time.monotonic()
                for w in busy:
                    if now - since[w] > pool.timeout:
                        take(w)  # waits out the pool's own deadline, then raises
                continue
        for w in ready:
            take(w)
        while next_merge in done:
            yield next_merge, done.pop(next_merge)
            next_merge += 1
        for w in range(k):
            refill(w)


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
    values: dict[str, list[np.ndarray]] = {m.name: [] for m in samples}
    sums = {a.name: np.zeros(a.size, dtype=a.dtype) for a in accs}

    def merge(out: _ChunkOut, size: int) -> None:
        for name, v in out[0].items():
            values[name].append(v)
        for name, part in out[1].items():
            sums[name] += part
        bar.update(size)

    exact = {a.name: sums[a.name] for a in accs if _exact(a)}
    if workers is None:
        _init_worker(dataset, samples, accs, ctx)
        for start, stop in chunks:
            merge(_run_chunk((start, stop), exact), stop - start)
    else:
        try:
            pool = workers.begin(index, ctx)
            for k, out in _dispatch(pool, chunks):
                merge(out, chunks[k][1] - chunks[k][0])
            if exact:
                for w in range(pool.num_workers):
                    pool.send(w, ("flush",))
                for w in range(pool.num_workers):
                    for name, part in pool.recv(w).items():
                        exact[name] += part
        except WorkerTimeout as e:
            raise TimeoutError(
                f"an analyzer worker spent more than timeout={timeout}s on a chunk of at most "
                f"{max(b - a for a, b in chunks)} samples; a metric function is stuck, or raise "
                "timeout"
            ) from e
    empty = {m.name: np.empty(0, dtype=m.dtype) for m in samples}
    return {k: np.concatenate(v) if v else empty[k] for k, v in values.items()}, sums


def _gather(local: _ChunkOut, world: int) -> list[_ChunkOut]:
    """Every rank's pass output, in rank order (ranks own contiguous chunk ranges)."""
    if world == 1:
        return [local]
    from meshfeed.dist import all_gather_objects

    return all_gather_objects(local)


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
    if num_workers < 0 or (chunk_size is not None and chunk_size < 1) or not timeout > 0:
        raise ValueError(
            f"need num_workers >= 0, chunk_size >= 1 (or None: automatic) and timeout > 0 "
            f"(got {num_workers=}, {chunk_size=}, {timeout=})"
        )
    samples, accs = _split_metrics(metrics)
    if not samples and not accs:
        raise ValueError("analyze() needs at least one metric, e.g. metrics=[seqlen()]")
    n = len(dataset)
    if n == 0:
        raise ValueError("analyze() got an empty dataset; there is nothing to index")
    fp = content_fingerprint(dataset)
    rank, world = _dist_info()
    size = default_chunk_size(n) if chunk_size is None else chunk_size
    all_chunks = [(s, min(s + size, n)) for s in range(0, n, size)]
    lo, hi = rank * len(all_chunks) // world, (rank + 1) * len(all_chunks) // world
    mine = all_chunks[lo:hi]

    first = [m for m in samples if not m.requires]
    second = [m for m in samples if m.requires]
    values: dict[str, np.ndarray] = {m.name: np.empty(n, dtype=m.dtype) for m in samples}
    accumulated: dict[str, np.ndarray] = {a.name: np.zeros(a.size, dtype=a.dtype) for a in accs}
    passes = [(first, accs), (second, [])] if second else [(first, accs)]
    # One pool for every pass: workers are started once.
    count = worker_count(num_workers, cores=available_cores(), chunks=len(mine))
    workers = None
    if count > 0:
        workers = _Workers(count, dataset, passes, timeout=timeout, start_method=mp_context)
    with contextlib.ExitStack() as stack:
        if workers is not None:
            stack.callback(workers.pool.shutdown)
        for index, (pass_samples, pass_accs) in enumerate(passes):
            ctx = {m.name: m.context(accumulated) for m in pass_samples if m.requires}
            offsets = dict.fromkeys(values, 0)
            # One bar per pass, each counting the dataset's samples once (a metric that
            # ``requires`` an accumulation reads every sample a second time).
            desc = f"analyze pass {index + 1}/{len(passes)}" if len(passes) > 1 else "analyze"
            with Progress(
                total=n, desc=desc, unit="samples", enabled=progress and rank == 0
            ) as bar:
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
            for part_values, part_sums in _gather(local, world):
                for name, v in part_values.items():
                    values[name][offsets[name] : offsets[name] + len(v)] = v
                    offsets[name] += len(v)
                for name, part in part_sums.items():
                    accumulated[name] += part
        if workers is not None:
            # The workers' exit (their address spaces are torn down: milliseconds each) runs
            # while the indexes are sorted; shutdown is bounded (about 3 * grace) and joined
            # before this returns, or raises.
            stopper = threading.Thread(
                target=workers.pool.shutdown, name="meshfeed-analyzer-stop", daemon=True
            )
            stopper.start()
            stack.callback(stopper.join)
        result: dict[str, MetricIndex | np.ndarray] = dict(accumulated)
        for m in samples:
            result[m.name] = MetricIndex.from_values(m.name, values[m.name], fingerprint=fp)
    if output_dir is not None and rank == 0:
        root = Path(output_dir)
        for name, item in result.items():
            if isinstance(item, MetricIndex):
                item.save(root / name)
            else:
                save_accumulated(root / name, name, item, fp)
    if world > 1 and output_dir is not None:
        from meshfeed.dist import barrier

        barrier()
    return result
