"""Worker processes: batch i of a run is made by worker ``i % num_workers``.

The main process computes every task (the order is cheap arithmetic) and hands task i to
worker ``i % k``; results are read back in task order, so the output is exactly that of
``num_workers=0`` and the loader's state is simply the position of the last batch returned.

Batches travel as one pickled byte string per batch over the worker's pipe
(:mod:`meshfeed.services.wire`), so a batch already sent survives the death of its worker.

Each worker has its own task queue and result pipe. The main process waits on the pipe *and*
the worker's process sentinel with ``multiprocessing.connection.wait``, so a worker that dies
is noticed at once (no polling) and a worker that stalls is reported after ``timeout``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import traceback
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import numpy as np
import torch

from meshfeed.fetch import Fetcher, FetchEvents, FetchTask
from meshfeed.order.permutation import derive_seed
from meshfeed.services.wire import dumps, loads


class WorkerError(RuntimeError):
    """A worker process died, stalled, or raised something that cannot be re-raised as is."""


def _worker_main(
    worker_id: int, num_workers: int, fetcher: Fetcher, tasks: Any, results: Connection
) -> None:
    torch.set_num_threads(1)
    # Global RNGs get a per-worker seed so code that uses them is at least reproducible;
    # per-sample randomness should use meshfeed.sample_rng, which does not depend on workers.
    seed = derive_seed(fetcher.seed, 0x574B, worker_id)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    fetcher.worker_id, fetcher.num_workers = worker_id, num_workers
    while True:
        try:
            task = tasks.get()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if task is None:
            return
        try:
            out: tuple[Any, ...] = ("ok", fetcher(task))
        except Exception as exc:
            out = ("error", type(exc), str(exc), traceback.format_exc())
        try:
            payload = dumps(out)
        except Exception as exc:  # the batch could not be pickled
            payload = dumps(("error", type(exc), str(exc), traceback.format_exc()))
        results.send_bytes(payload)


def _reraise(
    worker_id: int, step: int, exc_type: type[BaseException], message: str, tb: str
) -> None:
    text = f"{message}\n\n(raised in worker {worker_id} while making step {step}; worker traceback:)\n{tb}"
    try:
        exc = exc_type(text)
    except Exception:
        exc = WorkerError(f"{exc_type.__name__}: {text}")
    raise exc


class WorkerService:
    """Makes batches in ``num_workers`` processes, ``prefetch`` batches ahead per worker."""

    def __init__(
        self,
        num_workers: int,
        *,
        prefetch: int = 2,
        timeout: float = 300.0,
        start_method: str | None = None,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(
                f"num_workers must be an int >= 1 for WorkerService (got {num_workers=})"
            )
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1 (got {prefetch=})")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds (got {timeout=})")
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.timeout = float(timeout)
        methods = mp.get_all_start_methods()
        self.start_method = start_method or ("fork" if "fork" in methods else "spawn")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: list[Connection] = []
        self._pending: list[deque[int]] = []

    @property
    def started(self) -> bool:
        return bool(self._procs)

    def start(self, fetcher: Fetcher) -> None:
        if self._procs:
            return
        ctx: Any = mp.get_context(self.start_method)
        for w in range(self.num_workers):
            tasks = ctx.Queue()
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker_main,
                args=(w, self.num_workers, fetcher, tasks, send),
                name=f"meshfeed-worker-{w}",
                daemon=True,
            )
            proc.start()
            send.close()
            self._procs.append(proc)
            self._tasks.append(tasks)
            self._results.append(recv)
            self._pending.append(deque())

    def _receive(self, w: int) -> tuple[Any, FetchEvents]:
        step = self._pending[w].popleft()
        conn, proc = self._results[w], self._procs[w]
        ready = wait([conn, proc.sentinel], timeout=self.timeout)
        if conn not in ready:
            if proc.sentinel in ready and not conn.poll(0.05):
                self._died(w, step)
            if not ready:
                self.shutdown()
                raise WorkerError(
                    f"worker {w} (pid {proc.pid}) produced nothing for step {step} within "
                    f"timeout={self.timeout}s; the dataset may be stuck on I/O. Raise timeout= if "
                    "single batches legitimately take longer"
                )
        try:
            message = loads(conn.recv_bytes())
        except (EOFError, OSError):
            proc.join(timeout=1.0)
            self._died(w, step)
        if message[0] == "error":
            _, exc_type, text, tb = message
            _reraise(w, step, exc_type, text, tb)
        return message[1]

    def _died(self, w: int, step: int) -> NoReturn:
        proc = self._procs[w]
        pid, code = proc.pid, proc.exitcode
        self.shutdown()
        raise WorkerError(
            f"worker {w} (pid {pid}) exited unexpectedly with exit code {code} while making "
            f"step {step}; it may have run out of memory or been killed. The loader is shut "
            "down; restore it from the last checkpoint"
        )

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        if not self._procs:
            raise RuntimeError("WorkerService.map() before start(); call start(fetcher) first")
        # Discard what an abandoned earlier iteration left in flight, so outputs stay aligned.
        for w in range(self.num_workers):
            while self._pending[w]:
                self._receive(w)
        inflight: deque[int] = deque()
        counter = 0
        source = iter(tasks)
        exhausted = False

        def submit() -> None:
            nonlocal counter, exhausted
            try:
                task = next(source)
            except StopIteration:
                exhausted = True
                return
            w = counter % self.num_workers
            counter += 1
            self._tasks[w].put(task)
            self._pending[w].append(task.step)
            inflight.append(w)

        while not exhausted and len(inflight) < self.num_workers * self.prefetch:
            submit()
        while inflight:
            w = inflight.popleft()
            result = self._receive(w)
            if not exhausted:
                submit()
            yield result

    def shutdown(self) -> None:
        procs, self._procs = self._procs, []
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
        for q in self._tasks:
            q.cancel_join_thread()
            q.close()
        for c in self._results:
            c.close()
        self._tasks, self._results, self._pending = [], [], []
