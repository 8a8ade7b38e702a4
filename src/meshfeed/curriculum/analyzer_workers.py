"""The analyzer's passes: chunk execution, in this process or on a pool of worker processes.

A pass runs the metrics of one analysis pass over a rank's chunks. Without workers each chunk
runs here; with :class:`Workers` (a :class:`~meshfeed.services.PassService`) each chunk goes to
whichever worker is free (a slowed worker takes fewer chunks) and results are merged in chunk
order, so the output does not depend on who computed what. Integer accumulations are summed in
each worker and returned once per pass (exact in any order); float ones travel per chunk, to be
added in chunk order. Every wait on a worker is bounded by the service's ``timeout``: a stuck
metric fails the pass, never hangs it.

Worker state lives in module globals set by the workers' start function (inherited under
``fork``; under ``spawn`` this module is imported in the worker and the metrics pickled).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from meshfeed.curriculum.metrics import AccumulatedMetric, SampleMetric
from meshfeed.progress import Progress
from meshfeed.runtime import WorkerTimeout
from meshfeed.services.passes import PassService

__all__ = ["ChunkOut", "Passes", "Workers", "run_pass"]

ChunkOut = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]

# Set in each worker by _start_worker (its arguments are inherited, not pickled, under fork).
_WORK: tuple[Any, list[SampleMetric], list[AccumulatedMetric], dict[str, Any]] | None = None


# A worker's running sums of its integer accumulations in the current pass, returned and reset
# on "flush" (integer sums are exact in any order; see the module docstring).
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
    sums = {a.name: into[a.name] if a.name in into else _zeros([a])[a.name] for a in accs}
    items = [dataset[i] for i in range(start, stop)]
    for m in samples:
        values[m.name][:] = _sample_values(m, items, ctx)
    for a in accs:
        _accumulate(a, sums[a.name], items)
    return values, {k: v for k, v in sums.items() if k not in into}


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
    """The analyzer's workers (a :class:`~meshfeed.services.PassService`), started once and
    reused by every pass where they can be."""

    def __init__(self, service: PassService, dataset: Any, passes: Passes):
        self.service, self.dataset, self.passes = service, dataset, passes

    def begin(self, index: int, ctx: dict[str, Any]) -> PassService:
        service = self.service
        if service.started:
            try:
                pickle.dumps(ctx)
            except Exception:  # e.g. a local object from prepare: start workers that inherit it
                service.shutdown()
            else:
                service.broadcast(("pass", index, ctx))
                return service
        service.start(_start_worker, self.dataset, self.passes, index, ctx)
        return service


class _PassOutput:
    """One pass's per-sample values and accumulated sums, merged in chunk order."""

    def __init__(self, samples: list[SampleMetric], accs: list[AccumulatedMetric], bar: Progress):
        self.samples, self.bar = samples, bar
        self.values: dict[str, list[np.ndarray]] = {m.name: [] for m in samples}
        self.sums = _zeros(accs)

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
        service = workers.begin(index, ctx)
        for k, part in service.map(chunks):
            out.merge(part, chunks[k][1] - chunks[k][0])
        if exact:  # every worker's integer sums of this pass
            for sums in service.broadcast(("flush",)):
                for name, part in sums.items():
                    exact[name] += part
    except WorkerTimeout as e:
        raise TimeoutError(
            f"an analyzer worker spent more than timeout={timeout}s on a chunk of at most "
            f"{max(b - a for a, b in chunks)} samples; a metric function is stuck, or raise "
            "timeout"
        ) from e


def run_pass(
    workers: Workers | None,
    index: int,
    passes: Passes,
    dataset: Any,
    chunks: list[tuple[int, int]],
    accumulated: dict[str, np.ndarray],
    *,
    n: int,
    world: int,
    timeout: float,
    show: bool,
) -> ChunkOut:
    """Run pass ``index`` over this rank's ``chunks``, under its own progress bar: per-sample
    values concatenated, accumulations summed.

    Both are merged in chunk order, so the result does not depend on the number of workers.
    """
    samples, accs = passes[index]
    ctx = {m.name: m.context(accumulated) for m in samples if m.requires}
    # One bar per pass, each counting the dataset's samples once (a metric that
    # ``requires`` an accumulation reads every sample a second time).
    desc = f"analyze pass {index + 1}/{len(passes)}" if len(passes) > 1 else "analyze"
    with Progress(total=n, desc=desc, unit="samples", enabled=show) as bar:
        out = _PassOutput(samples, accs, bar)
        exact = {a.name: out.sums[a.name] for a in accs if _is_exact(a)}
        if workers is None:
            _init_worker(dataset, samples, accs, ctx)
            for start, stop in chunks:
                out.merge(_run_chunk((start, stop), exact), stop - start)
        else:
            _pass_on_workers(workers, index, chunks, ctx, exact, out, timeout)
        local = out.result()
        bar.update((n - sum(b - a for a, b in chunks)) if world > 1 else 0)
    return local
