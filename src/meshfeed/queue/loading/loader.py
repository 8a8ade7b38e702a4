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

Where batches are made. The loader runs the loop every door shares
(:mod:`meshfeed.queue.loading.walk`): batch ``j`` is one task, fetched from the store and
collated by a :class:`~meshfeed.queue.loading.fetch.StoreFetcher` on the loader's service, as a
``DataLoader``'s batches are made by its fetcher. ``service=`` takes any
:class:`~meshfeed.protocols.BoundedService` (:class:`~meshfeed.services.InProcessService`,
:class:`~meshfeed.services.ThreadService`, :class:`~meshfeed.services.WorkerService`); without
it, ``num_workers=K`` starts ``K`` worker processes, each ``prefetch`` batches ahead (as
``DataLoader``'s), ``prefetch=P > 1`` keeps ``P`` batches requested on one thread (the one
being returned included), and ``prefetch=1`` fetches in the caller's thread when asked
(nothing in flight when a checkpoint is taken). A worker process fetches itself: from a named Ray store it connects to
(``SampleStore.connect``; spawned), from the embedded store through the loader's process
(:mod:`meshfeed.queue.loading.reach`, which serves the requests in index order). A worker
that dies, or produces nothing within ``timeout`` (stuck, or stopped), raises
:class:`~meshfeed.runtime.WorkerError` within about ``timeout`` + 1 s with every worker
stopped; iterating the loader again starts fresh workers and continues with the batch that
failed.

``pin_memory`` / ``device`` deliver batches pinned / on the device, copied ahead on a
delivery thread as ``DataLoader`` does, the state still exact (a batch is consumed when it
is returned). ``stats()["delivery"]`` times the loop as every door does
(:mod:`meshfeed.telemetry`): the first wait of a walk includes starting the workers and the
ranks' start agreement, the ``fetch`` phase includes the time a request waited in the store
for producers, and a ``next()`` that raised (a ``TimeoutError``) adds its time to the next
batch's wait. ``warn_wait_share`` (0.25; None: never) sets when a loop waiting for data is
warned; the warning names the likely cause, producers slower than the trainer.
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
waits for the batches in flight): the index of the first batch not returned and how far its
requests may go (the loop grants them on its own thread, so that is the same on every rank), a
few hundred bytes whatever the mesh. The batches in flight are the store's
plans, kept in the store (and in its checkpoint); after ``load_state_dict`` they are read back
first. Every rank's state is the same (with a process group the ranks check at their first
``next()`` that they start at the same batch, built with the same settings: a rank that loaded
a stale state raises ``ValueError`` on every rank), and it loads on another number of data ranks with the
same global batch (elastic resume: :mod:`meshfeed.queue.loading.resume`). Save the store and
every loader's state between the same two batches; a store that outlives the trainer (a Ray
actor) serves a restored loader without being restored itself.
"""

from __future__ import annotations

import contextlib
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshfeed.loader_base import LoaderBase, check_num_epochs, is_concurrent_next
from meshfeed.options import LoaderOptions, OnError
from meshfeed.protocols import BoundedService
from meshfeed.queue.engine.dynamic import check_group_filter
from meshfeed.queue.engine.wakeups import check_timeout
from meshfeed.queue.loading.errors import CollateError, SkipLog, check_on_error
from meshfeed.queue.loading.fetch import Spec, StoreFetcher
from meshfeed.queue.loading.reach import LocalDoor, RayReach, Reach
from meshfeed.queue.loading.resume import KIND, VERSION, check_moment, open_state, unit_of
from meshfeed.queue.loading.versions import LoaderVersion, check_store, one_epoch
from meshfeed.queue.loading.walk import Walking
from meshfeed.queue.samplers import Sampler, mesh_sampler
from meshfeed.queue.store import Batch, SampleStore
from meshfeed.queue.validate import check_loader_arguments, check_loader_service
from meshfeed.relayout import rebuild
from meshfeed.runtime import WorkerError
from meshfeed.services.base import InProcessService
from meshfeed.services.thread import ThreadService
from meshfeed.services.workers import WorkerService
from meshfeed.state import envelope

#: The errors ``stats()`` counts, under their keys.
_COUNTED = {TimeoutError: "timeouts", CollateError: "collate_errors", WorkerError: "worker_errors"}
#: Worker processes: the store's own TimeoutError comes first, then the pool's.
_MARGIN = 0.25


class StoreLoader(LoaderBase, Walking):
    """Iterate batches of ``fields`` for ``task`` from ``partition`` of ``store``, as global
    ``rank`` of ``mesh`` (a :class:`DataMesh`, ``DeviceMesh``, dict of axis sizes, or
    ``None`` for the torchrun world; ``device_mesh=`` is the same argument under torch's
    name); see the module docstring for workers and checkpoints.

    ``timeout`` (seconds, default 300 as ``DataLoader``; ``math.inf``: no limit) bounds each
    wait for a batch (``TimeoutError``; the loader stays usable). ``collate_fn``: a picklable function of a :class:`Batch` applied to
    every batch (in worker processes when ``num_workers > 0``), retried on the same fetched
    batch ``collate_retries`` more times, never by fetching again; if it keeps failing,
    ``on_error="raise"`` (default) raises :class:`CollateError` naming the batch's ids and
    the loader keeps the batch, ``on_error="skip"`` drops it, agreed by every rank (needs the
    process group on a mesh of several ranks; see the module docstring); a ``SourceError`` or
    ``MemoryError`` (a damaged file) raises as itself at once, whatever ``on_error`` says, and
    the batch stays in the store's plan for the next call. Every rank
    must use the same ``batch_size``, sampler and batches ahead (``prefetch``, workers or
    service, delivery: how far ahead the loader asks decides at which step a rank sees the end
    of the stream), ``task``, ``partition``, ``fields``, ``on_error``, ``max_staleness`` and
    ``group_filter``: with a process group the ranks check them at their first ``next()``
    (``ValueError`` on every rank naming the setting; a shared store also checks
    ``batch_size`` and how far ahead replica peers ask). With a process group, a batch whose
    making raised on one rank makes the others raise :class:`~meshfeed.errors.RankError` at
    the same batch, naming that rank and its error (:mod:`meshfeed.queue.loading.errors`).
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
    #: What the wait warning (``warn_wait_share``) names: a trainer fed by rollout producers
    #: waits for them, which workers or a faster ``collate_fn`` do not shorten.
    wait_hint = (
        "likely cause: the producers put samples slower than the trainer takes them (see "
        "loader.stats()['store']: samples held, waiting_consumers; the 'fetch' phase of "
        "loader.stats()['delivery'] includes the wait in the store): add producers, or pass "
        "warn_wait_share=None where the trainer waits for them by design"
    )

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
        warn_wait_share: float | None = 0.25,
        max_staleness: int | None = None,
        group_filter: Callable[[dict[str, list[Any]]], bool] | None = None,
        service: BoundedService | None = None,
    ) -> None:
        given = dict(locals())  # the arguments resize() builds the loader again from
        placed = ("self", "__class__", "store", "batch_size", "mesh", "device_mesh", "rank")
        self._arguments = {k: v for k, v in given.items() if k not in placed}
        check_store(store)
        on_error = "raise" if on_error is None else on_error
        options = LoaderOptions(
            batch_size=batch_size,
            shuffle=False,  # the store decides the order: no seed, no shuffle
            num_workers=num_workers,
            prefetch=prefetch,
            collate_fn=collate_fn,
            timeout=timeout,
            on_error=on_error,
            pin_memory=pin_memory,
            device=device,
            device_prefetch=device_prefetch,
            on_step=on_step,
            warn_wait_share=warn_wait_share,
        )
        check_loader_arguments(
            task=task, fields=fields, partition=partition, collate_retries=collate_retries
        )
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None (got {collate_fn=!r})")
        check_loader_service(store, num_workers, service, prefetch)
        super().__init__(options, mesh=mesh, device_mesh=device_mesh, rank=rank)
        self.telemetry.hint = self.wait_hint  # what the wait warning names (a store's cause)
        self.on_error: OnError = check_on_error(on_error, self.mesh.world_size)
        self._skips = SkipLog()
        self.replica_group = self.mesh.replica_group(self.rank)
        self.sampler = mesh_sampler(sampler, self.mesh, self.rank)
        check_group_filter(group_filter, self.sampler)
        self._unit = unit_of(self.sampler)
        self.store, self.task, self.fields = store, task, list(fields)
        self.partition, self.collate_retries = partition, collate_retries
        wait = check_timeout(timeout)
        self._version = LoaderVersion(max_staleness)  # checked before anything is started
        self.service: BoundedService = service or self._default_service(wait)
        #: Most batches in flight (taken by the service, or by the delivery thread, and not
        #: returned): the loop grants requests this far ahead of the first batch not returned
        #: (:meth:`_grant`), and every request acknowledges the batches this far behind it.
        self._keeps = self.service.in_flight + (device_prefetch + 1) * self.delivery.ahead
        spec = Spec(
            task, tuple(fields), batch_size, partition, self.sampler, wait, self._keeps,
            group_filter,
        )  # fmt: skip
        self._door = self._open_door()  # its threads and socket: the last step that may fail
        try:
            self.fetcher = StoreFetcher(store, spec, collate_fn, collate_retries, self._reach())
        except BaseException:
            if self._door is not None:
                self._door.close()
            raise
        # What stats() reports (since this object was built; not part of the state).
        self._counts = dict.fromkeys(
            ("batches", "samples", "timeouts", "collate_errors", "worker_errors", "redelivered"), 0
        )
        self._next_seconds = 0.0
        self._shut = self._started = False
        self._finished = False  # every batch returned and the end seen (StopIteration)
        self._start_walking()

    def _default_service(self, wait: float | None) -> BoundedService:
        if self.num_workers:
            return WorkerService(
                int(self.num_workers),
                prefetch=self.prefetch,
                # A fetch waits in the store up to `timeout` and raises TimeoutError there;
                # the pool's own limit (a stuck or stopped worker) comes just after.
                timeout=None if wait is None else wait + _MARGIN,
                # Ray: spawn (fork is unsafe under Ray; each worker connects to the store, which
                # counts against the first batch's timeout). Embedded: the platform's default.
                start_method="spawn" if self.store.backend == "ray" else None,
                name="meshfeed-store-worker",
                grace=0.25,
                max_chunk=1,  # a batch travels as soon as it is made, never behind a later one
            )
        if self.prefetch > 1:
            return ThreadService(self.prefetch, name="meshfeed-loader")
        return InProcessService()

    def _open_door(self) -> LocalDoor | None:
        """The embedded store, served to worker processes (none for an in-process service)."""
        if self.store.backend != "embedded" or isinstance(
            self.service, (InProcessService, ThreadService)
        ):
            return None
        return LocalDoor(self.store)

    def _reach(self) -> Reach | None:
        if self._door is not None:
            return self._door.reach
        if self.store.backend == "ray" and self.store.name is not None:
            import ray

            return RayReach(ray.get_runtime_context().gcs_address, self.store.name)
        return None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._shut:
            raise self._shut_down_error()
        start = time.perf_counter()
        if self._stream is None and not self._finished:
            # A new walk: its first wait starts now, and includes what comes before the
            # delivery stage times anything (the ranks' agreement, starting the workers).
            self.telemetry.asked(start)
        if not self._start_agreed:  # with a process group: every rank starts here (walk.py)
            self._agree_start()
        if self._finished:
            raise StopIteration
        if not self._started:
            self.service.start(self.fetcher)
            self._started = True
        if self._stream is None:
            self._stream = Walking._walk(weakref.proxy(self))  # no cycle: see walk.py
        self._refused = False
        try:
            return next(self._stream)
        except BaseException as error:
            if isinstance(error, ValueError) and is_concurrent_next(error):
                # Another thread's next() runs the walk: leave it (and the state) be.
                raise self._concurrent_next_error() from None
            self._stream = None  # a walk that raised is over: the next call walks again
            for kind, key in _COUNTED.items():
                self._counts[key] += isinstance(error, kind)
            if not (isinstance(error, StopIteration) or self._shut or self._refused):
                # The loop waited for data in this call (a TimeoutError while the producers
                # are late): that counts in the wait of the next batch returned.
                self.telemetry.raised(time.perf_counter() - start)
            if isinstance(error, StopIteration | RuntimeError) and self._shut:
                # shutdown() from another thread halted the walk (not the end of the stream),
                # or stopped its service as the walk started it. The service may have
                # started after shutdown() looked (idempotent).
                self.service.shutdown()
                raise self._shut_down_error() from (
                    None if isinstance(error, StopIteration) else error
                )
            if isinstance(error, StopIteration):
                self._finish()
            raise
        finally:
            self._next_seconds += time.perf_counter() - start

    def _shut_down_error(self) -> RuntimeError:
        return RuntimeError(
            f"this StoreLoader (task {self.task!r}) was shut down; build a new one (from "
            "its state_dict() to continue where it stopped)"
        )

    def _finish(self) -> None:
        """The end was reached with every batch returned: once, tell the store this reader
        passed every batch it asked for, so the last plans go once every reader has."""
        if self._finished:
            return
        self._finished = True
        with contextlib.suppress(Exception):  # the store may be gone (a killed Ray actor)
            self.store.passed(self.partition, self.task, self.sampler, self._requested)

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
        if num_epochs == 1 and not self._finished:
            yield 0

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
        out["in_flight"] = 0 if self._finished else self._in_flight()
        out["ended"] = self._finished
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
        Idempotent. Called from ``on_step``, the loader's threads (fetch, delivery) are gone
        when this returns, and that ``next()`` returns its batch (counted already: on_step saw
        it); from another thread during a ``next()``, that ``next()`` ends them and raises the
        shutdown error in place of a batch not yet counted."""
        if self._shut:
            return
        self._shut = True
        token, halt = self._walking
        halt.set()
        if token is not None:
            with contextlib.suppress(Exception):  # the store may be gone (a killed Ray actor)
                self.store.cancel(token)  # a request waiting, on whichever thread, wakes now
        stream, self._stream = self._stream, None
        if isinstance(stream, types.GeneratorType) and not stream.gi_running:
            stream.close()
        else:  # running: from its on_step, its stage closes now; from another thread, it ends
            self._close_suspended_stage()  # with the next() in progress
        if self._started:
            self.service.shutdown()
        if self._door is not None:
            self._door.close()

    def _in_flight(self) -> int:
        """Batches requested (not past the end) and not returned."""
        upto = self._requested if self._end_at is None else min(self._requested, self._end_at)
        return max(0, upto - self._returned)

    _relayout = rebuild  # resize(): the elastic resume, on the same object (meshfeed.relayout)

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The state as of the last batch returned (module docstring): taken at once, the
        batches in flight untouched (the store keeps their plans), the same on every rank."""
        asked = dict(self._asked)  # a copy: the service's thread may request meanwhile
        requested = max(self._granted, self._returned, self._redeliver)
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
            asked_versions=[asked.get(i) for i in range(self._returned, requested)],
        )

    def load_state_dict(self, state: Any) -> None:
        """Continue from ``state``; the store must be at the same moment (restored from a
        checkpoint saved between the same two batches, or the live store the state was taken
        from). Every field is checked against this loader (task, partition, global batch,
        groups) and itself. On another layout (data ranks or replica peers) with the same
        global batch, the store first moves the plans in flight to this one
        (:meth:`SampleStore.replan`; see :mod:`meshfeed.queue.loading.resume`)."""
        st = self._checked_state(state, self.data_world_size, self.batch_size)
        if self._requested or self._shut or self._returned:
            raise ValueError(
                "load_state_dict must come before iteration starts; build a fresh loader"
            )
        nxt, ended = st["next"], st["ended"]
        # Every check passed: only now does anything change (a refused state changes neither
        # this loader nor the store).
        layout = (st["data_world_size"], st["replica_size"])
        if layout != (self.data_world_size, len(self.replica_group)):
            self.store.replan(
                self.partition, self.task, nxt, self.sampler, self.data_world_size, self._unit
            )
            # Where the old ranks saw the end, the new ones ask again: a short last round too
            # small for the old ranks may be served on fewer.
            ended = False
        self._version.restore(st["policy_version"])
        self._requested = self._granted = self._returned = nxt
        self._finished = ended
        self._end_at = nxt if ended else None
        self._redeliver = st["requested"]
        self._from_start = False
        self._asked = dict(zip(range(nxt, st["requested"]), st["asked_versions"], strict=True))

    def _checked_state(self, state: Any, ranks: int, batch_size: int) -> dict[str, Any]:
        """The fields of ``state`` with every check of :meth:`load_state_dict` passed, for
        this loader on ``ranks`` data ranks x ``batch_size`` (its own layout, or the one
        ``resize()`` moves it to); changes nothing, so a refused state leaves the loader and
        the store as they were."""
        st = open_state(
            state,
            task=self.task,
            partition=self.partition,
            ranks=ranks,
            batch_size=batch_size,
            unit=self._unit,
        )
        nxt = st["next"]
        if st["requested"] - nxt > self._keeps:
            raise ValueError(
                f"StoreLoader state has {st['requested'] - nxt} batches in flight, more than this "
                f"loader keeps ({self._keeps}); resume with the same prefetch, device and "
                "device_prefetch"
            )
        check_moment(self.store.stats()["consumed"].get(self.task, 0), self.task, nxt, st)
        st["policy_version"] = LoaderVersion.check_restore(st.get("policy_version"))
        return st
