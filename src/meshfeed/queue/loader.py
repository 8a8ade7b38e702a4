"""StoreLoader: a per-rank iterator over a :class:`SampleStore` for a training loop.

The mesh is touched here only: the loader turns ``(mesh, rank)`` into a data rank and a replica
group, and (unless given another sampler) reads with a :class:`RankAwareSampler`, so tensor /
context / pipeline peers of one data rank receive identical batches, data ranks receive
disjoint ones, and all data ranks end at the same step (see the sampler for the last-round
rule). Batch ``j`` of the loader is the store's shared key ``j``; batches are returned in order
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

``shutdown()`` cancels the requests still waiting in the store (threads and worker processes
blocked without a deadline wake at once, consuming nothing) and stops the workers.

Checkpoints. ``state_dict()`` is the state as of the last batch returned: it waits for the
batches in flight (at most ``timeout`` seconds, then ``TimeoutError``) and records the ids of those fetched but not returned; after
``load_state_dict`` they are re-delivered first (read again from the store, not re-planned).
Take ``state_dict()`` of every loader, then save the store, before the next batch; a store with
``tasks=`` keeps such fetched-ahead samples until the loader returned them.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import pickle
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

from meshfeed.mesh import DataMesh, default_rank, resolve_mesh
from meshfeed.options import check_loader_arguments
from meshfeed.queue.core import PartitionClosed
from meshfeed.queue.samplers import RankAwareSampler, Sampler
from meshfeed.queue.store import Batch, SampleStore
from meshfeed.queue.wakeups import check_timeout
from meshfeed.state import envelope, open_envelope

KIND = "store_loader"
VERSION = 3  # 3: the one state envelope (kind + version); prefetch counts the batch returned


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
            agree={"prefetch": spec.prefetch},
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


_WORKER_STORE: SampleStore | None = None


def _ray_worker_init(address: str, name: str) -> None:
    import ray

    global _WORKER_STORE
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    _WORKER_STORE = SampleStore.connect(name)


def _ray_worker_fetch(spec: _Spec, index: int, transform: Callable[[Batch], Any] | None) -> _Got:
    if _WORKER_STORE is None:
        raise RuntimeError("store loader worker process started without a store connection")
    batch = _fetch(_WORKER_STORE, spec, index)
    if batch is None:
        return _Got(None)
    got = _apply(transform, batch)
    if got.error is not None:  # the raw batch goes back so the loader can retry the transform
        try:
            pickle.dumps(got.error)
        except Exception:
            got.error = RuntimeError("".join(traceback.format_exception(got.error)))
    return got


class _Known:
    """A result known already or computed on first use (a failed ``collate_fn``'s batch, or one
    restored from a checkpoint); quacks like a future."""

    __slots__ = ("_fn", "_got")

    def __init__(self, fn: Callable[[], _Got] | None = None, got: _Got | None = None) -> None:
        self._fn, self._got = fn, got

    def result(self, timeout: float | None = None) -> _Got:
        if self._got is None:
            assert self._fn is not None
            self._got = self._fn()
        return self._got


class StoreLoader:
    """Iterate batches of ``fields`` for ``task`` from ``partition`` of ``store``, as global
    ``rank`` of ``mesh`` (a :class:`DataMesh`, ``DeviceMesh``, dict of axis sizes, or
    ``None`` for the torchrun world); see the module docstring for workers and checkpoints.

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
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ValueError(f"timeout must be positive seconds (got {timeout=!r})")
        check_timeout(timeout)  # NaN and negatives refused by name, inf means no limit
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
        self.mesh: DataMesh = resolve_mesh(mesh)
        self.rank = default_rank() if rank is None else rank
        self.data_rank = self.mesh.data_rank(self.rank)
        self.replica_group = self.mesh.replica_group(self.rank)
        self.sampler = (
            sampler if sampler is not None else RankAwareSampler.from_mesh(self.mesh, self.rank)
        )
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
        self._ahead: deque[tuple[int, Any]] = deque()  # (index, future) in index order
        self._threads: cf.ThreadPoolExecutor | None = None
        self._procs: cf.ProcessPoolExecutor | None = None

    # ----------------------------------------------------------------- fetching
    def _pools(self) -> None:
        if self._procs is None and self.num_workers:
            ctx = multiprocessing.get_context("spawn")  # fork is unsafe under Ray / threads
            if self.store.backend == "ray":
                import ray

                address = ray.get_runtime_context().gcs_address
                init: Any = (_ray_worker_init, (address, self.store.name))
            else:
                init = (None, ())
            self._procs = cf.ProcessPoolExecutor(
                self.num_workers, mp_context=ctx, initializer=init[0], initargs=init[1]
            )

    def _transform(self, batch: Batch) -> _Got:
        """``collate_fn`` in a worker process if there are any, else here; never raises."""
        procs = self._procs  # a retry may replace a broken pool meanwhile
        if procs is None or self.collate_fn is None:
            return _apply(self.collate_fn, batch)
        try:
            return _Got(batch.ids, procs.submit(self.collate_fn, batch).result())
        except Exception as exc:
            return _Got(batch.ids, batch=batch, error=exc)

    def _local_job(self, index: int) -> _Got:
        """Fetch in this process; ``collate_fn`` in a worker process if there are any."""
        batch = _fetch(self.store, self._spec, index)
        return _Got(None) if batch is None else self._transform(batch)

    def _submit(self, index: int) -> Any:
        self._pools()
        if self.store.backend == "ray" and self._procs is not None:
            return self._procs.submit(_ray_worker_fetch, self._spec, index, self.collate_fn)
        if self._threads is None:  # requests wait in the store, so one thread per request
            self._threads = cf.ThreadPoolExecutor(self._ahead_max, "meshfeed-loader")
        return self._threads.submit(self._local_job, index)

    def _fill(self) -> None:
        while not self._ended and len(self._ahead) < self._ahead_max:
            self._ahead.append((self._next, self._submit(self._next)))
            self._next += 1

    def _retry(self, index: int, got: _Got) -> Any:
        """Retry only ``collate_fn`` on a fetched batch; :class:`CollateError` if it keeps
        failing, with the batch left at the head of the queue (``collate_retries + 1`` more
        attempts by the next ``next()``; recorded by ``state_dict()``)."""
        ids = got.ids
        assert ids is not None
        # A fresh failure had its first attempt already; a reported one gets all attempts.
        for _ in range(self.collate_retries + (1 if got.raised else 0)):
            if isinstance(got.error, BrokenProcessPool) and self._procs is not None:
                self._procs.shutdown(wait=False, cancel_futures=True)  # a worker died: restart
                self._procs = None
                self._pools()
            got = self._transform(got.batch)
            if got.error is None:
                return got.item
        got.raised = True
        self._ahead[0] = (index, _Known(got=got))
        shown = f"{ids[:20]} ... ({len(ids)} samples)" if len(ids) > 20 else f"{ids}"
        raise CollateError(
            f"collate_fn failed {self.collate_retries + 1} times on batch {index} of task "
            f"{self.task!r} (sample ids {shown}): {got.error!r}. The batch is kept: next() "
            "retries collate_fn on it and state_dict() records it, so a restored loader "
            "re-delivers it; fix collate_fn (or the samples) and call next() again",
            index=index,
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
        while True:
            if not self._ahead_max and not self._ahead:  # synchronous
                if self._ended:
                    raise StopIteration
                got = self._local_job(self._next)
                if got.ids is None:
                    self._ended = True
                    raise StopIteration
                self._ahead.append((self._next, _Known(got=got)))
                self._next += 1
            self._fill()
            if not self._ahead:
                self._stop_workers()
                raise StopIteration
            index, fut = self._ahead[0]
            try:
                got = fut.result()
            except BaseException:
                # A request that failed fetched nothing (e.g. the store timed out): ask for the
                # same batch again. One still running (an interrupted wait) is kept.
                if isinstance(fut, cf.Future) and fut.done() and fut.exception() is not None:
                    self._ahead[0] = (index, self._submit(index))
                raise
            if got.ids is None:
                # Every later request also ends; those already in flight may still hold
                # batches planned before the end, so they are drained, not dropped.
                self._ahead.popleft()
                self._ended = True
                continue
            item = got.item if got.error is None else self._retry(index, got)
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

    def __enter__(self) -> StoreLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def _stop_workers(self) -> None:
        if self._procs is not None:
            self._procs.shutdown(wait=False, cancel_futures=True)
            self._procs = None
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
        for index, fut in self._ahead:
            try:
                got = fut.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if isinstance(fut, cf.Future) and fut.done():
                    raise  # the request itself timed out in the store
                raise TimeoutError(
                    f"state_dict() waited {wait}s for batch {index} of task {self.task!r}, "
                    f"still being fetched (prefetch={self.prefetch}); the state must name the "
                    "batches fetched ahead. If producers wait for the trainer (e.g. a weight "
                    "sync), take state_dict() once they can run again, or use prefetch=1; "
                    "the loader is unchanged and usable"
                ) from None
            pending.append([index, got.ids])
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
            self._ahead.append((index, _Known(self._redeliver(ids))))

    def _redeliver(self, ids: list[Any] | None) -> Callable[[], _Got]:
        def fn() -> _Got:
            if ids is None:
                return _Got(None)
            self._pools()
            return self._transform(self.store.peek(self.partition, list(ids), self._spec.fields))

        return fn
