"""``num_workers="auto"``: the worker count chosen from the measured cost of a batch and the
cores this process may use.

The first batches of a run are made in-process (they are the run's batches, delivered at
once: no warm-up is thrown away), timed, and then the rest of the run goes to
:func:`choose_workers` workers, or stays in-process where workers cannot pay off: on one
core, or for batches cheaper than :data:`MIN_BATCH_SECONDS` (a worker's batch costs the main
process a pipe message and a header; cheaper batches are made faster in place). Output is the
same either way: batch ``i`` is what ``num_workers=0`` makes (see
:mod:`meshfeed.services.workers`).

Two cores get two workers: on an idle 2-core machine, two workers delivered 1.67-1.97x the
in-process rate over every cell of ``bench_gpu.py``'s grid (batches of 0.4-256 ms;
``benchmarks/results/gpu_2cores.md``). In-process, every batch is made between two steps of
the training loop; a worker makes it during the step, even on a shared core.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshfeed.protocols import Fetch, Service
from meshfeed.services.base import InProcessService
from meshfeed.services.workers import WorkerService
from meshfeed.tasks import FetchEvents, FetchTask

__all__ = ["MAX_AUTO_WORKERS", "MIN_BATCH_SECONDS", "AutoService", "choose_workers", "usable_cores"]

#: Batches cheaper than this (in-process) stay in-process.
MIN_BATCH_SECONDS = 2e-4
#: The most workers ``"auto"`` starts.
MAX_AUTO_WORKERS = 32
#: Batches timed in-process before choosing (fewer when they take over PROBE_SECONDS).
PROBE_BATCHES = 3
PROBE_SECONDS = 0.05


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, math.ceil(int(quota) / int(period))))


def choose_workers(batch_seconds: float, cores: int) -> int:
    """Workers for batches costing ``batch_seconds`` in-process on ``cores`` usable cores:
    from five cores on, one core is left to the training loop and one to the rest (the
    delivery thread, the system); two workers on two to four cores (module docstring); 0
    (in-process) on one core or where batches are too cheap to send."""
    if cores < 2 or batch_seconds < MIN_BATCH_SECONDS:
        return 0
    return min(max(cores - 2, 2), MAX_AUTO_WORKERS)


class AutoService:
    """A :class:`~meshfeed.protocols.Service` that times the first batches in-process, then
    hands the rest to the workers :func:`choose_workers` picks (``chosen`` says how many)."""

    def __init__(
        self,
        *,
        prefetch: int = 2,
        timeout: float | None = 300.0,
        start_method: str | None = None,
        cores: int | None = None,
    ) -> None:
        self.prefetch, self.timeout, self.start_method = prefetch, timeout, start_method
        self.cores = usable_cores() if cores is None else cores
        #: The workers chosen (None until the first batches were timed).
        self.chosen: int | None = None
        self._fetcher: Fetch | None = None
        self._inner: Service | None = None

    def start(self, fetcher: Fetch) -> None:
        self._fetcher = fetcher
        if self._inner is not None:
            self._inner.start(fetcher)

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        if self._fetcher is None:
            raise RuntimeError("AutoService.map() before start(); call start(fetcher) first")
        return self._run(self._fetcher, iter(tasks))

    def _run(self, fetcher: Fetch, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        if self._inner is None:
            costs: list[float] = []
            for task in tasks:
                start = time.perf_counter()
                result = fetcher(task)
                costs.append(time.perf_counter() - start)
                yield result
                if len(costs) >= PROBE_BATCHES or sum(costs) >= PROBE_SECONDS:
                    break
            else:
                return  # the run ended while timing: choose at the next one
            self.chosen = choose_workers(statistics.median(costs), self.cores)
            self._inner = (
                WorkerService(
                    self.chosen,
                    prefetch=self.prefetch,
                    timeout=self.timeout,
                    start_method=self.start_method,
                )
                if self.chosen
                else InProcessService()
            )
            self._inner.start(fetcher)
        yield from self._inner.map(tasks)

    def shutdown(self) -> None:
        if self._inner is not None:
            self._inner.shutdown()
