"""StoreLoader: a per-rank iterator over a :class:`SampleStore` for a training loop.

The mesh is touched here only: the loader turns ``(mesh, rank)`` into a data rank and a replica
group, and reads with a :class:`RankAwareSampler` (a given ``SequentialSampler`` or
``GroupSampler`` is wrapped in one for this rank; any other sampler must be rank-aware for this
rank of this mesh, else it is refused: see :func:`~meshfeed.queue.samplers.mesh_sampler`), so
tensor / context / pipeline peers of one data rank receive identical batches, data ranks
receive disjoint ones, and all data ranks end at the same step, always (see the sampler for
the last-round rule). Batch ``j`` of the loader is the store's shared key ``j``; batches are
returned in order of ``j``.

Arguments, defaults, checks and lifecycle are those of :class:`meshfeed.DataLoader`
(``batch_size``, ``mesh``, ``rank``, ``num_workers``, ``prefetch``, ``timeout``,
``collate_fn``; ``shutdown()`` and ``with``): the loader is a
:class:`~meshfeed.loader_base.LoaderBase` configured by one validated
:class:`~meshfeed.options.LoaderOptions` (``loader.options``), with the base's mesh placement,
``epoch`` / ``set_epoch`` (only epoch 0 exists) and rate-limited warnings. ``collate_fn`` is
the last step before the trainer, as in ``DataLoader``; its input is the :class:`Batch` the
store already assembled (columns stacked), not a list of samples, since the store hands out
batches, not items.

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

Worker processes run on :class:`meshfeed.services.WorkerService` (Ray: spawned, each connects to
the store once; embedded: the platform's default start method, fork where it exists). A worker
that dies, or produces nothing within ``timeout`` (stuck, or stopped), raises
:class:`~meshfeed.runtime.WorkerError` within about ``timeout`` + 1 s with every worker stopped;
iterating the loader again starts fresh workers and continues with the batch that failed
(embedded: collated again from the batch already fetched; Ray: requested again by its index).

``pin_memory`` / ``device`` deliver batches pinned / on the device, copied ahead on a
delivery thread as ``DataLoader`` does, the state still exact (:mod:`~.loader_stage`).
``stats()`` counts the batches and samples returned, timeouts and failures, next to the store's
view of the task; ``epochs(1)`` yields the one epoch a store stream is (see
:meth:`StoreLoader.epochs`).

``shutdown()`` cancels the requests still waiting in the store (threads and worker processes
blocked without a deadline wake at once, consuming nothing) and stops the workers.

Recovery. Every request names its batch index, so the store plans it once and keeps the plan
until every reader has passed it (each request acknowledges the batches more than the
loader's batches in flight behind it): a retried request gets the same batch, and a loader
restored from ``state_dict()`` asks again for the batches it had not returned and gets the
same ones. Such shared plans take no lease (a store's ``lease_timeout`` applies to direct
``get`` calls, whose consumer may die holding a batch).

Checkpoints. ``state_dict()`` is the state as of the last batch returned, at once (it never
waits for the batches in flight): the index of the first batch not returned and how far the
loader had asked, a few hundred bytes whatever the mesh. The batches in flight are the store's
plans, kept in the store (and in its checkpoint); after ``load_state_dict`` they are read back
first. Every rank's state is the same, and it loads on another number of data ranks with the
same global batch (elastic resume: :mod:`meshfeed.queue.loading.resume`). Save the store and
every loader's state between the same two batches; a store that outlives the trainer (a Ray
actor) serves a restored loader without being restored itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshfeed.dist import is_distributed
from meshfeed.errors import CollectiveError, RankError
from meshfeed.loader_base import LoaderBase, check_num_epochs
from meshfeed.options import LoaderOptions, OnError
from meshfeed.queue.engine.wakeups import check_timeout
from meshfeed.queue.loading.errors import CollateError, SkipLog, check_on_error, round_failed
from meshfeed.queue.loading.fetch import Entry, Got, InFlight, Spec
from meshfeed.queue.loading.resume import KIND, VERSION, check_moment, open_state, unit_of
from meshfeed.queue.loading.stage import Stage
from meshfeed.queue.loading.versions import LoaderVersion, check_store, one_epoch
from meshfeed.queue.samplers import Sampler, mesh_sampler
from meshfeed.queue.store import Batch, SampleStore
from meshfeed.queue.validate import check_loader_arguments, check_loader_workers
from meshfeed.relayout import rebuild
from meshfeed.runtime import WorkerError
from meshfeed.state import envelope

#: What ``_retry`` returns for a batch ``on_error="skip"`` drops.
_FAILED: Any = object()
#: The errors ``stats()`` counts, under their keys.
_COUNTED = {TimeoutError: "timeouts", CollateError: "collate_errors", WorkerError: "worker_errors"}


class StoreLoader(LoaderBase):
    """Iterate batches of ``fields`` for ``task`` from ``partition`` of ``store``, as global
    ``rank`` of ``mesh`` (a :class:`DataMesh`, ``DeviceMesh``, dict of axis sizes, or
    ``None`` for the torchrun world; ``device_mesh=`` is the same argument under torch's
    name); see the module docstring for workers and checkpoints.

    ``timeout`` (seconds, default 300 as ``DataLoader``; ``math.inf``: no limit) bounds each
    wait for a batch and ``state_dict()``'s wait for batches in flight (``TimeoutError``; the
    loader stays usable). ``collate_fn``: a picklable function of a :class:`Batch` applied to
    every batch (in worker processes when ``num_workers > 0``), retried on the same fetched
    batch ``collate_retries`` more times, never by fetching again; if it keeps failing,
    ``on_error="raise"`` (default) raises :class:`CollateError` naming the batch's ids and
    the loader keeps the batch, ``on_error="skip"`` drops it, agreed by every rank (needs the
    process group on a mesh of several ranks; see the module docstring). Replica peers
    must use the same ``batch_size``, ``prefetch`` and sampler (the store checks
    ``batch_size`` and ``prefetch``: the batches requested ahead decide at which step a peer
    sees the end of the stream; ``on_error``: :mod:`meshfeed.queue.loading.errors`).
    ``shutdown()`` (or leaving a ``with`` block) cancels waiting requests and stops workers.
    ``max_staleness`` with :meth:`set_version` and
    ``group_filter`` go to every request (policy versions and dynamic sampling, applied by
    the store: :mod:`meshfeed.queue.engine.versions`, :mod:`meshfeed.queue.engine.dynamic`).

    >>> store = SampleStore()
    >>> _ = store.put("p", {"x": [1, 2, 3, 4]}); store.close("p")
    >>> with StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=2,
    ...                  mesh={"dp": 1}, rank=0) as loader:
    ...     [b["x"] for b in loader]
    [[1, 2], [3, 4]]
    """

    name = "StoreLoader"

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
        on_error: OnError | None = None,
        pin_memory: bool = False,
        device: Any = None,
        device_prefetch: int = 2,
        on_step: Callable[[Any], Any] | None = None,
        max_staleness: int | None = None,
        group_filter: Callable[[dict[str, list[Any]]], bool] | None = None,
    ) -> None:
        given = dict(locals())  # the arguments resize() builds the loader again from
        placed = ("self", "__class__", "store", "batch_size", "mesh", "device_mesh", "rank")
        self._arguments = {k: v for k, v in given.items() if k not in placed}
        check_store(store)
        options = LoaderOptions(
            batch_size=batch_size,
            shuffle=False,  # the store decides the order: no seed, no shuffle
            num_workers=num_workers,
            prefetch=prefetch,
            collate_fn=collate_fn,
            timeout=timeout,
            on_error="raise" if on_error is None else on_error,
            pin_memory=pin_memory,
            device=device,
            device_prefetch=device_prefetch,
            on_step=on_step,
        )
        check_loader_arguments(
            task=task, fields=fields, partition=partition, collate_retries=collate_retries
        )
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None (got {collate_fn=!r})")
        check_loader_workers(store, num_workers, collate_fn)
        super().__init__(options, mesh=mesh, device_mesh=device_mesh, rank=rank)
        self.on_error: OnError = check_on_error(options.on_error, self.mesh.world_size)
        self._skips = SkipLog()
        self.replica_group = self.mesh.replica_group(self.rank)
        self.sampler = mesh_sampler(sampler, self.mesh, self.rank)
        self._unit = unit_of(self.sampler)
        self.store, self.task, self.fields = store, task, list(fields)
        self.partition, self.collate_retries = partition, collate_retries
        wait = check_timeout(timeout)
        # The delivery thread (pin_memory / device) never fetches in the loop's stead: threads do.
        self._ahead_max = prefetch if (prefetch > 1 or num_workers or self.delivery.ahead) else 0
        #: Most batches a state may name in flight: requested, or taken by the delivery thread.
        self._keeps = max(self._ahead_max, 1) + (options.device_prefetch + 1) * self.delivery.ahead
        self._spec = Spec(
            task, tuple(fields), batch_size, partition, self.sampler, wait, self._keeps,
            uuid.uuid4().hex, group_filter,
        )  # fmt: skip
        self._shut = False
        self._version = LoaderVersion(max_staleness)
        self._flight = InFlight(store, self._spec, collate_fn, num_workers, self._ahead_max)
        self._flight.version = self._version
        # What stats() reports (since this object was built; not part of the state).
        self._counts = dict.fromkeys(
            ("batches", "samples", "timeouts", "collate_errors", "worker_errors", "redelivered"), 0
        )
        self._next_seconds = 0.0
        self._returned = 0  # the first batch index not returned (the state's ``next``)
        self._redeliver = 0  # batches below it were in flight when the loaded state was taken
        self._finished = False  # every batch returned and the end seen (StopIteration)
        #: Pinned / on the device, on the delivery thread (#27): see loader_stage.
        self._stage = Stage(self.delivery, self._flight, self._next_item)

    def _retry(self, entry: Entry, got: Got) -> Any:
        """Retry only ``collate_fn`` on a fetched batch; :class:`CollateError` if it keeps
        failing, with the batch left at the head of the queue (``collate_retries + 1`` more
        attempts by the next ``next()``; recorded by ``state_dict()``)."""
        ids = got.ids
        assert ids is not None
        # A fresh failure had its first attempt already; a reported one gets all attempts.
        for _ in range(self.collate_retries + (1 if got.raised else 0)):
            attempt = Entry(entry.index, batch=got.batch)
            got = self._flight.wait(attempt)
            if got.error is None:
                return got.item
        got.raised = True
        entry.got = got
        if self.on_error == "skip":
            return _FAILED
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
        start = time.perf_counter()
        try:
            item, entry = self._stage.next()
        except BaseException as error:
            self._count(error)
            if isinstance(error, StopIteration):
                self._finish()
            if not isinstance(error, WorkerError):
                raise
            if (lost := self._flight.lost_pool(error, self.task)) is None:
                raise  # not a failure of the pool (a collate_fn raising WorkerError itself)
            raise lost from None
        finally:
            self._next_seconds += time.perf_counter() - start
        got = entry.got  # returned: consumed (the state no longer names it)
        assert got is not None and got.ids is not None
        self._returned = entry.index + 1
        self._flight.returned(entry.index)
        self._counts["batches"] += 1
        self._counts["samples"] += len(got.ids)
        self._counts["redelivered"] += entry.index < self._redeliver
        return item

    def _finish(self) -> None:
        """The end was reached with every batch returned: once, tell the store this reader
        passed every batch it asked for, so the last plans go once every reader has."""
        if self._finished:
            return
        self._finished = True
        with contextlib.suppress(Exception):  # the store may be gone (a killed Ray actor)
            self.store.passed(self.partition, self.task, self.sampler, self._flight.next)

    def _count(self, error: BaseException) -> None:
        for kind, key in _COUNTED.items():
            self._counts[key] += isinstance(error, kind)

    def _next_item(self, halt: threading.Event) -> tuple[Any, Entry] | None:
        while True:
            if not self._ahead_max and not self._flight.ahead:  # synchronous
                if self._flight.ended:
                    return None
                index = self._flight.next
                result = self._flight.thread_job(index, self._flight.version_args(index))
                if not isinstance(result, Got) or result.ids is None:  # no workers here
                    self._flight.ended = True
                    return None
                self._flight.ahead.append(Entry(self._flight.next, got=result))
                self._flight.next += 1
            if self._flight.pool is not None and not self._flight.ended:
                self._flight.start_pool()  # before the fetch threads exist (fork)
            self._flight.fill()
            self._flight.progress()
            if not self._flight.ahead:
                self._flight.stop_workers()
                return None
            entry = self._flight.ahead[0]
            got = self._stage.wait(entry, halt)
            if got is None:
                return None
            if got.ids is None:
                # Every later request also ends; those already in flight may still hold
                # batches planned before the end, so they are drained, not dropped.
                self._flight.ahead.popleft()
                self._flight.ended = True
                continue
            item = self._collated(entry, got)
            self._flight.ahead.popleft()
            if self.on_error == "skip" and self._skip(entry.index, got, item is _FAILED):
                continue
            entry.got = Got(got.ids, item)  # what a stopped stage puts back
            return item, entry

    def _collated(self, entry: Entry, got: Got) -> Any:
        """The batch's ``collate_fn`` output (:meth:`_retry` when it failed). With
        ``on_error="raise"`` and a process group of several ranks, the ranks agree on every
        batch (one ``all_reduce`` of one int): a rank whose batch raises raises its
        :class:`CollateError` and every other rank :class:`~meshfeed.errors.RankError` at the
        same batch, which stays first in line, so none waits in its next collective."""
        agree = self.on_error == "raise" and is_distributed()
        try:
            item = got.item if got.error is None else self._retry(entry, got)
        except Exception:
            if agree:
                with contextlib.suppress(CollectiveError):  # a dead peer must not hide ours
                    round_failed(True, self.wait_timeout)
            raise
        failed = round_failed(False, self.wait_timeout) if agree else None
        if failed is not None:
            entry.got = got  # kept first in line: next() returns it once the ranks go on
            raise RankError(
                f"rank {failed} could not collate its part of batch {entry.index} of task "
                f"{self.task!r} (this is rank {self.rank}); see that rank's error. Every rank "
                "stops here so that none waits in its next collective",
                rank=failed,
                step=entry.index,
            )
        return item

    def _skip(self, index: int, got: Got, failed: bool) -> bool:
        """``on_error="skip"``: whether batch ``index`` is dropped, agreed by every rank (a
        round one rank could not collate is dropped by all of them); counted and warned."""
        rank = round_failed(failed, self.wait_timeout)
        if rank is None:
            return False
        assert got.ids is not None
        first = self._skips.record(index, got.ids, got.error if failed else None, rank)
        self._note_bad_samples(len(got.ids), first)
        return True

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """A store stream is one epoch: the producers decide its length, and the loader ends
        once the partition is closed and drained. ``epochs(1)`` yields ``0`` once (nothing if
        this loader already reached the end, e.g. restored from a state taken there), so a
        loop written for ``DataLoader.epochs`` runs unchanged; ``epochs(0)`` yields nothing.
        More epochs are refused: another pass needs new samples (a new partition and a fresh
        ``StoreLoader``, or ``SampleStore.reset_consumption``)."""
        check_num_epochs(num_epochs)
        if num_epochs > 1:
            raise ValueError(one_epoch(f"{num_epochs=}", "use epochs(1)"))
        if num_epochs == 1 and not self._at_end():
            yield 0

    def _at_end(self) -> bool:
        return self._finished

    def _enter_epoch(self, epoch: int) -> None:
        """Only epoch 0 exists (``set_epoch(0)`` is a no-op); any other is refused."""
        raise ValueError(one_epoch(f"set_epoch({epoch})", "stay at epoch 0"))

    def stats(self) -> dict[str, Any]:
        """What this loader object did since it was built, and the store's view of its task.

        ``batches`` / ``samples`` returned, ``timeouts`` (``TimeoutError`` raised by
        ``next()``), ``collate_errors`` (:class:`CollateError` raised), ``worker_errors``,
        ``redelivered`` (batches a restored state re-delivers), ``skipped`` /
        ``skipped_samples`` (batches dropped by ``on_error="skip"``) and ``failures`` (the first
        of them as rows ``[index, ids, error, message]``), ``next_seconds`` (time spent in
        ``next()``: waiting for the store, and ``collate_fn`` when it runs here), ``in_flight``
        (batches requested, not yet returned), ``ended``, ``epoch`` (always 0: see
        :meth:`epochs`), ``delivery`` (the loop's waits: :meth:`delivery_stats`), and
        ``store``: the task's ``consumed`` count, ``redelivered`` and ``waiting_consumers`` of
        the store, and this partition's ``samples`` held and
        ``closed``. Counts are not part of ``state_dict()``."""
        out: dict[str, Any] = dict(self._counts)
        out["skipped"], out["skipped_samples"] = self._skips.skipped, self._skips.samples
        out["failures"] = [list(row) for row in self._skips.failures]
        out["next_seconds"] = self._next_seconds
        out["in_flight"] = len(self._flight.ahead) + len(self._stage.handed)
        out["ended"] = self._at_end()
        out["epoch"], out["delivery"] = 0, self.delivery_stats()
        store = self.store.stats()
        out["versions"] = self._version.stats(store, self.task, self.partition)
        part = store["partitions"].get(self.partition, {})
        out["store"] = {
            "consumed": store["consumed"].get(self.task, 0),
            "redelivered": store["redelivered"],
            "waiting_consumers": store["waiting_consumers"],
            "samples": part.get("samples", 0),
            "closed": part.get("closed", False),
        }
        return out

    def set_version(self, version: int) -> None:
        """The trainer's weights are now at policy ``version`` (an int, never lower): later
        requests serve no sample older than ``version - max_staleness`` (see
        :mod:`meshfeed.queue.loading.versions` for prefetching)."""
        self._version.set(version)

    def shutdown(self) -> None:
        """Cancel the requests waiting in the store (they consume nothing) and stop worker
        processes and threads; the plans of batches fetched ahead stay in the store (a loader
        restored from this one's state reads them). The loader cannot be iterated again.
        Idempotent."""
        if self._shut:
            return
        self._shut = True
        self._stage.stop()
        if self._ahead_max:
            # The store may be gone already (a killed Ray actor): nothing waits in it then.
            with contextlib.suppress(Exception):
                self.store.cancel(self._spec.token)
        self._flight.stop_workers()

    _relayout = rebuild  # resize(): the elastic resume, on the same object (meshfeed.relayout)

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The state as of the last batch returned (module docstring): taken at once, the
        batches in flight untouched (the store keeps their plans), the same on every rank."""
        requested = max(self._flight.next, self._returned, self._redeliver)
        return envelope(
            KIND,
            VERSION,
            task=self.task,
            partition=self.partition,
            data_world_size=self.data_world_size,
            batch_size=self.batch_size,
            unit=self._unit,
            replica_size=len(self.replica_group),
            next=self._returned,
            requested=requested,
            ended=self._finished,
            policy_version=self._version.version,  # set_version's (loader_versions)
            # the versions the batches in flight were asked with: asked again with the same
            asked_versions=self._flight.asked_versions(self._returned, requested),
        )

    def load_state_dict(self, state: Any) -> None:
        """Continue from ``state``; the store must be at the same moment (restored from a
        checkpoint saved between the same two batches, or the live store the state was taken
        from). Every field is checked against this loader (task, partition, global batch,
        groups) and itself. On another layout (data ranks or replica peers) with the same
        global batch, the store first moves the plans in flight to this one
        (:meth:`SampleStore.replan`; see :mod:`meshfeed.queue.loading.resume`)."""
        st = open_state(
            state,
            task=self.task,
            partition=self.partition,
            ranks=self.data_world_size,
            batch_size=self.batch_size,
            unit=self._unit,
        )
        nxt, ended = st["next"], st["ended"]
        if st["requested"] - nxt > self._keeps:
            raise ValueError(
                f"StoreLoader state has {st['requested'] - nxt} batches in flight, more than this "
                f"loader keeps ({self._keeps}); resume with the same prefetch, device and "
                "device_prefetch"
            )
        if self._flight.ahead or self._flight.next or self._shut or self._returned:
            raise ValueError(
                "load_state_dict must come before iteration starts; build a fresh loader"
            )
        check_moment(self.store.stats()["consumed"].get(self.task, 0), self.task, nxt, st)
        layout = (st["data_world_size"], st["replica_size"])
        if layout != (self.data_world_size, len(self.replica_group)):
            self.store.replan(
                self.partition, self.task, nxt, self.sampler, self.data_world_size, self._unit
            )
            # Where the old ranks saw the end, the new ones ask again: a short last round too
            # small for the old ranks may be served on fewer.
            ended = False
        self._version.restore(state.get("policy_version"))
        self._flight.next = self._returned = nxt
        self._flight.ended = self._finished = ended
        self._redeliver = st["requested"]
        self._flight.asked = dict(
            zip(range(nxt, st["requested"]), st["asked_versions"], strict=True)
        )
