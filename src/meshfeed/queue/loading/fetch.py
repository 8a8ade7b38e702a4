"""The store loader's requests on their way: fetch, collate, worker processes.

:class:`StoreLoader <meshfeed.queue.loading.loader.StoreLoader>` keeps its batches in flight as
:class:`Entry` records; here is what one request does (:func:`fetch` from the store, then
``collate_fn`` through :func:`apply`), what a worker process runs (:class:`StoreWork`, on a
:class:`~meshfeed.services.WorkerService`: the one driver of worker processes),
:class:`InFlight` (the batches between request and return: threads, workers, order) and the
message for a lost worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import pickle
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshfeed.queue.engine.core import PartitionClosed
from meshfeed.queue.loading.versions import LoaderVersion
from meshfeed.queue.samplers import Sampler
from meshfeed.queue.store import Batch, SampleStore
from meshfeed.runtime import WorkerError
from meshfeed.runtime.failures import failure_message
from meshfeed.services.workers import WorkerService
from meshfeed.tasks import FetchEvents

_MARGIN = 0.25  # Ray workers: the store's own TimeoutError comes first, then the pool's


class Late(Exception):
    """A wait's own deadline (the delivery thread's poll) passed while a batch was still on
    its way."""


@dataclass(slots=True)
class Got:
    """One request's outcome: ``ids`` (``None``: the stream ended) and the transformed
    ``item``; while ``collate_fn`` has not succeeded, the raw ``batch`` and the ``error``, so
    only ``collate_fn`` is retried (the samples are already consumed in the store)."""

    ids: list[Any] | None
    item: Any = None
    batch: Any = None
    error: BaseException | None = None
    raised: bool = False  # the failure was reported (CollateError): retry it afresh


@dataclass(frozen=True, slots=True)
class Spec:
    """One loader's request, picklable for worker processes."""

    task: str
    fields: tuple[str, ...]
    batch_size: int
    partition: str
    sampler: Sampler
    timeout: float | None
    #: The most batches in flight (requested, or taken by the delivery thread, not returned):
    #: a request acknowledges the batches this far behind it, so the store keeps the plans
    #: of every batch in flight (replica peers must share it; the store checks).
    window: int
    token: str  # the loader's requests, cancelled together by shutdown()
    group_filter: Callable[[dict[str, list[Any]]], bool] | None = None  # see queue.dynamic


def fetch(
    store: SampleStore, spec: Spec, index: int, version: Mapping[str, Any] | None = None
) -> Batch | None:
    """Batch ``index`` of the loader's stream (``None``: it ended); ``version``: the
    trainer's version keywords (:mod:`meshfeed.queue.loading.versions`)."""
    try:
        return store.get(
            spec.task,
            spec.fields,
            spec.batch_size,
            spec.partition,
            spec.sampler,
            spec.timeout,
            token=spec.token,
            batch_index=index,
            prefetch=spec.window,
            group_filter=spec.group_filter,
            **(version or {}),
        )
    except PartitionClosed:
        return None


def apply(transform: Callable[[Batch], Any] | None, batch: Batch) -> Got:
    """``transform(batch)``; a failure keeps the raw batch for a retry of the transform alone."""
    if transform is None:
        return Got(batch.ids, batch)
    try:
        return Got(batch.ids, transform(batch))
    except Exception as exc:
        return Got(batch.ids, batch=batch, error=exc)


def portable(got: Got) -> Got:
    """``got`` with an error that can travel back to the main process (else its traceback)."""
    if got.error is not None:
        try:
            pickle.dumps(got.error)
        except Exception:
            got.error = RuntimeError("".join(traceback.format_exception(got.error)))
    return got


class StoreWork:
    """What a store loader's worker process runs (picklable; a
    :class:`~meshfeed.services.WorkerService`'s fetcher): ``("fetch", (index, version))``
    (Ray: this worker fetches batch ``index`` from the named store, connected on first use,
    then collates it) or ``("collate", batch)``. A failing ``collate_fn`` returns the raw batch
    with the error, so only the collate step is retried; a failing fetch raises (the loader
    requests the batch again)."""

    def __init__(
        self,
        address: str | None,
        name: str | None,
        spec: Spec,
        collate_fn: Callable[[Batch], Any] | None,
    ) -> None:
        self.address, self.name, self.spec, self.collate_fn = address, name, spec, collate_fn
        self.seed, self.worker_id, self.num_workers = 0, 0, 0
        self._store: SampleStore | None = None

    def _connected(self) -> SampleStore:
        if self._store is None:
            if self.address is None or self.name is None:
                raise RuntimeError("store loader worker asked to fetch without a store")
            import ray

            ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            self._store = SampleStore.connect(self.name)
        return self._store

    def __call__(self, task: Any) -> tuple[Got, FetchEvents]:
        kind, arg = task
        if kind == "fetch":
            batch = fetch(self._connected(), self.spec, *arg)
            if batch is None:
                return Got(None), FetchEvents()
        else:
            batch = arg
        return portable(apply(self.collate_fn, batch)), FetchEvents()


@dataclass(slots=True, eq=False)
class Entry:
    """One requested batch on its way to the trainer. Exactly one of these is in progress:
    ``got`` (known outcome), ``fetch`` (a thread fetching it here), ``worker`` (a task for it
    is outstanding on that worker), ``failed`` (the request failed: raised once, then
    requested again); with none of them, it is to be requested (``batch`` set: fetched, to be
    collated in a worker)."""

    index: int
    got: Got | None = None
    fetch: cf.Future[Any] | None = None
    batch: Batch | None = None
    worker: int | None = None
    failed: BaseException | None = None


def make_pool(num_workers: int, wait: float | None, backend: str, prefetch: int) -> WorkerService:
    """The (not yet started) worker processes of a loader with ``num_workers`` workers."""
    ray = backend == "ray"
    return WorkerService(
        num_workers,
        prefetch=prefetch,
        # Ray: a fetch waits in the store up to `timeout` and raises TimeoutError
        # there; the pool's own limit (a stuck or stopped worker) comes just after.
        timeout=None if wait is None else wait + (_MARGIN if ray else 0),
        # Ray: spawn (fork is unsafe under Ray; each worker connects to the store,
        # which counts against the first batch's timeout). Embedded: the platform's
        # default, fork where it exists; the workers start before the fetch threads.
        start_method="spawn" if ray else None,
        name="meshfeed-store-worker",
        grace=0.25,
    )


def lost_error(error: WorkerError, task: str, head: int) -> WorkerError:
    """The error to raise once the pool stopped after a worker died or stalled, saying that
    iterating again continues from batch ``head``."""
    return WorkerError(
        failure_message(
            error,
            who=f"store loader (task {task!r})",
            what=f"batch {head} or one after it",
            then=f"Its workers were stopped; iterating the loader again starts fresh workers "
            f"and continues from batch {head} (nothing is lost or repeated)",
        )
    )


class InFlight:
    """A loader's batches between request and return, in index order (``ahead``): fetched by
    one request thread here (requests wait in the store; one at a time, in index order) or by
    worker processes (a named Ray store), collated here or in the workers. ``next``: the next batch index to
    request; ``ended``: a request found the stream ended, request nothing more."""

    def __init__(
        self,
        store: SampleStore,
        spec: Spec,
        collate_fn: Callable[[Batch], Any] | None,
        num_workers: int,
        ahead_max: int,
    ) -> None:
        self.store, self.spec, self.collate_fn = store, spec, collate_fn
        self.num_workers, self.ahead_max = num_workers, ahead_max
        self.next = 0
        self.ended = False
        self.ahead: deque[Entry] = deque()
        self.threads: cf.ThreadPoolExecutor | None = None
        self.pool: WorkerService | None = None
        if num_workers:
            self.pool = make_pool(num_workers, spec.timeout, store.backend, max(ahead_max, 1))
        self.sent: list[deque[Entry]] = [deque() for _ in range(num_workers)]
        self.version: LoaderVersion | None = None  # the loader's, set after construction
        #: The policy version each batch not yet returned was first requested with: asked
        #: again (a retry, or a restored loader: ``replay``), it is asked with the same.
        self.asked: dict[int, int | None] = {}

    def version_args(self, index: int) -> dict[str, Any] | None:
        if self.version is None:
            return None
        args = self.version.request()
        args["version"] = self.asked.setdefault(index, args["version"])
        return args

    def returned(self, index: int) -> None:
        """Batch ``index`` (and any skipped before it) left the loader: forget its version."""
        for done in [i for i in self.asked if i <= index]:
            del self.asked[done]

    def asked_versions(self, start: int, stop: int) -> list[int | None]:
        """The versions batches ``start`` to ``stop - 1`` were requested with (for a state)."""
        asked = dict(self.asked)  # a copy: the delivery thread may request meanwhile
        return [asked.get(i) for i in range(start, stop)]

    def thread_job(self, index: int, version: dict[str, Any] | None) -> Got | Batch | None:
        """Fetch here (in a thread); ``collate_fn`` too unless worker processes run it."""
        batch = fetch(self.store, self.spec, index, version)
        if batch is None or self.pool is not None:
            return batch
        return apply(self.collate_fn, batch)

    def start_pool(self) -> WorkerService:
        """The worker processes, started on first use or again after a worker failed."""
        pool = self.pool
        assert pool is not None
        if not pool.started:
            address = None
            if self.store.backend == "ray":
                import ray

                address = ray.get_runtime_context().gcs_address
            pool.start(StoreWork(address, self.store.name, self.spec, self.collate_fn))
            self.sent = [deque() for _ in range(self.num_workers)]
        return pool

    def send(self, entry: Entry, task: tuple[str, Any]) -> None:
        w = self.start_pool().submit(task)
        entry.worker = w
        self.sent[w].append(entry)

    def request(self, entry: Entry) -> None:
        """Start what ``entry`` needs next: its fetch, or the collate of its fetched batch."""
        if entry.batch is not None:
            if self.pool is None:
                entry.got = apply(self.collate_fn, entry.batch)
            else:
                self.send(entry, ("collate", entry.batch))
        elif self.pool is not None and self.store.backend == "ray":
            self.send(entry, ("fetch", (entry.index, self.version_args(entry.index))))
        else:
            if self.threads is None:
                # One thread, so requests reach the store one at a time in index order: a
                # round is planned only after every earlier one (by any reader: each asks in
                # order), so which samples form round j never depends on thread timing.
                self.threads = cf.ThreadPoolExecutor(1, "meshfeed-loader")
            # The version as of the request, not of when the thread runs: deterministic.
            version = self.version_args(entry.index)
            entry.fetch = self.threads.submit(self.thread_job, entry.index, version)

    def fetched(self, entry: Entry, result: Got | Batch | None) -> None:
        if isinstance(result, Got):
            entry.got = result
        elif result is None:
            entry.got = Got(None)
        else:
            entry.batch = result
            self.request(entry)

    def recv(self, w: int) -> None:
        """Receive worker ``w``'s oldest result into the entry it belongs to."""
        assert self.pool is not None
        entry = self.sent[w][0]
        try:
            got, _ = self.pool.take(w)
        except WorkerError:
            raise
        except Exception as exc:  # the fetch failed in the worker (or the result could not travel)
            if entry.batch is not None:
                batch = entry.batch
                entry.got = Got(batch.ids, batch=batch, error=exc)
            else:
                entry.failed = exc
        else:
            entry.got = got
        self.sent[w].popleft()
        entry.worker = None

    def progress(self) -> None:
        """Without waiting: hand the batches fetched so far to the workers. Results are taken
        only when their batch is next, so a worker failing on a later batch never costs one
        already made."""
        for entry in self.ahead:
            if entry.fetch is not None and entry.fetch.done():
                fut, entry.fetch = entry.fetch, None
                try:
                    self.fetched(entry, fut.result())
                except Exception as exc:
                    entry.failed = exc

    def wait(self, entry: Entry, deadline: float | None = None) -> Got:
        """Drive ``entry`` until its outcome is known; ``deadline`` (``time.monotonic()``)
        raises :class:`Late` past it, changing nothing."""
        while entry.got is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if entry.failed is not None:  # raised once; the same batch is requested again
                exc, entry.failed = entry.failed, None
                self.request(entry)
                raise exc
            self.advance(entry, left)
        return entry.got

    def advance(self, entry: Entry, left: float | None) -> None:
        """One step of :meth:`wait`: take the outcome of what is in progress for ``entry``
        (waiting at most ``left`` seconds, else :class:`Late`), or request it."""
        if entry.fetch is not None:
            try:
                result = entry.fetch.result(left)
            except cf.TimeoutError as exc:
                if not entry.fetch.done():  # the wait's own deadline, not the store's timeout
                    raise Late from None
                entry.fetch, entry.failed = None, exc
                return
            except Exception as exc:
                entry.fetch, entry.failed = None, exc
                return
            entry.fetch = None
            self.fetched(entry, result)
        elif entry.worker is not None:
            assert self.pool is not None
            if left is not None and not self.pool.ready(entry.worker, left):
                raise Late
            self.recv(entry.worker)
        else:
            self.request(entry)

    def lost_pool(self, error: WorkerError, task: str) -> WorkerError | None:
        """:meth:`lost`'s error when ``error`` stopped the pool (a worker died or stalled);
        None when it did not (e.g. a ``collate_fn`` raising ``WorkerError`` itself)."""
        if self.pool is None or self.pool.started:
            return None
        return self.lost(error, task)

    def lost(self, error: WorkerError, task: str) -> WorkerError:
        """The pool stopped after a worker died or stalled: what was sent to it is sent again
        (to fresh workers) when next needed; the error to raise, saying so."""
        for entry in self.ahead:
            entry.worker = None
        self.sent = [deque() for _ in range(self.num_workers)]
        head = self.ahead[0].index if self.ahead else self.next
        return lost_error(error, task, head)

    def fill(self) -> None:
        while not self.ended and len(self.ahead) < self.ahead_max:
            entry = Entry(self.next)
            self.ahead.append(entry)
            self.next += 1
            self.request(entry)

    def stop_workers(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()  # stop message, SIGTERM, SIGKILL: joins every worker
            for entry in self.ahead:
                entry.worker = None
            self.sent = [deque() for _ in range(self.num_workers)]
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)
            self.threads = None
