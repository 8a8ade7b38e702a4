"""Passes over independent tasks on worker processes: each task to whichever worker is free.

:class:`~meshfeed.services.WorkerService` makes batch ``i`` on worker ``i % k`` (a batch's worker
is part of its determinism). The analyzer's tasks (chunks) are independent and merged in task
order, so :class:`PassService` gives the next task to whichever worker answers first: a worker
slowed by other load takes fewer tasks instead of holding the pass back. Workers keep state
across tasks and passes (``start(init, *args)``, the :class:`~meshfeed.runtime.WorkerPool`
contract); :meth:`PassService.broadcast` asks each one thing. Every wait is bounded by
``timeout``: :class:`~meshfeed.runtime.WorkerTimeout` or :class:`~meshfeed.runtime.WorkerDied`,
never a hang.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshfeed.runtime import WorkerPool

__all__ = ["PassService"]

# Tasks queued per worker: one running, two waiting, so a worker never idles while the
# parent is busy or has not yet noticed its last result (a task can take a few milliseconds).
_DEPTH = 3
# How far (in tasks) dispatch may run ahead of the oldest task not yielded yet: bounds the
# results held for the in-order merge when one worker is slow.
_AHEAD_PER_WORKER = 8
# The longest single wait on the busy workers (one poll over all of them, woken by the first
# result or death): an unlimited pool timeout still checks in hourly.
_SLICE_MAX = 3600.0


class PassService:
    """``num_workers`` processes that run passes of tasks (see the module docstring).

    ``timeout`` bounds the wait for one task's result (``math.inf``: no limit); under
    ``start_method="spawn"`` ``init`` and its arguments are pickled, so they must be
    importable. ``shutdown`` is idempotent and bounded; ``start`` after it starts afresh.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        timeout: float,
        start_method: str | None = None,
        name: str = "meshfeed-pass-worker",
    ) -> None:
        self._pool = WorkerPool(num_workers, name=name, timeout=timeout, start_method=start_method)
        self.num_workers, self.timeout = num_workers, self._pool.timeout

    @property
    def started(self) -> bool:
        return self._pool.started

    def start(self, init: Callable[..., Callable[[Any], Any]], *args: Any) -> None:
        """Start the workers: each runs ``init(worker, num_workers, *args)`` once."""
        self._pool.start(init, *args)

    def broadcast(self, message: Any) -> list[Any]:
        """Every worker's answer to ``message``, in worker order (an error stops the workers,
        as in :meth:`map`)."""
        pool = self._pool
        try:
            for w in range(self.num_workers):
                pool.send(w, message)
            return [pool.recv(w) for w in range(self.num_workers)]
        except BaseException:
            pool.shutdown()
            raise

    def map(self, tasks: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        """``(task index, result)`` in task order; each task runs on whichever worker is free.

        A worker with no result for ``timeout`` seconds is received from, which raises
        :class:`~meshfeed.runtime.WorkerTimeout`. A map that does not run to its end (an error,
        or abandoned) stops the workers, so no task left in flight answers the next one."""
        d = _Dispatch(self._pool, tasks)
        try:
            d.refill_all()
            while d.next_merge < len(tasks):
                ready = d.ready()
                if ready is None:
                    continue
                for w in ready:
                    d.take(w)
                yield from d.merged()
                d.refill_all()
        except BaseException:
            self._pool.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the workers (within about ``3 * grace`` seconds, however they are stuck)."""
        self._pool.shutdown()


class _Dispatch:
    """The state of one :meth:`PassService.map`: each worker's queued tasks, the results not
    yielded yet, and the next task to send and to yield."""

    def __init__(self, pool: WorkerPool, tasks: Sequence[Any]):
        k = pool.num_workers
        self.pool, self.tasks, self.k = pool, tasks, k
        self.queued: list[deque[int]] = [deque() for _ in range(k)]
        self.since = [0.0] * k  # when the worker's oldest queued task could start
        self.done: dict[int, Any] = {}
        self.next_task = self.next_merge = 0
        self.ahead = _AHEAD_PER_WORKER * k

    def refill_all(self) -> None:
        for w in range(self.k):
            self.refill(w)

    def refill(self, w: int) -> None:
        if not self.queued[w]:
            self.since[w] = time.monotonic()
        # near the end of the pass queue less, so no worker is left holding the last tasks
        # while another runs dry
        depth = _DEPTH if len(self.tasks) - self.next_task > self.k * _DEPTH else 2
        limit = min(len(self.tasks), self.next_merge + self.ahead)
        while len(self.queued[w]) < depth and self.next_task < limit:
            self.pool.send(w, self.tasks[self.next_task])
            self.queued[w].append(self.next_task)
            self.next_task += 1

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
