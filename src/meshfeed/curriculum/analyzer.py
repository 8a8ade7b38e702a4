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
per rank, in the main process; its result reaches the workers through their start function
(inherited under ``fork``, pickled once per worker under ``spawn``, so metric functions must
then be importable). Workers are a :class:`~meshfeed.services.PassService`: a stuck metric
fails the run after ``timeout`` and a dead worker at once, never a hang.

This module plans the passes and merges the ranks; :mod:`meshfeed.curriculum.analyzer_workers`
runs a pass (in this process or on the workers) and :mod:`meshfeed.curriculum.output` saves the
results, to a folder or a URL.

>>> from meshfeed.curriculum import analyze, seqlen
>>> result = analyze([[1, 2], [3], [4, 5, 6]], [seqlen()], progress=False)
>>> result["seqlen"].values.tolist(), result["seqlen"].order.tolist()
([2, 1, 3], [1, 0, 2])
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshfeed import dist
from meshfeed.curriculum.analyzer_workers import ChunkOut, Passes, Workers, run_pass
from meshfeed.curriculum.index import MetricIndex, content_fingerprint
from meshfeed.curriculum.metrics import AccumulatedMetric, SampleMetric
from meshfeed.curriculum.output import check_output, save_results
from meshfeed.runtime import available_cores
from meshfeed.services.passes import PassService
from meshfeed.storage import StorageOptions

__all__ = ["analyze", "default_chunk_size", "worker_count"]

Metric = SampleMetric | AccumulatedMetric

_CHUNKS_PER_PASS = 64
_MIN_CHUNK = 256
_MAX_CHUNK = 4096


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


def _rank_chunks(n: int, chunk_size: int | None, rank: int, world: int) -> list[tuple[int, int]]:
    """This rank's contiguous share of the dataset's fixed chunks."""
    size = default_chunk_size(n) if chunk_size is None else chunk_size
    all_chunks = [(s, min(s + size, n)) for s in range(0, n, size)]
    lo, hi = rank * len(all_chunks) // world, (rank + 1) * len(all_chunks) // world
    return all_chunks[lo:hi]


def _plan_passes(samples: list[SampleMetric], accs: list[AccumulatedMetric]) -> Passes:
    """The first pass computes what needs no accumulation; a second one, when needed, the
    sample metrics that ``require`` an accumulation."""
    first = [m for m in samples if not m.requires]
    second = [m for m in samples if m.requires]
    return [(first, accs), (second, [])] if second else [(first, accs)]


def _merge_ranks(
    local: ChunkOut, world: int, values: dict[str, np.ndarray], accumulated: dict[str, np.ndarray]
) -> None:
    """Gather every rank's pass output (in rank order: ranks own contiguous chunk ranges) and
    write it into ``values`` and ``accumulated``."""
    offsets = dict.fromkeys(values, 0)
    for part_values, part_sums in [local] if world == 1 else dist.all_gather_objects(local):
        for name, v in part_values.items():
            values[name][offsets[name] : offsets[name] + len(v)] = v
            offsets[name] += len(v)
        for name, part in part_sums.items():
            accumulated[name] += part


def _stop_in_background(stack: contextlib.ExitStack, service: PassService) -> None:
    # The workers' exit (their address spaces are torn down: milliseconds each) runs while
    # the indexes are sorted; shutdown is bounded (about 3 * grace) and joined before the
    # stack closes, or raises.
    stopper = threading.Thread(target=service.shutdown, name="meshfeed-analyzer-stop", daemon=True)
    stopper.start()
    stack.callback(stopper.join)


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
    storage_options: StorageOptions | None = None,
) -> dict[str, MetricIndex | np.ndarray]:
    """Compute ``metrics`` over ``dataset`` (``len`` + ``__getitem__``); return and save them.

    Returns ``{name: MetricIndex}`` for sample metrics and ``{name: array}`` for accumulated
    ones (including those pulled in by ``requires``). With ``output_dir`` each metric is saved
    to ``output_dir/<name>/`` (by rank 0 only under torch.distributed); ``output_dir`` may be
    a URL (``s3://bucket/metrics``, any fsspec protocol, credentials from ``storage_options``
    or the environment): written locally, then uploaded file by file, each metric's
    ``meta.json`` last, and checked before the analysis starts (see
    :mod:`meshfeed.curriculum.output`). ``num_workers=0`` runs
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
    if output_dir is not None:
        check_output(output_dir, storage_options)  # a bad URL fails now, not after the passes
    fp = content_fingerprint(dataset)
    rank, world = dist.rank(), dist.world_size()
    mine = _rank_chunks(n, chunk_size, rank, world)

    values: dict[str, np.ndarray] = {m.name: np.empty(n, dtype=m.dtype) for m in samples}
    accumulated: dict[str, np.ndarray] = {a.name: np.zeros(a.size, dtype=a.dtype) for a in accs}
    passes = _plan_passes(samples, accs)
    # One service for every pass (workers are started once); None to run in this process.
    count = worker_count(num_workers, cores=available_cores(), chunks=len(mine))
    workers: Workers | None = None
    if count:
        service = PassService(
            count, timeout=timeout, start_method=mp_context, name="meshfeed-analyzer-worker"
        )
        workers = Workers(service, dataset, passes)
    with contextlib.ExitStack() as stack:
        if workers is not None:
            stack.callback(workers.service.shutdown)
        for index in range(len(passes)):
            local = run_pass(
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
            _merge_ranks(local, world, values, accumulated)
        if workers is not None:
            _stop_in_background(stack, workers.service)
        result: dict[str, MetricIndex | np.ndarray] = dict(accumulated)
        for m in samples:
            result[m.name] = MetricIndex.from_values(m.name, values[m.name], fingerprint=fp)
    if output_dir is not None:
        if rank == 0:
            save_results(result, output_dir, fp, storage_options=storage_options)
        if world > 1:
            dist.barrier()  # the other ranks wait for rank 0's save
    return result
