"""WorkerPool: k worker processes, one task pipe each, results in request order, never a hang.

Each worker runs ``handler = init(worker_id, num_workers, *args)`` once, then ``handler(task)``
for every task sent to it, in order. The main process waits on the worker's result pipe *and*
its process sentinel together (one ``poll`` set per worker): a dead worker is noticed
at once, a stalled one after ``timeout`` seconds counted from the moment the worker could
start the task (when it was sent, or when the worker's previous result arrived, whichever is
later). Results travel through :mod:`meshfeed.runtime.transport` (shared-memory slots).

A handler that raises does not stop its worker: the exception is re-raised in the main
process with the worker's traceback in its message, as the original type when that type can
be built from one string, else as :class:`WorkerError`. A worker that dies or stalls raises
:class:`WorkerDied` / :class:`WorkerTimeout` and shuts the whole pool down; ``start`` may be
called again afterwards.

``shutdown`` sends every worker the stop message, waits ``grace`` seconds, sends SIGTERM,
waits ``grace`` again, sends SIGKILL and joins every child, so it returns within about
``3 * grace`` seconds even when a worker ignores SIGTERM or is stopped (SIGSTOP). A pool that
is never shut down is shut down when it is garbage-collected or at interpreter exit (before
``multiprocessing``'s own exit handler, which would wait for such a worker forever). A pool's
process that is killed outright takes its workers with it within about a quarter of a second
(see :mod:`meshfeed.runtime.lifeline`).

Under the ``spawn`` and ``forkserver`` start methods ``init`` and ``args`` are pickled, so they
must be importable (defined at module top level, not lambdas or local functions); a pickling
failure there is reported as a :class:`TypeError` saying so.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing as mp
import os
import pickle
import select
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import Any

from meshfeed.runtime.failures import PoolClosed, WorkerDied, WorkerTimeout, _reraise, exit_reason
from meshfeed.runtime.lifeline import Parent
from meshfeed.runtime.transport import SlotReader
from meshfeed.runtime.worker import _worker_main

__all__ = ["WorkerPool", "default_start_method"]


def default_start_method() -> str:
    """``fork`` where the platform has it (cheap start, nothing pickled), else ``spawn``."""
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


_STOP = pickle.dumps(None)


def _writable(conn: Connection, timeout: float | None) -> bool:
    """Whether ``conn`` takes a write within ``timeout`` s (poll: no FD_SETSIZE limit)."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLOUT)
    return bool(poller.poll(None if timeout is None else math.ceil(timeout * 1000)))


def _stop(procs: list[Any], tasks: list[Connection], grace: float, polite: bool) -> None:
    """Stop message (if ``polite``), SIGTERM, SIGKILL, each followed by at most ``grace`` s."""
    if polite:
        for conn in tasks:
            with contextlib.suppress(OSError, ValueError):
                if _writable(conn, 0.0):
                    conn.send_bytes(_STOP)
    signals = (None, signal.SIGTERM, signal.SIGKILL) if polite else (signal.SIGTERM, signal.SIGKILL)
    for sig in signals:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        if sig is not None:
            for p in alive:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, sig)
        deadline = time.monotonic() + grace
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.join(timeout=1.0)  # reaped: SIGKILL cannot be ignored, even by a stopped process
        with contextlib.suppress(ValueError):
            p.close()


def _shutdown_resources(state: dict[str, Any]) -> None:
    procs, tasks, results, readers = (
        state.pop(key, []) for key in ("procs", "tasks", "results", "readers")
    )
    _stop(procs, tasks, state.get("grace", 0.5), state.get("polite", True))
    for conn in [*tasks, *results]:
        conn.close()
    for reader in readers:
        reader.close()


_AFTER_CLOSE = (
    "nothing more comes from this iterator. A new iter(loader) continues where it stopped "
    "(a StoreLoader that was shut down is rebuilt from its state_dict())"
)
_LIVE: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
_AT_EXIT = False


def _shutdown_live() -> None:
    for pool in list(_LIVE):
        pool._shutdown(polite=False)


def _watch(pool: WorkerPool) -> None:
    """Shut ``pool`` down at exit, before ``multiprocessing``'s handler (atexit runs in
    reverse order of registration, and that one was registered when it was imported)."""
    global _AT_EXIT
    if not _AT_EXIT:
        atexit.register(_shutdown_live)
        _AT_EXIT = True
    _LIVE.add(pool)


class WorkerPool:
    """``num_workers`` processes with ordered results; see the module docstring.

    One thread drives a pool. Two styles, not to be mixed on one pool: ``send(w, task)`` /
    ``recv(w)`` address worker ``w`` (results of one worker come back in the order sent), and
    ``submit(task)`` / ``result()`` spread tasks round-robin and return results in submission
    order. ``ring`` is the number of shared-memory slots per worker (0: results travel
    through the pipe only); keep it above the results a worker may have outstanding.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        timeout: float | None = 300.0,
        start_method: str | None = None,
        name: str = "meshfeed-worker",
        grace: float = 0.5,
        ring: int = 4,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1 (got {num_workers=!r})")
        if timeout is not None and not timeout > 0:
            raise ValueError(
                f"timeout must be positive seconds, or None / math.inf for no limit "
                f"(got {timeout=!r})"
            )
        if not 0 < grace <= 1:
            raise ValueError(f"grace must be in (0, 1] seconds (got {grace=!r})")
        if start_method is not None and start_method not in mp.get_all_start_methods():
            raise ValueError(
                f"start_method={start_method!r} is not available here; use one of "
                f"{mp.get_all_start_methods()}"
            )
        if not isinstance(ring, int) or ring < 0:
            raise ValueError(f"ring must be an int >= 0 (got {ring=!r})")
        self.num_workers = num_workers
        self.timeout = math.inf if timeout is None else float(timeout)
        self.start_method = start_method or default_start_method()
        self.name, self.grace, self.ring = name, grace, ring
        self._state: dict[str, Any] = {}
        self._finalizer: weakref.finalize | None = None
        self._pending: list[deque[float]] = []
        self._free_at: list[float] = []
        self._order: deque[int] = deque()
        self._next = 0
        self._ready: list[deque[tuple[bool, Any]]] = []  # received, not yet returned, per worker
        self._closed = False  # shutdown() was called and start() not since: calls are refused
        # Held while a reply is read from a worker's pipe and slots: a shutdown from another
        # thread waits for that read to end, never closes the slots under it.
        self._lock = threading.RLock()
        #: Seconds a worker spends per task: what a caller sizes its messages by (cheap tasks
        #: travel several to a message). It follows a cheaper reply at once and a dearer one
        #: as a moving average: a worker's first tasks run cold (first touch of the data, first
        #: calls), and averaging them in would keep messages small for hundreds of tasks.
        self.task_seconds = 0.0
        #: Result bytes per task (of the last reply that carried any): a message of n tasks
        #: finds slots of n times this waiting, instead of growing them through the pipe.
        self.task_bytes = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return bool(self._state.get("procs"))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._state.get("procs", [])]

    def start(self, init: Callable[..., Callable[[Any], Any]], *args: Any) -> None:
        """Start the workers; each runs ``init(worker_id, num_workers, *args)`` -> handler.

        A no-op when already started.
        """
        self._closed = False
        if self.started:
            return
        ctx: Any = mp.get_context(self.start_method)
        # Workers must share this process's tracker of shared memory: one they started
        # themselves would unlink the slots when they die.
        resource_tracker.ensure_running()
        state: dict[str, Any] = {
            key: [] for key in ("procs", "tasks", "results", "readers", "pollers")
        }
        state["grace"] = self.grace
        self._state = state
        self._finalizer = weakref.finalize(self, _shutdown_resources, state)
        _watch(self)
        parent = Parent.here(self.start_method)
        for w in range(self.num_workers):
            task_recv, task_send = ctx.Pipe(duplex=False)
            result_recv, result_send = ctx.Pipe(duplex=False)
            # A forked worker holds copies of this process's pipe ends (not pickled: fork).
            borrowed = (
                (*state["tasks"], *state["results"], task_send, result_recv)
                if self.start_method == "fork"
                else ()
            )
            proc = ctx.Process(
                target=_worker_main,
                args=(w, self.num_workers, init, args, task_recv, result_send, parent, borrowed),
                name=f"{self.name}-{w}",
                daemon=True,
            )
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                for conn in (task_recv, task_send, result_recv, result_send):
                    conn.close()
                self.shutdown()
                raise TypeError(
                    f"could not send the worker function {init!r} or its arguments to a "
                    f"{self.start_method!r} worker ({type(exc).__name__}: {exc}); spawned "
                    "workers need importable functions: define collate_fn / transform / "
                    "dataset classes at module top level (not lambdas or local functions), "
                    "or use start_method='fork'"
                ) from exc
            task_recv.close()
            result_send.close()
            state["procs"].append(proc)
            state["tasks"].append(task_send)
            state["results"].append(result_recv)
            state["readers"].append(SlotReader(self.ring))
            poller = select.poll()
            poller.register(result_recv.fileno(), select.POLLIN)
            poller.register(proc.sentinel, select.POLLIN)
            state["pollers"].append(poller)
        self._pending = [deque() for _ in range(self.num_workers)]
        self._free_at = [time.monotonic()] * self.num_workers
        self._ready = [deque() for _ in range(self.num_workers)]
        self._order.clear()
        self._next = 0

    def shutdown(self) -> None:
        """Stop every worker (stop message, SIGTERM, SIGKILL) and join them; idempotent.
        A call waiting for a result meanwhile (another thread) or made later, before the
        next :meth:`start`, raises :class:`PoolClosed`."""
        self._closed = True
        self._shutdown(polite=True)

    def _shutdown(self, *, polite: bool) -> None:
        with self._lock:
            _LIVE.discard(self)
            self._state["polite"] = polite
            if self._finalizer is not None:
                self._finalizer()  # runs _shutdown_resources once
                self._finalizer = None
            self._state = {}
            self._pending, self._free_at, self._ready = [], [], []
            self._order.clear()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ per-worker style
    def pending(self, w: int) -> int:
        """Results of worker ``w`` sent for and not yet received."""
        return len(self._pending[w]) if self._pending else 0

    def send(self, w: int, task: Any) -> None:
        """Send ``task`` to worker ``w`` (tasks should be small: indices, not data)."""
        self.send_many(w, [task])

    def send_many(self, w: int, tasks: list[Any]) -> None:
        """Send ``tasks`` to worker ``w`` in one message; it answers them in one reply (one
        pipe message and one copy for all), and :meth:`recv` returns them one by one."""
        if not tasks:
            return
        if not self.started:
            self._check_open()
            raise RuntimeError(f"{self.name}: send() before start(); call start(init) first")
        conn = self._state["tasks"][w]
        reader = self._state["readers"][w]
        reader.reserve(len(tasks) * self.task_bytes)
        frees, added = reader.take_updates()
        # A full pipe means the worker reads no more tasks (stopped or stuck): bounded wait.
        limit = None if math.isinf(self.timeout) else self.timeout
        try:
            if not _writable(conn, limit):
                self._fail_timeout(w)
            conn.send_bytes(pickle.dumps((tasks, frees, added), 5))
        except (OSError, ValueError):
            self._fail_died(w)
        now = time.monotonic()
        self._pending[w].extend([now] * len(tasks))

    def recv(self, w: int) -> Any:
        """The oldest outstanding result of worker ``w`` (raises what the handler raised)."""
        self._check_open()
        if not self.pending(w):
            raise RuntimeError(f"{self.name}: recv({w}) with no task outstanding for it")
        if not self._ready[w]:
            self._receive(w)
        ok, value = self._ready[w].popleft()
        self._pending[w].popleft()
        if not ok:
            exc_type, text, tb = value
            _reraise(exc_type, text, f"(raised in {self.name} {w}; worker traceback:)\n{tb}")
        return value

    def _receive(self, w: int) -> None:
        """Wait (bounded) for worker ``w``'s next reply and queue its results. A
        :meth:`shutdown` from another thread meanwhile ends the wait with :class:`PoolClosed`
        (the pool's state is gone: nothing here reads it again)."""
        state = self._state
        conn: Connection = state["results"][w]
        poller, result_fd = state["pollers"][w], conn.fileno()
        deadline = max(self._pending[w][0], self._free_at[w]) + self.timeout
        ready = poller.poll(0)  # one persistent poll set: no selector built per result
        while not any(fd == result_fd for fd, _ in ready):
            if ready:  # only the sentinel: the worker is gone (read what it sent first)
                if not conn.poll(0.05):
                    self._check_same(state)
                    self._fail_died(w)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self._check_same(state)
                self._fail_timeout(w)
            ready = poller.poll(None if math.isinf(left) else math.ceil(left * 1000))
            self._check_same(state)
        with self._lock:
            self._check_same(state)
            try:
                header = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._fail_died(w)
            self._free_at[w] = time.monotonic()
            if header[0] == "error":  # init failed, or a reply could not be encoded
                _, exc_type, text, tb = header
                self._pending[w].popleft()
                _reraise(exc_type, text, f"(raised in {self.name} {w}; worker traceback:)\n{tb}")
            entries, seconds = state["readers"][w].decode(header)
        self._measure(seconds, header[4], len(entries))
        self._ready[w].extend(entries)

    def _measure(self, seconds: float, nbytes: int, tasks: int) -> None:
        per_task = seconds / max(1, tasks)
        if not self.task_seconds or per_task < self.task_seconds:
            self.task_seconds = per_task
        else:
            self.task_seconds = 0.8 * self.task_seconds + 0.2 * per_task
        if nbytes:
            self.task_bytes = -(-nbytes // max(1, tasks))

    def ready(self, w: int, timeout: float = 0.0) -> bool:
        """Whether :meth:`recv` of worker ``w`` would return without waiting (a result is
        there, or the worker is gone), after waiting at most ``timeout`` seconds; receives
        nothing and never fails the pool (a caller's own shorter deadline)."""
        if not self.pending(w):
            return False
        if self._ready[w]:
            return True
        poller = self._state["pollers"][w]
        return bool(poller.poll(max(0, math.ceil(timeout * 1000))))

    def wait_any(self, workers: list[int], timeout: float) -> list[int]:
        """The workers among ``workers`` (each with a task outstanding) whose :meth:`recv`
        would return without waiting, after one wait of at most ``timeout`` seconds on all of
        their result pipes and sentinels together; ``[]`` when none is ready by then. Receives
        nothing and never fails the pool: the caller decides what a late worker means."""
        workers = [w for w in workers if self.pending(w)]
        if not workers:
            return []
        done = [w for w in workers if self._ready[w]]
        if done:
            return done
        poller = select.poll()
        owner: dict[int, int] = {}
        for w in workers:
            for fd in (self._state["results"][w].fileno(), self._state["procs"][w].sentinel):
                poller.register(fd, select.POLLIN)
                owner[fd] = w
        events = poller.poll(max(0, math.ceil(timeout * 1000)))
        return sorted({owner[fd] for fd, _ in events})

    # ------------------------------------------------------------------ ordered style
    def submit(self, task: Any) -> None:
        """Send ``task`` to the next worker round-robin; :meth:`result` returns in this order."""
        self.submit_many([task])

    def submit_many(self, tasks: list[Any]) -> None:
        """Submit ``tasks`` as :meth:`submit` would one by one (task ``j`` to the next worker
        round-robin), but each worker's share in one message."""
        k, first = self.num_workers, self._next
        for j in range(min(k, len(tasks))):  # tasks j, j + k, ... go to worker (first + j) % k
            self.send_many((first + j) % k, tasks[j::k])
        self._order.extend((first + j) % k for j in range(len(tasks)))
        self._next = (first + len(tasks)) % k

    def result(self) -> Any:
        """The result of the oldest submitted task not yet returned."""
        self._check_open()
        if not self._order:
            raise RuntimeError(f"{self.name}: result() with nothing submitted")
        return self.recv(self._order.popleft())

    def outstanding(self) -> int:
        """Submitted tasks whose results were not returned yet."""
        return len(self._order)

    def map(self, tasks: Iterable[Any], *, window: int) -> Iterator[Any]:
        """Results of ``tasks`` in order, with at most ``window`` tasks in flight."""
        source = iter(tasks)
        for task in source:
            self.submit(task)
            if self.outstanding() >= window:
                break
        for task in source:
            yield self.result()
            self.submit(task)
        while self.outstanding():
            yield self.result()

    # ------------------------------------------------------------------ failures
    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosed(
                f"{self.name} was shut down (shutdown(), e.g. the loader's, or its with-block "
                f"ended) while its results were awaited; {_AFTER_CLOSE}"
            )

    def _check_same(self, state: dict[str, Any]) -> None:
        """Raise if the pool was shut down (by another thread) since ``state`` was read."""
        if self._state is not state or "readers" not in state:
            raise PoolClosed(
                f"{self.name} was shut down while a result was awaited (shutdown() from "
                f"another thread); {_AFTER_CLOSE}"
            )

    def _fail_timeout(self, w: int) -> None:
        pid = self._state["procs"][w].pid
        self._shutdown(polite=False)
        raise WorkerTimeout(
            f"{self.name} {w} (pid {pid}) produced nothing within timeout={self.timeout}s; "
            "it may be stuck on I/O or stopped. Raise timeout= if one task legitimately "
            "takes longer",
            worker=w,
            pid=pid,
            timeout=self.timeout,
        )

    def _fail_died(self, w: int) -> Any:
        proc = self._state["procs"][w]
        proc.join(timeout=1.0)
        pid, code = proc.pid, proc.exitcode
        self._shutdown(polite=False)
        raise WorkerDied(
            f"{self.name} {w} (pid {pid}) exited unexpectedly with {exit_reason(code)}",
            worker=w,
            pid=pid,
            exitcode=code,
        )
