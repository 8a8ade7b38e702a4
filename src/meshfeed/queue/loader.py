"""StreamingDataLoader: a per-rank iterator over a :class:`SampleStore` for a training loop.

The mesh is touched here only: the loader turns ``(mesh, rank)`` into a data rank and a replica
group, and (unless given another sampler) reads with a :class:`RankAwareSampler`, so tensor /
context / pipeline peers of one data rank receive identical batches, data ranks receive
disjoint ones, and all data ranks end at the same step (see the sampler for the last-round
rule). Batch ``j`` of the loader is the store's shared key ``j``; batches are returned in order
of ``j``.

Prefetching and worker processes. ``prefetch=P`` keeps up to ``P`` batches requested ahead of
the one being returned. ``num_workers=K`` starts ``K`` worker processes:

- Ray backend (a *named* store): each worker process connects to the store
  (``SampleStore.connect``) and fetches whole batches itself (``get`` of key ``j``, then
  ``transform``); the store's per-key planning makes every batch go to exactly one request, so
  no sample is delivered twice, whichever worker fetched it.
- Embedded backend: the store lives in this process's memory, which worker processes cannot
  share; so this process does every ``get`` (in background threads) and the worker processes
  only run ``transform`` on the fetched batches. ``num_workers > 0`` therefore needs a
  ``transform``.

Checkpoints. ``state_dict()`` is the state as of the last batch returned: it waits for the
batches in flight and records the ids of those fetched but not returned; after
``load_state_dict`` they are re-delivered first (read again from the store, not re-planned).
Take ``state_dict()`` of every loader, then save the store, before the next batch; a store with
``tasks=`` keeps such fetched-ahead samples until the loader returned them.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from meshfeed.mesh import DataMesh, default_rank, resolve_mesh
from meshfeed.queue.core import PartitionClosed
from meshfeed.queue.samplers import RankAwareSampler, Sampler
from meshfeed.queue.store import Batch, SampleStore

VERSION = 2
Result = tuple[list[Any] | None, Any]  # (ids, batch or transformed batch); ids None: ended


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


def _fetch(store: SampleStore, spec: _Spec, index: int) -> Result:
    try:
        batch = store._get(
            spec.task,
            spec.fields,
            spec.batch_size,
            spec.partition,
            spec.sampler,
            spec.timeout,
            {"batch_index": index},
            spec.hold,
        )
    except PartitionClosed:
        return None, None
    return batch.ids, batch


_WORKER_STORE: SampleStore | None = None


def _ray_worker_init(address: str, name: str) -> None:
    import ray

    global _WORKER_STORE
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    _WORKER_STORE = SampleStore.connect(name)


def _ray_worker_fetch(spec: _Spec, index: int, transform: Callable[[Batch], Any] | None) -> Result:
    assert _WORKER_STORE is not None, "worker process started without a store"
    ids, batch = _fetch(_WORKER_STORE, spec, index)
    if ids is None or transform is None:
        return ids, batch
    return ids, transform(batch)


class _Known:
    """A result known already (restored from a checkpoint); quacks like a future."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], Result]) -> None:
        self._fn = fn

    def result(self, timeout: float | None = None) -> Result:
        return self._fn()


class StreamingDataLoader:
    """Iterate batches of ``fields`` for ``task`` from ``partition``, as global ``rank`` of
    ``mesh`` (a :class:`DataMesh`, ``DeviceMesh``, dict of axis sizes, or ``None`` for the
    torchrun world); see the module docstring for workers and checkpoints.

    ``timeout`` bounds each wait for a batch (``TimeoutError``; the loader stays usable).
    ``transform``: a picklable function of a :class:`Batch` applied to every batch (in worker
    processes when ``num_workers > 0``). Replica peers must use the same ``batch_size`` and
    sampler; ``close()`` (or the end of the stream) stops worker processes.
    """

    def __init__(
        self,
        store: SampleStore,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        partition: str,
        mesh: Any = None,
        rank: int | None = None,
        *,
        sampler: Sampler | None = None,
        timeout: float | None = None,
        num_workers: int = 0,
        prefetch: int | None = None,
        transform: Callable[[Batch], Any] | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int (got {batch_size=!r})")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0 (got {num_workers=!r})")
        prefetch = num_workers if prefetch is None else prefetch
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (got {prefetch=!r})")
        if num_workers and store.backend == "embedded" and transform is None:
            raise ValueError(
                "num_workers > 0 with the embedded store only runs `transform` in worker "
                "processes (the store cannot be shared with them); pass transform=..., or "
                "use prefetch=N for fetching ahead without processes"
            )
        if num_workers and store.backend == "ray" and getattr(store._backend, "name", None) is None:
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
        self.num_workers, self.prefetch, self.transform = num_workers, prefetch, transform
        self._ahead_max = (prefetch + 1) if (prefetch or num_workers) else 0
        # Holding matters only when samples can be evicted while fetched ahead.
        hold = bool(self._ahead_max) and store.options.tasks is not None
        self._spec = _Spec(task, tuple(fields), batch_size, partition, self.sampler, timeout, hold)
        self._next = 0  # the next batch index to request
        self._ended = False  # a request found the stream ended: request nothing more
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
                init: Any = (_ray_worker_init, (address, self.store._backend.name))
            else:
                init = (None, ())
            self._procs = cf.ProcessPoolExecutor(
                self.num_workers, mp_context=ctx, initializer=init[0], initargs=init[1]
            )

    def _local_job(self, index: int) -> Result:
        """Fetch in this process; ``transform`` in a worker process if there are any."""
        ids, batch = _fetch(self.store, self._spec, index)
        if ids is None or self.transform is None:
            return ids, batch
        if self._procs is not None:
            return ids, self._procs.submit(self.transform, batch).result()
        return ids, self.transform(batch)

    def _submit(self, index: int) -> Any:
        self._pools()
        if self.store.backend == "ray" and self._procs is not None:
            return self._procs.submit(_ray_worker_fetch, self._spec, index, self.transform)
        if self._threads is None:  # requests wait in the store, so one thread per request
            self._threads = cf.ThreadPoolExecutor(self._ahead_max, "meshfeed-loader")
        return self._threads.submit(self._local_job, index)

    def _fill(self) -> None:
        while not self._ended and len(self._ahead) < self._ahead_max:
            self._ahead.append((self._next, self._submit(self._next)))
            self._next += 1

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            if not self._ahead_max and not self._ahead:  # synchronous
                if self._ended:
                    raise StopIteration
                ids, item = self._local_job(self._next)
                if ids is None:
                    self._ended = True
                    raise StopIteration
                self._next += 1
                return item
            self._fill()
            if not self._ahead:
                self.close()
                raise StopIteration
            index, fut = self._ahead[0]
            try:
                ids, item = fut.result()
            except BaseException:
                self._ahead[0] = (index, self._submit(index))  # ask for the same batch again
                raise
            self._ahead.popleft()
            if ids is None:
                # Every later request also ends; those already in flight may still hold
                # batches planned before the end, so they are drained, not dropped.
                self._ended = True
                continue
            if self._spec.hold:
                self.store._release(self.partition, ids)
            return item

    def close(self) -> None:
        """Stop worker processes and threads (batches in flight are abandoned)."""
        if self._procs is not None:
            self._procs.shutdown(wait=False, cancel_futures=True)
            self._procs = None
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The state as of the last batch returned (waits for the batches in flight)."""
        pending = [[index, fut.result(self.timeout)[0]] for index, fut in self._ahead]
        return {
            "version": VERSION,
            "task": self.task,
            "partition": self.partition,
            "data_rank": self.data_rank,
            "next": self._next,
            "ended": self._ended,
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the store must be restored to the same moment."""
        if state.get("version") != VERSION:
            raise ValueError(
                f"loader state version {state.get('version')!r} is not {VERSION}; use a state "
                "written by this meshfeed"
            )
        for key in ("task", "partition", "data_rank"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the state is for {key}={state[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; resume with the same configuration"
                )
        if self._ahead or self._next:
            raise ValueError(
                "load_state_dict must come before iteration starts; build a fresh loader"
            )
        self._next = int(state["next"])
        self._ended = bool(state["ended"])
        for index, ids in state["pending"]:
            self._ahead.append((int(index), _Known(self._redeliver(ids))))

    def _redeliver(self, ids: list[Any] | None) -> Callable[[], Result]:
        def fn() -> Result:
            if ids is None:
                return None, None
            batch = self.store._peek(self.partition, list(ids), self._spec.fields)
            return batch.ids, batch if self.transform is None else self.transform(batch)

        return fn
