"""The one worker runtime: ordered worker processes, bounded waits, kill, restart.

Every part of meshfeed that runs work in local processes (the workers of all three loaders,
the metric analyzer's passes) uses :class:`WorkerPool`, driven from :mod:`meshfeed.services`
alone (``WorkerService``, ``PassService``). A worker runs
``init(worker_id, num_workers, *args)`` once and then the returned handler on each task;
results come back in request order, tensors and arrays through shared memory.

>>> from meshfeed.runtime import WorkerPool, call
>>> with WorkerPool(2, timeout=30) as pool:
...     pool.start(call)  # each task is (fn, args); fn must be importable under spawn
...     for i in range(4):
...         pool.submit((pow, (i, 2)))
...     print([pool.result() for _ in range(4)])
[0, 1, 4, 9]

``pool.start(call, initializer, *initargs)`` runs ``initializer(*initargs)`` once per worker
first. Per-worker state (a stream slot's reader, a dataset opened once per worker): pass an ``init``
that builds it and returns the handler, and address workers with ``send(w, task)`` /
``recv(w)``. A worker that raises re-raises in the caller with its traceback; one that dies or
stalls raises :class:`WorkerDied` / :class:`WorkerTimeout` (both :class:`WorkerError`) within
``timeout`` + about one second, and the pool is shut down; ``start`` again to continue.
Workers never outlive the process that started them, however it dies (SIGKILL included):
see :mod:`meshfeed.runtime.lifeline`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from meshfeed.runtime.failures import PoolClosed, WorkerDied, WorkerError, WorkerTimeout
from meshfeed.runtime.pool import WorkerPool, default_start_method

__all__ = [
    "PoolClosed",
    "WorkerDied",
    "WorkerError",
    "WorkerPool",
    "WorkerTimeout",
    "available_cores",
    "call",
    "default_start_method",
]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _call_task(task: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    fn, args = task
    return fn(*args)


def call(
    worker: int,
    num_workers: int,
    initializer: Callable[..., Any] | None = None,
    *initargs: Any,
) -> Callable[[Any], Any]:
    """An ``init`` whose handler runs tasks of the form ``(fn, args)`` as ``fn(*args)``.

    ``pool.start(call, initializer, *initargs)`` first runs ``initializer(*initargs)`` once in
    each worker (like ``ProcessPoolExecutor``'s initializer), e.g. to connect to a store.
    """
    if initializer is not None:
        initializer(*initargs)
    return _call_task
