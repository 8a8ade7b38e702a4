"""Worker processes: batch i of a run is made by worker ``i % num_workers``.

The main process computes every task (the order is cheap arithmetic) and hands task i to
worker ``i % k`` of a :class:`~meshfeed.runtime.WorkerPool`; results are read back in task
order, so the output is exactly that of ``num_workers=0`` and the loader's state is simply the
position of the last batch returned. Tensors travel through the pool's shared-memory slots and
are copied out before a batch is returned (see :mod:`meshfeed.runtime.transport`), so a batch
already received survives the death of its worker and never aliases memory a worker writes.

A worker that dies or stalls raises :class:`WorkerError` (within ``timeout`` + about one
second); a sample error re-raises as its own type with the worker's traceback. After any
error the workers are stopped, and the next ``map`` starts fresh ones: iterating the loader
again continues from the position of the last batch it returned.

Every door drives its workers through ``map``: a ``DataLoader``'s batches, a stream's, and a
sample store loader's (``max_chunk=1``: a store batch may wait for producers, so none travels
behind a later one).
"""

from __future__ import annotations

import importlib
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from meshfeed.order.permutation import derive_seed
from meshfeed.protocols import Fetch
from meshfeed.runtime import WorkerDied, WorkerError, WorkerPool, WorkerTimeout
from meshfeed.runtime.failures import failure_message
from meshfeed.tasks import FetchEvents, FetchTask

__all__ = ["WorkerError", "WorkerService"]

#: Worker time one message should carry: batches cheaper than this travel together.
_CHUNK_SECONDS = 1e-3
_MAX_CHUNK = 16


def seed_globals(seed: int) -> None:
    """Seed Python's, numpy's and torch's global RNGs (a worker's or a Ray loader actor's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _start_fetcher(worker: int, num_workers: int, fetcher: Fetch) -> Callable[[Any], Any]:
    # Global RNGs get a per-worker seed so code that uses them is at least reproducible;
    # per-sample randomness should use meshfeed.sample_rng, which does not depend on workers.
    seed_globals(derive_seed(fetcher.seed, 0x574B, worker))
    fetcher.worker_id, fetcher.num_workers = worker, num_workers
    return fetcher


class WorkerService:
    """Makes batches in ``num_workers`` processes, ``prefetch`` messages ahead per worker.

    A message carries one batch, or several consecutive batches of that worker when batches
    are cheap (under about a millisecond of worker time: up to 16 per message, sized from
    what the workers measure), so the main process pays one pipe message and one copy for
    all of them. Batch ``i`` is made by worker ``i % num_workers`` either way.

    ``timeout`` bounds the wait for one message, counted from when its worker could start it
    (``None`` or ``math.inf``: no limit). Under ``start_method="spawn"`` the dataset, its
    ``collate_fn`` and the rest of the fetcher are pickled, so they must be importable.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        prefetch: int = 2,
        timeout: float | None = 300.0,
        start_method: str | None = None,
        name: str = "meshfeed-worker",
        grace: float = 0.5,
        max_chunk: int = _MAX_CHUNK,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(
                f"num_workers must be an int >= 1 for WorkerService (got {num_workers=})"
            )
        for what, value in (("prefetch", prefetch), ("max_chunk", max_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be an int >= 1 (got {what}={value!r})")
        self._pool = WorkerPool(
            num_workers,
            timeout=timeout,
            start_method=start_method,
            name=name,
            grace=grace,
            ring=prefetch + 2,
        )
        self.num_workers, self.prefetch = num_workers, prefetch
        #: Batches one message may carry (1: each batch travels alone, as soon as it is made).
        self.max_chunk = min(max_chunk, _MAX_CHUNK)
        self.timeout, self.start_method = self._pool.timeout, self._pool.start_method
        self._fetcher: Fetch | None = None

    @property
    def started(self) -> bool:
        return self._pool.started

    @property
    def in_flight(self) -> int:
        """The most tasks a ``map`` holds taken and not yet passed: ``prefetch`` messages per
        worker, and the batch the loop holds (the next task is sent before it is yielded)."""
        return self.num_workers * self.prefetch * self.max_chunk + 1

    @property
    def pids(self) -> list[int]:
        """The running workers' process ids."""
        return self._pool.pids

    def start(self, fetcher: Fetch) -> None:
        self._fetcher = fetcher
        # numpy.random loads on first use: loaded here, before the fork, each forked worker
        # has it instead of loading it itself (~35 ms) before its first batch.
        importlib.import_module("numpy.random")
        self._pool.start(_start_fetcher, fetcher)

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        if self._fetcher is None:
            raise RuntimeError("WorkerService.map() before start(); call start(fetcher) first")
        pool = self._pool
        while pool.started and pool.outstanding():  # what an abandoned iteration left
            try:
                pool.result()
            except Exception:
                pool.shutdown()
        pool.start(_start_fetcher, self._fetcher)  # a no-op unless stopped by an error
        return self._run(pool, iter(tasks))

    def _run(self, pool: WorkerPool, source: Iterator[FetchTask]) -> Iterator[Any]:
        steps: deque[int] = deque()
        k = self.num_workers

        def fill() -> None:
            # Up to `prefetch` messages per worker in flight. Cheap batches travel several to
            # a message (one pipe message and one copy for all of them); a round hands every
            # worker its share, so batch i is still made by worker i % k.
            chunk = self._chunk(pool)
            step = k * chunk if chunk > 1 else 1
            while len(steps) + step <= k * self.prefetch * chunk:
                tasks = list(itertools.islice(source, step))
                if not tasks:
                    return
                pool.submit_many(tasks)
                steps.extend(t.step for t in tasks)

        try:
            try:
                fill()
            except (WorkerTimeout, WorkerDied) as e:
                raise self._failure(
                    e, f"step {steps[-1] + 1}" if steps else "its first step"
                ) from None
            while steps:
                step = steps.popleft()
                result = self._result(pool, step)
                try:
                    fill()  # sending to a worker that died is where its death may show first
                except (WorkerTimeout, WorkerDied) as e:
                    yield result  # received whole: returned, then the failure is raised
                    raise self._failure(e, f"step {steps[0] if steps else step + 1}") from None
                yield result
        except GeneratorExit:  # abandoned: the next map() drains what is in flight
            raise
        except BaseException:
            pool.shutdown()  # the next map() starts fresh workers
            raise

    def _chunk(self, pool: WorkerPool) -> int:
        """Batches per message: enough for about a millisecond of a worker's time (at most
        ``max_chunk``), one while batches cost more than that or nothing is measured yet."""
        seconds = pool.task_seconds
        if seconds <= 0 or self.max_chunk == 1:
            return 1
        return max(1, min(self.max_chunk, int(_CHUNK_SECONDS / seconds)))

    def _result(self, pool: WorkerPool, step: int) -> Any:
        try:
            return pool.result()
        except (WorkerTimeout, WorkerDied) as e:
            raise self._failure(e, f"step {step}") from None

    @staticmethod
    def _failure(error: WorkerTimeout | WorkerDied, what: str) -> WorkerError:
        return WorkerError(
            failure_message(
                error,
                who="loader",
                what=what,
                then="Its workers were stopped; iterating the loader again starts fresh "
                "workers and continues from the first batch it has not returned (nothing is "
                "lost or repeated)",
            )
        )

    def shutdown(self) -> None:
        self._pool.shutdown()
