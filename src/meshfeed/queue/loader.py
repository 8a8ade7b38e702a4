"""StoreLoader: a per-rank iterator over a :class:`SampleStore` for a training loop.

The mesh is touched here only: the loader turns ``(mesh, rank)`` into a data rank and a replica
group, and reads with a :class:`RankAwareSampler` (a given ``SequentialSampler`` or
``GroupSampler`` is wrapped in one for this rank; any other sampler must be rank-aware for this
rank of this mesh, else it is refused: see :func:`~meshfeed.queue.samplers.mesh_sampler`), so
tensor / context / pipeline peers of one data rank receive identical batches, data ranks
receive disjoint ones, and all data ranks end at the same step, always (see the sampler for
the last-round rule). Batch ``j`` of the loader is the store's shared key ``j``; batches are returned in order
of ``j``.

Arguments, defaults, checks and lifecycle are those of :class:`meshfeed.DataLoader`
(``batch_size``, ``mesh``, ``rank``, ``num_workers``, ``prefetch``, ``timeout``,
``collate_fn``; ``shutdown()`` and ``with``), checked by the same
:func:`meshfeed.options.check_loader_arguments`. ``collate_fn`` is the last step before the
trainer, as in ``DataLoader``; its input is the :class:`Batch` the store already assembled
(columns stacked), not a list of samples, since the store hands out batches, not items.

Prefetching and worker processes. ``prefetch=P`` (>= 1) keeps up to ``P`` batches requested,
the one being returned included: ``prefetch=1`` with ``num_workers=0`` fetches synchronously
in the caller's thread (nothing in flight when a checkpoint is taken); the default 2 fetches
one batch ahead. ``num_workers=K`` starts ``K`` worker processes:

- Ray backend (a *named* store): each worker process connects to the store
  (``SampleStore.connect``) and fetches whole batches itself (``get`` of key ``j``, then
  ``collate_fn``); the store's per-key planning makes every batch go to exactly one request, so
  no sample is delivered twice, whichever worker fetched it.
- Embedded backend: the store lives in this process's memory, which worker processes cannot
  share; so this process does every ``get`` (in background threads) and the worker processes
  only run ``collate_fn`` on the fetched batches. ``num_workers > 0`` therefore needs a
  ``collate_fn``.

Replica peers must use the same ``batch_size``, ``prefetch`` and sampler (the store refuses a
peer whose batch_size or prefetch differs): the batches requested ahead decide at which step a
peer sees the end of the stream.

A ``collate_fn`` that raises is retried on the batch already fetched (it is consumed in the
store; fetching again would plan another batch and lose this one); if it keeps failing,
:class:`CollateError` names the batch, which stays first in line and in ``state_dict()``.

Worker processes run on :class:`meshfeed.runtime.WorkerPool` (Ray: spawned, each connects to
the store once; embedded: the platform's default start method, fork where it exists). A worker
that dies, or produces nothing within ``timeout`` (stuck, or stopped), raises
:class:`~meshfeed.runtime.WorkerError` within about ``timeout`` + 1 s with every worker stopped;
iterating the loader again starts fresh workers and continues with the batch that failed
(embedded: collated again from the batch already fetched; Ray: requested again by its index).

``shutdown()`` cancels the requests still waiting in the store (threads and worker processes
blocked without a deadline wake at once, consuming nothing) and stops the workers.

Recovery. Every request names its batch index, so the store plans it once and keeps the plan:
a retried request gets the same batch, and a loader restored from ``state_dict()`` asks again
for the batches it had not returned. Such shared plans take no lease (a store's
``lease_timeout`` applies to direct ``get`` calls, whose consumer may die holding a batch).

Checkpoints. ``state_dict()`` is the state as of the last batch returned: it waits for the
batches in flight (at most ``timeout`` seconds, then ``TimeoutError``) and records the ids of those fetched but not returned; after
``load_state_dict`` they are re-delivered first (read again from the store, not re-planned).
Take ``state_dict()`` of every loader, then save the store, before the next batch; a store with
``tasks=`` keeps such fetched-ahead samples until the loader returned them.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import pickle
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from meshfeed.lifecycle import Lifecycle
from meshfeed.mesh import place
from meshfeed.options import check_loader_arguments
from meshfeed.queue.core import PartitionClosed
from meshfeed.queue.samplers import Sampler, mesh_sampler
from meshfeed.queue.store import Batch, SampleStore
from meshfeed.queue.wakeups import check_timeout
from meshfeed.runtime import WorkerDied, WorkerError, WorkerPool, WorkerTimeout
from meshfeed.state import envelope, open_envelope

KIND = "store_loader"
VERSION = 3  # 3: the one state envelope (kind + version); prefetch counts the batch returned
_MARGIN = 0.25  # Ray workers: the store's own TimeoutError comes first, then the pool's


class _Late(Exception):
    """``state_dict()``'s own deadline passed while a batch was still on its way."""


class CollateError(RuntimeError):
    """``collate_fn`` kept failing on a fetched batch; ``ids`` names its samples.

    The batch is not lost: the loader keeps it, the next ``next()`` retries ``collate_fn`` on
    it, and ``state_dict()`` records it so a restored loader re-delivers it.
    """

    def __init__(self, message: str, *, index: int, ids: list[Any]) -> None:
        super().__init__(message)
        self.index, self.ids = index, ids


@dataclass(slots=True)
class _Got:
    """One request's outcome: ``ids`` (``None``: the stream ended) and the transformed
    ``item``; while ``collate_fn`` has not succeeded, the raw ``batch`` and the ``error``, so
    only ``collate_fn`` is retried (the samples are already consumed in the store)."""

    ids: list[Any] | None
    item: Any = None
    batch: Any = None
    error: BaseException | None = None
    raised: bool = False  # the failure was reported (CollateError): retry it afresh


@dataclass(frozen=True, slots=True)
class _Spec:
    """One loader's request, picklable for worker processes."""

    task: str
    fields: tuple[str, ...]
    batch_size: int
    partition: str
    sampler: Sampler
    timeout: float | None
    hold: bool
    prefetch: int  # replica peers must share it (the store checks; see _fetch)
    token: str  # the loader's requests, cancelled together by shutdown()


def _fetch(store: SampleStore, spec: _Spec, index: int) -> Batch | None:
    try:
        return store.get(
            spec.task,
            spec.fields,
            spec.batch_size,
            spec.partition,
            spec.sampler,
            spec.timeout,
            hold=spec.hold,
            token=spec.token,
            batch_index=index,
            prefetch=spec.prefetch,
        )
    except PartitionClosed:
        return None


def _apply(transform: Callable[[Batch], Any] | None, batch: Batch) -> _Got:
    """``transform(batch)``; a failure keeps the raw batch for a retry of the transform alone."""
    if transform is None:
        return _Got(batch.ids, batch)
    try:
        return _Got(batch.ids, transform(batch))
    except Exception as exc:
        return _Got(batch.ids, batch=batch, error=exc)


def _portable(got: _Got) -> _Got:
    """``got`` with an error that can travel back to the main process (else its traceback)."""
    if got.error is not None:
        try:
            pickle.dumps(got.error)
        except Exception:
            got.error = RuntimeError("".join(traceback.format_exception(got.error)))
    return got


def _start_worker(
    worker: int,
    num_workers: int,
    address: str | None,
    name: str | None,
    spec: _Spec,
    collate_fn: Callable[[Batch], Any] | None,
) -> Callable[[tuple[str, Any]], _Got]:
    """A store-loader worker's handler: ``("fetch", index)`` (Ray: this worker fetches batch
    ``index`` from the named store it connected to here, then collates it) or ``("collate",
    batch)``. A failing ``collate_fn`` returns the raw batch with the error, so only the
    collate step is retried; a failing fetch raises (the loader requests the batch again)."""
    store: SampleStore | None = None
    if address is not None and name is not None:
        import ray

        ray.init(address=address, log_to_driver=False, configure_logging=False)
        store = SampleStore.connect(name)

    def handle(task: tuple[str, Any]) -> _Got:
        kind, arg = task
        if kind == "fetch":
            if store is None:
                raise RuntimeError("store loader worker asked to fetch without a store")
            batch = _fetch(store, spec, arg)
            if batch is None:
                return _Got(None)
        else:
            batch = arg
        return _portable(_apply(collate_fn, batch))

    return handle


@dataclass(slots=True, eq=False)
class _Entry:
    """One requested batch on its way to the trainer. Exactly one of these is in progress:
    ``got`` (known outcome), ``fetch`` (a thread fetching it here), ``lazy`` (a re-delivery
    read on first use), ``worker`` (a task for it is outstanding on that worker), ``failed``
    (the request failed: raised once, then requested again); with none of them, it is to be
    requested (``batch`` set: fetched, to be collated in a worker)."""

    index: int
    got: _Got | None = None
    fetch: cf.Future[Any] | None = None
    lazy: Callable[[], Batch | None] | None = None
    batch: Batch | None = None
    worker: int | None = None
    failed: BaseException | None = None


class StoreLoader(Lifecycle):
    """Iterate batches of ``fields`` for ``task`` from ``partition`` of ``store``, as global
    ``rank`` of ``mesh`` (a :class:`DataMesh`, ``DeviceMesh``, dict of axis sizes, or
    ``None`` for the torchrun world; ``device_mesh=`` is the same argument under torch's
    name); see the module docstring for workers and checkpoints.

    ``timeout`` (seconds, default 300 as ``DataLoader``; ``math.inf``: no limit) bounds each
    wait for a batch and ``state_dict()``'s wait for batches in flight (``TimeoutError``; the
    loader stays usable). ``collate_fn``: a picklable function of a :class:`Batch` applied to
    every batch (in worker processes when ``num_workers > 0``), retried on the same fetched
    batch ``collate_retries`` more times, never by fetching again; if it keeps failing,
    :class:`CollateError` names the batch's ids and the loader keeps the batch. Replica peers
    must use the same ``batch_size``, ``prefetch`` and sampler (the store checks
    ``batch_size`` and ``prefetch``). ``shutdown()`` (or leaving a ``with`` block) cancels
    waiting requests and stops workers.

    >>> store = SampleStore()
    >>> _ = store.put("p", {"x": [1, 2, 3, 4]}); store.close("p")
    >>> with StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=2,
    ...                  mesh={"dp": 1}, rank=0) as loader:
    ...     [b["x"] for b in loader]
    [[1, 2], [3, 4]]
    """

    #: How long ``state_dict()`` waits for batches in flight when ``timeout`` is unlimited.
    STATE_WAIT: ClassVar[float] = 60.0

    def __init__(
        self,
        store: SampleStore,
        *,
        task: str,
        fields: Sequence[str],
        partition: str,
        batch_size: int,
        mesh: Any = None,
        device_mesh: Any = None,
        rank: int | None = None,
        sampler: Sampler | None = None,
        num_workers: int = 0,
        prefetch: int = 2,
        collate_fn: Callable[[Batch], Any] | None = None,
        collate_retries: int = 2,
        timeout: float = 300.0,
    ) -> None:
        if not isinstance(store, SampleStore):
            raise TypeError(
                f"store must be a SampleStore (got {type(store).__name__}); build the store "
                "with meshfeed.queue.SampleStore and pass it first"
            )
        check_loader_arguments(
            batch_size=batch_size,
            seed=0,  # the store decides the order: no seed, no retries of samples
            num_workers=num_workers,
            prefetch=prefetch,
            timeout=timeout,
            on_error="raise",
            max_retries=0,
        )
        if (
            isinstance(collate_retries, bool)
            or not isinstance(collate_retries, int)
            or collate_retries < 0
        ):
            raise ValueError(f"collate_retries must be an int >= 0 (got {collate_retries=!r})")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None (got {collate_fn=!r})")
        if not isinstance(task, str) or not task:
            raise TypeError(f"task must be a non-empty string (got {task=!r})")
        if not isinstance(partition, str) or not partition:
            raise TypeError(f"partition must be a non-empty string (got {partition=!r})")
        if isinstance(fields, str) or not isinstance(fields, Sequence) or not fields:
            raise TypeError(f"fields must be a non-empty list of field names (got {fields=!r})")
        if num_workers and store.backend == "embedded" and collate_fn is None:
            raise ValueError(
                "num_workers > 0 with the embedded store only runs `collate_fn` in worker "
                "processes (the store cannot be shared with them); pass collate_fn=..., or "
                "use num_workers=0 with prefetch=N for fetching ahead in threads"
            )
        if num_workers and store.backend == "ray" and store.name is None:
            raise ValueError(
                "num_workers > 0 with a Ray store needs a named store so worker processes "
                "can connect; create it with SampleStore('ray', name=...)"
            )
        self.mesh, self.rank = place(mesh, device_mesh, rank)
        self.data_rank = self.mesh.data_rank(self.rank)
        self.replica_group = self.mesh.replica_group(self.rank)
        self.sampler = mesh_sampler(sampler, self.mesh, self.rank)
        self.store, self.task, self.fields = store, task, list(fields)
        self.batch_size, self.partition, self.timeout = batch_size, partition, timeout
        self.num_workers, self.prefetch, self.collate_fn = num_workers, prefetch, collate_fn
        self.collate_retries = collate_retries
        wait = check_timeout(timeout)
        self._ahead_max = prefetch if (prefetch > 1 or num_workers) else 0
        # Holding matters only when samples can be evicted while fetched but not returned:
        # fetched ahead, or kept after a failed collate_fn.
        hold = store.options.tasks is not None and (bool(self._ahead_max) or collate_fn is not None)
        self._spec = _Spec(
            task, tuple(fields), batch_size, partition, self.sampler, wait, hold, prefetch,
            uuid.uuid4().hex,
        )  # fmt: skip
        self._next = 0  # the next batch index to request
        self._ended = False  # a request found the stream ended: request nothing more
        self._shut = False
        self._ahead: deque[_Entry] = deque()  # in index order
        self._threads: cf.ThreadPoolExecutor | None = None
        self._pool: WorkerPool | None = None
        if num_workers:
            self._pool = WorkerPool(
                num_workers,
                # Ray: a fetch waits in the store up to `timeout` and raises TimeoutError
                # there; the pool's own limit (a stuck or stopped worker) comes just after.
                timeout=None if wait is None else wait + (_MARGIN if store.backend == "ray" else 0),
                # Ray: spawn (fork is unsafe under Ray; each worker connects to the store,
                # which counts against the first batch's timeout). Embedded: the platform's
                # default, fork where it exists; the workers start before the fetch threads.
                start_method="spawn" if store.backend == "ray" else None,
                name="meshfeed-store-worker",
                grace=0.25,
                ring=prefetch + 2,
            )
        self._sent: list[deque[_Entry]] = [deque() for _ in range(num_workers)]
        self._turn = 0  # the worker the next task goes to

    # ----------------------------------------------------------------- fetching
    def _thread_job(self, index: int) -> _Got | Batch | None:
        """Fetch here (in a thread); ``collate_fn`` too unless worker processes run it."""
        batch = _fetch(self.store, self._spec, index)
        if batch is None or self._pool is not None:
            return batch
        return _apply(self.collate_fn, batch)

    def _start_pool(self) -> WorkerPool:
        """The worker pool, started on first use or again after a worker failed."""
        pool = self._pool
        assert pool is not None
        if not pool.started:
            address = None
            if self.store.backend == "ray":
                import ray

                address = ray.get_runtime_context().gcs_address
            pool.start(_start_worker, address, self.store.name, self._spec, self.collate_fn)
            self._sent = [deque() for _ in range(self.num_workers)]
        return pool

    def _send(self, entry: _Entry, task: tuple[str, Any]) -> None:
        pool = self._start_pool()
        w = self._turn
        self._turn = (w + 1) % self.num_workers
        pool.send(w, task)
        entry.worker = w
        self._sent[w].append(entry)

    def _request(self, entry: _Entry) -> None:
        """Start what ``entry`` needs next: its fetch, or the collate of its fetched batch."""
        if entry.batch is not None:
            if self._pool is None:
                entry.got = _apply(self.collate_fn, entry.batch)
            else:
                self._send(entry, ("collate", entry.batch))
        elif self._pool is not None and self.store.backend == "ray":
            self._send(entry, ("fetch", entry.index))
        else:
            if self._threads is None:  # requests wait in the store, so one thread per request
                self._threads = cf.ThreadPoolExecutor(self._ahead_max, "meshfeed-loader")
            entry.fetch = self._threads.submit(self._thread_job, entry.index)

    def _fetched(self, entry: _Entry, result: _Got | Batch | None) -> None:
        if isinstance(result, _Got):
            entry.got = result
        elif result is None:
            entry.got = _Got(None)
        else:
            entry.batch = result
            self._request(entry)

    def _recv(self, w: int) -> None:
        """Receive worker ``w``'s oldest result into the entry it belongs to."""
        assert self._pool is not None
        entry = self._sent[w][0]
        try:
            got = self._pool.recv(w)
        except WorkerError:
            raise
        except Exception as exc:  # the fetch failed in the worker (or the result could not travel)
            if entry.batch is not None:
                entry.got = _Got(entry.batch.ids, batch=entry.batch, error=exc)
            else:
                entry.failed = exc
        else:
            entry.got = got
        self._sent[w].popleft()
        entry.worker = None

    def _progress(self) -> None:
        """Without waiting: hand the batches fetched so far to the workers. Results are taken
        only when their batch is next, so a worker failing on a later batch never costs one
        already made."""
        for entry in self._ahead:
            if entry.fetch is not None and entry.fetch.done():
                fut, entry.fetch = entry.fetch, None
                try:
                    self._fetched(entry, fut.result())
                except Exception as exc:
                    entry.failed = exc

    def _wait(self, entry: _Entry, deadline: float | None = None, *, ids: bool = False) -> _Got:
        """Drive ``entry`` until its outcome is known (``ids``: until its sample ids are);
        ``deadline`` (``time.monotonic()``) raises :class:`_Late` past it, changing nothing."""
        while entry.got is None and not (ids and entry.batch is not None):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if entry.failed is not None:  # raised once; the same batch is requested again
                exc, entry.failed = entry.failed, None
                self._request(entry)
                raise exc
            if entry.fetch is not None:
                try:
                    result = entry.fetch.result(left)
                except cf.TimeoutError:
                    raise _Late from None
                except Exception as exc:
                    entry.fetch, entry.failed = None, exc
                    continue
                entry.fetch = None
                self._fetched(entry, result)
            elif entry.lazy is not None:
                fn, entry.lazy = entry.lazy, None
                self._fetched(entry, fn())
            elif entry.worker is not None:
                assert self._pool is not None
                if left is not None and not self._pool.ready(entry.worker, left):
                    raise _Late
                self._recv(entry.worker)
            else:
                self._request(entry)
        if entry.got is None:
            assert entry.batch is not None
            return _Got(entry.batch.ids)
        return entry.got

    def _lost(self, error: WorkerError) -> WorkerError:
        """The pool stopped after a worker died or stalled: what was sent to it is sent again
        (to fresh workers) when next needed; the error to raise, saying so."""
        for entry in self._ahead:
            entry.worker = None
        self._sent = [deque() for _ in range(self.num_workers)]
        head = self._ahead[0].index if self._ahead else self._next
        if isinstance(error, WorkerTimeout):
            what = f"produced nothing within timeout={error.timeout}s (stuck or stopped)"
        elif isinstance(error, WorkerDied):
            what = f"exited with exit code {error.exitcode} (out of memory, or killed)"
        else:
            what = f"failed ({error})"
        return WorkerError(
            f"store loader worker {getattr(error, 'worker', '?')} (pid "
            f"{getattr(error, 'pid', '?')}) of task {self.task!r} {what}; its workers were "
            f"stopped. Iterating the loader again starts fresh workers and continues from batch "
            f"{head} (nothing is lost or repeated); raise timeout= if a batch legitimately "
            "takes longer"
        )

    def _fill(self) -> None:
        while not self._ended and len(self._ahead) < self._ahead_max:
            entry = _Entry(self._next)
            self._ahead.append(entry)
            self._next += 1
            self._request(entry)

    def _retry(self, entry: _Entry, got: _Got) -> Any:
        """Retry only ``collate_fn`` on a fetched batch; :class:`CollateError` if it keeps
        failing, with the batch left at the head of the queue (``collate_retries + 1`` more
        attempts by the next ``next()``; recorded by ``state_dict()``)."""
        ids = got.ids
        assert ids is not None
        # A fresh failure had its first attempt already; a reported one gets all attempts.
        for _ in range(self.collate_retries + (1 if got.raised else 0)):
            attempt = _Entry(entry.index, batch=got.batch)
            got = self._wait(attempt)
            if got.error is None:
                return got.item
        got.raised = True
        entry.got = got
        shown = f"{ids[:20]} ... ({len(ids)} samples)" if len(ids) > 20 else f"{ids}"
        raise CollateError(
            f"collate_fn failed {self.collate_retries + 1} times on batch {entry.index} of "
            f"task {self.task!r} (sample ids {shown}): {got.error!r}. The batch is kept: "
            "next() retries collate_fn on it and state_dict() records it, so a restored loader "
            "re-delivers it; fix collate_fn (or the samples) and call next() again",
            index=entry.index,
            ids=list(ids),
        ) from got.error

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._shut:
            raise RuntimeError(
                f"this StoreLoader (task {self.task!r}) was shut down; build a new one (from "
                "its state_dict() to continue where it stopped)"
            )
        try:
            return self._next_item()
        except WorkerError as error:
            if self._pool is None or self._pool.started:
                raise  # not a failure of the pool (a collate_fn raising WorkerError itself)
            raise self._lost(error) from None

    def _next_item(self) -> Any:
        while True:
            if not self._ahead_max and not self._ahead:  # synchronous
                if self._ended:
                    raise StopIteration
                result = self._thread_job(self._next)
                if not isinstance(result, _Got) or result.ids is None:  # no workers here
                    self._ended = True
                    raise StopIteration
                self._ahead.append(_Entry(self._next, got=result))
                self._next += 1
            if self._pool is not None and not self._ended:
                self._start_pool()  # before the fetch threads exist (fork)
            self._fill()
            self._progress()
            if not self._ahead:
                self._stop_workers()
                raise StopIteration
            entry = self._ahead[0]
            got = self._wait(entry)
            if got.ids is None:
                # Every later request also ends; those already in flight may still hold
                # batches planned before the end, so they are drained, not dropped.
                self._ahead.popleft()
                self._ended = True
                continue
            item = got.item if got.error is None else self._retry(entry, got)
            self._ahead.popleft()
            if self._spec.hold:
                self.store.release(self.partition, got.ids)
            return item

    def shutdown(self) -> None:
        """Cancel the requests waiting in the store (they consume nothing) and stop worker
        processes and threads; batches fetched ahead stay held in the store until it is
        restored from a checkpoint or they are released. The loader cannot be iterated again.
        Idempotent."""
        if self._shut:
            return
        self._shut = True
        if self._ahead_max:
            # The store may be gone already (a killed Ray actor): nothing waits in it then.
            with contextlib.suppress(Exception):
                self.store.cancel(self._spec.token)
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()  # stop message, SIGTERM, SIGKILL: joins every worker
            for entry in self._ahead:
                entry.worker = None
            self._sent = [deque() for _ in range(self.num_workers)]
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The state as of the last batch returned.

        Waits for the batches in flight, at most ``timeout`` seconds in all (``STATE_WAIT``,
        60 s, when the timeout is unlimited), then raises ``TimeoutError``: with ``prefetch > 0``
        the state must name the batches fetched ahead, and a request waiting for producers
        that wait for the trainer (an RL weight sync) would otherwise block forever. The
        loader is unchanged by the error; take the state once producers can run, or use
        ``prefetch=0``.
        """
        wait = self.STATE_WAIT if self._spec.timeout is None else self._spec.timeout
        deadline = time.monotonic() + wait
        pending = []
        try:
            for entry in self._ahead:
                try:
                    got = self._wait(entry, deadline, ids=True)
                except _Late:
                    raise TimeoutError(
                        f"state_dict() waited {wait}s for batch {entry.index} of task "
                        f"{self.task!r}, still being fetched (prefetch={self.prefetch}); the "
                        "state must name the batches fetched ahead. If producers wait for the "
                        "trainer (e.g. a weight sync), take state_dict() once they can run "
                        "again, or use prefetch=1; the loader is unchanged and usable"
                    ) from None
                pending.append([entry.index, got.ids])
        except WorkerError as error:
            if self._pool is None or self._pool.started:
                raise
            raise self._lost(error) from None
        return envelope(
            KIND,
            VERSION,
            task=self.task,
            partition=self.partition,
            data_rank=self.data_rank,
            next=self._next,
            ended=self._ended,
            pending=pending,
        )

    def load_state_dict(self, state: Any) -> None:
        """Continue from ``state``; the store must be restored to the same moment. Every
        field is checked against this loader (task, partition, data rank) and itself
        (pending batches: distinct indices below ``next``, lists of int/str ids)."""
        st = open_envelope(
            state,
            kind=KIND,
            version=VERSION,
            fields={
                "task": str,
                "partition": str,
                "data_rank": int,
                "next": int,
                "ended": bool,
                "pending": list,
            },
            what="StoreLoader state",
        )
        for key in ("task", "partition", "data_rank"):
            if st[key] != getattr(self, key):
                raise ValueError(
                    f"the StoreLoader state is for {key}={st[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; resume with the same configuration"
                )
        pending = st["pending"]
        nxt = st["next"]
        if nxt >= 1 << 53:  # beyond what JSON carries exactly; no stream reaches it
            raise ValueError(
                f"StoreLoader state field 'next' is {nxt}, beyond any real batch count "
                f"(next={nxt}); the checkpoint is corrupted"
            )
        seen: set[int] = set()
        for item in pending:
            ok = (
                isinstance(item, list)
                and len(item) == 2
                and type(item[0]) is int
                and 0 <= item[0] < nxt
                and item[0] not in seen
                and (
                    item[1] is None
                    or (
                        isinstance(item[1], list)
                        and all(type(k) in (int, str) for k in item[1])
                        and len(set(item[1])) == len(item[1])
                    )
                )
            )
            if not ok:
                raise ValueError(
                    f"StoreLoader state field 'pending' has a bad entry {item!r:.120} (each is "
                    f"[batch index < next={nxt}, distinct sample ids or None], indices "
                    "distinct); the checkpoint is corrupted"
                )
            seen.add(item[0])
        if len(pending) > max(self._ahead_max, 1):
            raise ValueError(
                f"StoreLoader state names {len(pending)} batches in flight, more than this "
                f"loader keeps (prefetch={self.prefetch}); resume with the same prefetch"
            )
        if self._ahead or self._next or self._shut:
            raise ValueError(
                "load_state_dict must come before iteration starts; build a fresh loader"
            )
        self._next = nxt
        self._ended = st["ended"]
        for index, ids in pending:
            self._ahead.append(_Entry(index, lazy=self._redeliver(ids)))

    def _redeliver(self, ids: list[Any] | None) -> Callable[[], Batch | None]:
        def fn() -> Batch | None:
            if ids is None:
                return None
            return self.store.peek(self.partition, list(ids), self._spec.fields)

        return fn
