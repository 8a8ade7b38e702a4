"""The store door's producer: batch ``j`` of a task, fetched and collated wherever it runs.

:class:`StoreFetcher` is to a :class:`~meshfeed.queue.StoreLoader` what
:class:`meshfeed.fetch.Fetcher` is to a ``DataLoader``: a picklable
:class:`~meshfeed.protocols.Fetch` that any :mod:`meshfeed.services` service runs on a stream
of tasks. A :class:`StoreTask` names its batch index (the store's shared-plan key: asked again,
the same index gives the same batch), the policy version it is asked with and the request
token; :class:`StoreEvents` says which samples came back (``ids``; ``None``: the stream
ended) and, when ``collate_fn`` kept failing, the raw batch and the error, so that only
``collate_fn`` is retried (the samples are consumed in the store already).

Where the fetcher runs decides how it reaches the store: in the loader's process it calls the
store it was given; in a worker process it connects once, to the named Ray store
(``SampleStore.connect``) or, for the embedded store, to the loader's process through
:mod:`meshfeed.queue.loading.reach`. A fetcher copied into another process never uses a copy
of the embedded store (it would read a stale copy of the memory).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from meshfeed.errors import NEVER_SUBSTITUTED
from meshfeed.queue.engine.columns import own
from meshfeed.queue.engine.core import FieldsMissing, PartitionClosed
from meshfeed.queue.loading.reach import Reach
from meshfeed.queue.samplers import Sampler
from meshfeed.queue.store import Batch, SampleStore
from meshfeed.tasks import FetchEvents, FetchTask

__all__ = ["Spec", "StoreEvents", "StoreFetcher", "StoreTask", "fetch"]

_NONE = np.zeros(0, dtype=np.int64)


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
    group_filter: Callable[[dict[str, list[Any]]], bool] | None = None  # see queue.dynamic


@dataclass(frozen=True, slots=True)
class StoreTask(FetchTask):
    """Batch ``step`` of the loader's stream: asked with ``version`` (the trainer's version
    keywords, :mod:`meshfeed.queue.loading.versions`) under ``token`` (a walk's requests,
    cancelled together); ``batch``: fetched already, only ``collate_fn`` is to run again."""

    version: Mapping[str, Any] | None = None
    token: Hashable = None
    batch: Batch | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return StoreTask.make, (self.step, self.version, self.token, self.batch)

    @staticmethod
    def make(
        step: int, version: Mapping[str, Any] | None, token: Hashable, batch: Batch | None = None
    ) -> StoreTask:
        return StoreTask(0, step, _NONE, _NONE, version, token, batch)


@dataclass(slots=True)
class StoreEvents(FetchEvents):
    """What came of one :class:`StoreTask`: its batch ``index``, the samples' ``ids``
    (``None``: the stream ended), and when ``collate_fn`` kept failing its last ``error``
    with the raw ``batch`` (a retry collates it again, never fetches it again)."""

    index: int = 0
    ids: list[Any] | None = None
    error: BaseException | None = None
    batch: Batch | None = field(default=None, repr=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return StoreEvents, (
            self.retries, self.substituted, self.skipped, self.failures, self.fetch_s,
            self.collate_s, self.index, self.ids, self.error, self.batch,
        )  # fmt: skip


def fetch(
    store: Any, spec: Spec, index: int, token: Hashable, version: Mapping[str, Any] | None = None
) -> Batch | None:
    """Batch ``index`` of the loader's stream (``None``: it ended); ``version``: the
    trainer's version keywords (:mod:`meshfeed.queue.loading.versions`). A closed partition
    none of whose samples has some of ``spec.fields`` did not end: the fields are wrong
    (``ValueError`` naming them), where a loader would otherwise end with no batch."""
    try:
        return store.get(
            spec.task,
            spec.fields,
            spec.batch_size,
            spec.partition,
            spec.sampler,
            timeout=spec.timeout,
            token=token,
            batch_index=index,
            prefetch=spec.window,
            group_filter=spec.group_filter,
            **(version or {}),
        )
    except FieldsMissing as exc:
        raise ValueError(
            f"StoreLoader of task {spec.task!r} asks for fields={list(spec.fields)}, but "
            f"partition {spec.partition!r} is closed and no sample of it has field(s) "
            f"{exc.missing} (fields produced: {exc.produced}): it would end with no batch. "
            "Build the loader with fields= that the producers put"
        ) from exc
    except PartitionClosed:
        return None


class StoreFetcher:
    """Fetches and collates batch ``task.step`` (module docstring); ``collate_fn`` is tried
    ``1 + retries`` times, each time on the batch as fetched (:meth:`_collated`), except that a
    :data:`~meshfeed.errors.NEVER_SUBSTITUTED` error (``SourceError``, ``MemoryError``, ...)
    is raised as itself at once. ``reach``: how a copy in another process reaches the store
    (``None``: it cannot, the store is used in this process only)."""

    def __init__(
        self,
        store: SampleStore,
        spec: Spec,
        collate_fn: Callable[[Batch], Any] | None,
        retries: int,
        reach: Reach | None,
    ) -> None:
        self.spec, self.collate_fn, self.retries, self.reach = spec, collate_fn, retries, reach
        self.seed, self.worker_id, self.num_workers = 0, 0, 0
        self._store: Any = store
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"], state["_pid"] = None, -1  # another process connects on first use
        return state

    def _connected(self) -> Any:
        if self._pid != os.getpid():  # a worker's copy (forked or unpickled): connect once
            if self.reach is None:
                raise RuntimeError(
                    "a StoreLoader's fetcher runs in another process but has no way to reach "
                    "its store; this is a bug, please report it with the loader's options"
                )
            self._store, self._pid = self.reach.connect(), os.getpid()
        return self._store

    def __call__(self, task: FetchTask) -> tuple[Any, StoreEvents]:
        if not isinstance(task, StoreTask):
            raise TypeError(f"a StoreFetcher makes StoreTasks (got {type(task).__name__})")
        start = time.perf_counter()
        batch = task.batch
        if batch is None:
            batch = fetch(self._connected(), self.spec, task.step, task.token, task.version)
            if batch is None:
                return None, StoreEvents(index=task.step)
        fetched = time.perf_counter()
        item, error, batch = self._collated(batch)
        events = StoreEvents(
            fetch_s=fetched - start,
            collate_s=time.perf_counter() - fetched,
            index=task.step,
            ids=batch.ids,
        )
        if error is not None:
            events.error, events.batch = _portable(error), batch
        return item, events

    def _collated(self, batch: Batch) -> tuple[Any, BaseException | None, Batch]:
        """The collated batch or the last error, and ``batch`` as it was fetched. Every try
        gets the batch as the store handed it out: ``collate_fn`` may edit it in place before
        it fails, so a copy is taken before each try (:func:`_spare`), for the next try or,
        when every try failed, for the loader to keep (``next()`` collates it again,
        ``state_dict()`` records it). The store hands each sample out once, so no try can
        fetch it again as the map door reads a failed sample again."""
        if self.collate_fn is None:
            return batch, None, batch
        error: BaseException | None = None
        for _ in range(1 + self.retries):
            spare = _spare(batch)
            try:
                return self.collate_fn(batch), None, spare
            except NEVER_SUBSTITUTED:  # a damaged file, out of memory: raised as itself, never
                raise  # retried, skipped or wrapped (meshfeed.errors; as the other doors)
            except Exception as exc:
                error = exc
            batch = spare
        return None, error, batch


def _spare(batch: Batch) -> Batch:
    """A copy of ``batch`` sharing nothing that ``collate_fn`` could change in place: its
    columns (tensors and arrays copied, a view only its own rows; lists with their contents),
    ``ids`` and ``versions`` (the plan's ``parts`` are read-only, shared by its readers)."""
    return replace(
        batch,
        ids=list(batch.ids),
        columns={name: own(column) for name, column in batch.columns.items()},
        versions=None if batch.versions is None else list(batch.versions),
    )


def _portable(error: BaseException) -> BaseException:
    """``error``, or its traceback as a ``RuntimeError`` if it cannot travel between processes."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError("".join(traceback.format_exception(error)))
    return error
