"""DataLoader: the front door for map-style data. Mesh -> order -> fetch -> batch -> deliver.

>>> loader = DataLoader(list(range(10)), batch_size=2, mesh={"dp": 2, "tp": 2}, rank=3)
>>> len(loader)          # 10 samples, global batch 2 * 2 = 4, last incomplete batch dropped
2
>>> [b.tolist() for b in loader] == [b.tolist() for b in DataLoader(
...     list(range(10)), batch_size=2, mesh={"dp": 2, "tp": 2}, rank=2)]   # tp peers agree
True
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any, Literal, NoReturn

import numpy as np

from meshfeed.dist import fail_together, is_distributed
from meshfeed.errors import CollectiveError
from meshfeed.fetch import MAX_REPORTED_FAILURES, Fetcher, FetchEvents, FetchTask, OnError
from meshfeed.loader_base import LoaderBase, is_concurrent_next
from meshfeed.loader_state import COUNTS, LOADER_STATE_VERSION, encode_stats, read_state
from meshfeed.mesh import mesh_hash
from meshfeed.options import LoaderOptions, build_dataset, check_not_a_path, dataset_length
from meshfeed.order.batches import Step, order_hooks
from meshfeed.order.rampup_plan import check_ahead, make_plan, resized
from meshfeed.ordering import build_order, curriculum_postprocess
from meshfeed.protocols import GlobalService, Service, Source
from meshfeed.relayout import check_divides, relayout
from meshfeed.services.auto import AutoService
from meshfeed.services.base import InProcessService
from meshfeed.services.distributed import DistributedService
from meshfeed.services.workers import WorkerService
from meshfeed.sources.streams.count import wait_limit
from meshfeed.state import dataset_fingerprint, envelope, fingerprint_hash
from meshfeed.telemetry import StepTiming, Telemetry

__all__ = ["LOADER_STATE_VERSION", "DataLoader"]

#: How many upcoming steps' indices are computed in one vectorised order call.
_INDEX_BLOCK_STEPS = 256
_REPLAN_FIX = (
    "call mix.reweight(step, weights) with the same arguments on every rank, between the same "
    "two batches (not in a callback that runs on some ranks only)"
)


class DataLoader(LoaderBase):
    """A mesh-aware, deterministic, exactly resumable loader for map-style datasets.

    ``batch_size`` is per data rank; the global batch is ``batch_size * data_world_size``.
    Every data rank walks the same global batches (a pure function of seed, epoch and
    position) and takes its contiguous slice; tensor / context / pipeline peers compute the
    same slice, so no broadcast is needed. ``state_dict()`` is a small JSON dict; loading it
    continues exactly, also on a different data-parallel size with the same global batch.

    A :class:`~meshfeed.sources.ShardedStream` is read the same way (it is a map-style source
    with an order of its own; :class:`~meshfeed.StreamLoader` is this loader under the
    name stream users know). A path is not a dataset: open it first (e.g.
    ``TokenWindows(path, seq_len=...)``).

    A new ``iter()`` continues from the current position (exact resumption); an epoch that
    was iterated to its end advances to the next epoch. ``set_epoch(e)`` with a different
    epoch restarts at the beginning of epoch ``e``. One iterator is live at a time: a new
    ``iter()``, ``set_epoch``, ``load_state_dict``, ``resize`` or ``shutdown`` stops the
    earlier one, which raises on its next ``next()`` (see :mod:`meshfeed.loader_base`). With
    a process group, every ``iter()`` checks that all ranks start at the same epoch and
    position (:meth:`DistributedService.agree <meshfeed.services.DistributedService.agree>`),
    and so does every walk started again after a re-plan (a ``Mixture`` reweighted mid-epoch,
    which every rank must do between the same two batches). Resume with
    ``for epoch in loader.epochs(n): for batch in loader: ...``.

    ``on_error`` (default ``"substitute"``) handles samples that raise or are rejected (see
    :mod:`meshfeed.fetch`); the first such sample of a run is logged as a warning on the
    ``"meshfeed"`` logger. With ``on_error="raise"`` and a process group of several ranks, a
    rank whose batch raises raises its error and every other rank raises
    :class:`~meshfeed.errors.RankError` at the same step (one ``all_reduce`` of one int per
    step, made only in this case), so none is left waiting in its next collective. A damaged
    file (:class:`~meshfeed.errors.SourceError`, ``MemoryError``) always raises.

    ``drop_last=True`` (default) drops the last incomplete global batch of each epoch. With
    ``drop_last=False`` it is served; when it does not divide among the data ranks,
    ``pad_last=True`` (default) serves every sample and pads a last batch smaller than the
    number of data ranks by wrapping around to the epoch's first samples (counted in
    ``stats()["padded"]``), while ``pad_last=False`` truncates it to a multiple of the data
    ranks so every rank reads the same number of samples, none twice (torchdata
    ``DataLoader2``'s behaviour: 41 samples on 4 data ranks give 10 each, one left out).

    ``timeout`` bounds every wait for a worker and for the other ranks (the plan agreement
    before the first batch, the per-step check of ``on_error="raise"``), in seconds; a rank that
    died or stalled is a :class:`~meshfeed.errors.CollectiveError` here within about
    ``timeout``. ``math.inf`` waits without limit.

    ``pin_memory`` / ``device`` deliver batches pinned / on the device, copied ahead on a
    delivery thread (:mod:`meshfeed.delivery`); ``stats()["delivery"]`` times the loop's waits,
    ``on_step`` sees every step. ``num_workers="auto"``: see :mod:`meshfeed.services.auto`.

    ``dataset`` may also be a function (or class) that builds the dataset, Twinkle's call shape:
    it is called where batches are made (here, or inside every Ray actor with
    ``service=RayService(...)``). ``device_mesh=`` is the same argument as ``mesh=`` under the
    name torch and Twinkle users know; under torchrun neither is needed (the world size and rank
    come from the environment).

    ``rampup=(start, increment, samples)`` grows the global batch as Megatron's
    ``--rampup-batch-size`` does, equal steps on every rank (:mod:`meshfeed.order.rampup`).
    """

    name = "DataLoader"

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        mesh: Any = None,
        device_mesh: Any = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_last: bool = True,
        num_workers: int | Literal["auto"] = 0,
        prefetch: int = 2,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        timeout: float = 300.0,
        on_error: OnError | None = None,
        max_retries: int = 0,
        curriculum: Any = None,
        service: Service | GlobalService | None = None,
        multiprocessing_context: str | None = None,
        device: Any = None,
        device_prefetch: int = 2,
        on_step: Callable[[StepTiming], Any] | None = None,
        warn_wait_share: float | None = 0.25,
        rampup: Any = None,
    ) -> None:
        check_not_a_path(dataset)
        options = LoaderOptions(
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad_last=pad_last,
            num_workers=num_workers,
            prefetch=prefetch,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            timeout=timeout,
            on_error=on_error,
            max_retries=max_retries,
            multiprocessing_context=multiprocessing_context,
            device=device,
            device_prefetch=device_prefetch,
            on_step=on_step,
            warn_wait_share=warn_wait_share,
            rampup=rampup,
        )
        options.check_service(service)
        super().__init__(
            options,
            mesh=mesh,
            device_mesh=device_mesh,
            rank=rank,
            serves_every_rank=isinstance(service, GlobalService),
        )
        self.on_error: OnError = options.on_error or "substitute"
        dataset = self._where_batches_are_made(dataset, service)
        with wait_limit(self.wait_timeout):  # a stream counting its rows waits within timeout
            length = dataset_length(dataset)
        self.dataset = dataset
        self.global_batch_size = batch_size * self.data_world_size
        self.dataset_length = length
        self.fingerprint = dataset_fingerprint(dataset)
        self.order = build_order(
            dataset,
            curriculum=curriculum,
            dataset_length=length,
            global_batch_size=self.global_batch_size,
            seed=seed,
            shuffle=self.shuffle,
            rampup=options.rampup,
        )
        self.hooks = order_hooks(self.order)
        if curriculum is not None and self.on_error == "substitute":
            self.bad_samples_note = (
                "a substitute is not gated by the curriculum (a worker does not hold the "
                "eligible pool): filter before indexing the metric, or use on_error='skip'"
            )
        self.plan = make_plan(self.order, options, data_world_size=self.data_world_size)
        self._check_some_batch(length)
        self.fetcher = Fetcher(
            dataset,
            seed=seed,
            collate_fn=collate_fn,
            postprocess=curriculum_postprocess(curriculum),
            on_error=self.on_error,
            max_retries=max_retries,
        )
        self.service: Service | GlobalService = service or self._default_service(
            multiprocessing_context
        )
        #: The loader decides its service's grouping (its own service, or one it resized): a
        #: process group formed after that is joined at the next walk (:meth:`_join_group`).
        self._groups = service is None
        self._started = False
        self._position = 0
        self._stats: dict[str, Any] = {**dict.fromkeys(COUNTS, 0), "failures": []}
        self._index_cache: tuple[int, dict[int, tuple[np.ndarray, np.ndarray]]] | None = None
        #: The running walk's delivery stage: (walk generation, the thread walking, the stage's
        #: stop flag, the stage), for a shutdown() during a next() (see _close_stage).
        self._stage: tuple[int, int, threading.Event, weakref.ref[Any]] | None = None

    # ------------------------------------------------------------------ construction helpers
    def _where_batches_are_made(self, dataset: Any, service: Any) -> Any:
        """The dataset the loader measures: a Ray service's stand-in (the dataset is built in
        its actors), a callable's product (Twinkle's call shape), or ``dataset`` itself."""
        if service is not None and not isinstance(service, (Service, GlobalService)):
            raise TypeError(
                f"service={type(service).__name__} is neither a meshfeed.protocols.Service "
                "(start, map, shutdown) nor a GlobalService (bind_mesh, prepare, start, "
                "map_global, shutdown); pass e.g. RayService(...), or num_workers=N for worker "
                "processes"
            )
        if isinstance(service, GlobalService):
            service.bind_mesh(self.mesh)  # RayService: RemoteBatch.for_rank maps global ranks
            return service.prepare(dataset)  # a callable is built inside the Ray actors
        if isinstance(dataset, type) or (callable(dataset) and not isinstance(dataset, Source)):
            # A callable that makes the dataset (Twinkle's call shape) is built where the
            # batches are made: here, or in every Ray actor with service=RayService(...).
            return build_dataset(dataset)
        return dataset

    def _check_some_batch(self, length: int) -> None:
        """Refuse a configuration under which no batch would ever be produced."""
        if not self.pad_last and self.plan.steps(0) == 0:
            raise ValueError(
                f"the dataset ({length} samples) has fewer samples than data ranks "
                f"({self.data_world_size}); with pad_last=False no batch would ever be "
                "produced. Use pad_last=True (pads by wrapping) or fewer data ranks"
            )
        if self.drop_last and self.plan.steps(0) == 0:
            raise ValueError(
                f"the dataset ({length} samples) is smaller than one global batch (batch_size="
                f"{self.batch_size} x data_world_size={self.data_world_size}); with drop_last=True "
                "no batch would ever be produced. Use a smaller batch_size or drop_last=False"
            )

    def _default_service(self, start_method: str | None) -> Service:
        inner: Service
        if self.num_workers == "auto":
            inner = AutoService(
                prefetch=self.prefetch, timeout=self.wait_timeout, start_method=start_method
            )
        elif self.num_workers > 0:
            inner = WorkerService(
                self.num_workers,
                prefetch=self.prefetch,
                timeout=self.wait_timeout,
                start_method=start_method,
            )
        else:
            inner = InProcessService()
        return self._grouped(inner)

    def _grouped(self, inner: Service) -> Service:
        """``inner``, behind the ranks' agreement check when a process group of several runs."""
        if is_distributed():
            return DistributedService(inner, agreement=self._agreement(), timeout=self.wait_timeout)
        return inner

    def _join_group(self) -> None:
        """Put the loader's service behind the ranks' agreement check when a process group of
        several ranks was initialised after that was decided (the loader built, or resized with
        a mesh, before ``init_process_group``): its walks are agreed as if built in it."""
        service = self.service
        if (
            self._groups
            and isinstance(service, Service)
            and not isinstance(service, DistributedService)
        ):
            self.service = self._grouped(service)

    def _agreement(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "dataset_length": self.dataset_length,
            "dataset_fingerprint": fingerprint_hash(self.fingerprint),
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
            "pad_last": int(self.pad_last),
            # Whether every step makes the ranks' per-step check (a collective): one rank with
            # it would wait in a collective the others never make.
            "on_error": int(self.on_error == "raise"),
            **self.plan.facts(),
        }

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Steps per epoch on this rank (the same on every rank)."""
        return self.plan.steps(self._epoch)

    @property
    def position(self) -> int:
        """Global samples of the current epoch consumed so far (as of the last batch returned)."""
        return self._position

    def _enter_epoch(self, epoch: int) -> None:
        check_ahead(self.plan, epoch, 0)  # a ramp resized past: its start may not divide here
        self._epoch, self._position = epoch, 0

    def _block(self, step: Step) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """This rank's (positions, indices) for the next block of steps (cached)."""
        cache = self._index_cache
        if cache is not None and cache[0] == step.epoch and step.start in cache[1]:
            return cache[1]
        start = time.perf_counter()  # the plan's work: once per block of steps
        block = self.plan.rank_block(step, self.data_rank, self.data_world_size, _INDEX_BLOCK_STEPS)
        self.telemetry.add("plan", time.perf_counter() - start)
        self._index_cache = (step.epoch, block)
        return block

    def _steps(self, epoch: int, position: int, steps: list[Step]) -> Iterator[Step]:
        """The steps of ``epoch`` from ``position``, each appended to ``steps`` when planned."""
        while (step := self.plan.step_at(epoch, position)) is not None:
            steps.append(step)
            yield step
            position = step.end

    def _tasks(self, epoch: int, position: int, steps: list[Step]) -> Iterator[FetchTask]:
        """This rank's task of each step of ``epoch`` from ``position`` (:meth:`_steps` and
        each step's task in one generator: one frame less to resume per batch)."""
        while (step := self.plan.step_at(epoch, position)) is not None:
            steps.append(step)
            positions, indices = self._block(step)[step.start]
            yield FetchTask(step.epoch, step.index, indices, positions)
            position = step.end

    def __iter__(self) -> Iterator[Any]:
        # A new walk generation: the earlier live iterator stops (see meshfeed.loader_base).
        walk = self._supersede(
            "was iterated again (a new iter(loader))",
            "one loader has one live iterator, and the new one continues from the last batch "
            "this one returned. Keep one iterator per loader (finish or drop it before "
            f"iterating again), or build a second {self.name} to read the data twice",
        )
        live = _LiveWalk(self, walk, self._iterate(walk))
        self._live = weakref.ref(live)
        return live

    def _iterate(self, walk: int) -> Generator[Any, None, None]:
        """The batches of walk generation ``walk``: the rest of the current epoch."""
        # Runs on the walk's first next(): its wait starts now, and includes what comes before
        # the delivery stage times anything (the ranks' agreement, starting the workers, the
        # service draining what a dropped walk left in flight).
        self.telemetry.asked(time.perf_counter())
        epoch = self._epoch
        self._join_group()
        if isinstance(self.service, DistributedService):  # the ranks start at the same place
            self._agree(self.service, replanned=False)
        if not self._started:
            self.service.start(self.fetcher)
            self._started = True
        # A walk ends early when the order was re-planned at a step not yet returned (a
        # reweighted mixture): what was planned or prefetched from there is dropped and the
        # walk starts again at the first batch not returned, agreed again by the ranks (one
        # collective per re-plan), which must all have re-planned at the same step.
        while (yield from self._walk(walk, epoch, self._position)):
            if isinstance(self.service, DistributedService):
                self._agree(self.service, replanned=True)
        # The epoch was iterated to its end: the next iter() starts the next epoch.
        if self._walks == walk and self._epoch == epoch:
            self._epoch, self._position = epoch + 1, 0

    def _walk_facts(self, *, replanned: bool = False) -> dict[str, int]:
        """Where a walk starts, and on which mesh, which every rank of a process group must
        agree on (ranks built with different meshes of one world and global batch would
        read the same samples); ``replanned``: a walk started again after a re-plan."""
        described = self.hooks.describe(self._epoch, self._position)
        order = 0 if described is None else fingerprint_hash(json.dumps(described, sort_keys=True))
        return {
            "epoch": self._epoch,
            "position": self._position,
            "order": order,
            "data_world_size": self.data_world_size,
            "mesh": mesh_hash(self.mesh),
            "replanned": int(replanned),
        }

    def _agree(self, service: DistributedService, *, replanned: bool) -> None:
        """The ranks' agreement on where this walk starts (:meth:`_walk_facts`), its error
        naming a re-plan where one is the likely cause: a Mixture reweighted on some ranks
        only, whose order the other ranks never re-plan (they take no collective there)."""
        try:
            service.agree(self._walk_facts(replanned=replanned))
        except CollectiveError as exc:
            if not replanned:
                raise
            raise CollectiveError(
                f"{exc}. This rank re-planned its order at position {self._position} of epoch "
                f"{self._epoch} (its Mixture's weights changed: reweight) and the other ranks "
                f"did not join its agreement on that: if they did not re-plan, {_REPLAN_FIX}",
                this_rank=exc.this_rank,
                reason=exc.reason,
                elapsed=exc.elapsed,
            ) from exc
        except ValueError as exc:
            # "replanned=" names each rank's value where that fact differs (the ranks' message).
            if not replanned and "replanned=" not in str(exc):
                raise
            raise ValueError(
                f"{exc}. Here a rank re-planned its order mid-epoch (its Mixture's weights "
                f"changed: reweight) where another did not, or to other weights: {_REPLAN_FIX}"
            ) from None

    def _walk(self, walk: int, epoch: int, position: int) -> Generator[Any, None, bool]:
        """Yield the batches of ``epoch`` from ``position``; True when re-planned (see above)."""
        steps: list[Step] = []
        results: Iterator[tuple[Any, Any]]
        if isinstance(self.service, GlobalService):
            results = self._run_global(self.service, epoch, position, steps)
        else:
            # A weak proxy: the service's (or delivery) thread runs this generator, and a
            # strong reference from there would keep a dropped loader, and the walk that would
            # stop that thread, alive for good (an on_step or iterator kept in a cycle).
            results = self.service.map(
                type(self)._tasks(weakref.proxy(self), epoch, position, steps)
            )
        agree = self.on_error == "raise" and is_distributed()  # one rank raises: every rank
        if agree and not self.delivery.ahead:
            results = self._together(results, epoch, steps)  # timed as the batch's wait
        stop = threading.Event()
        stage = self.delivery.stage(results, stop=stop)  # pinned / on the device, timed
        self._stage = (walk, threading.get_ident(), stop, weakref.ref(stage))
        delivered: Iterator[tuple[Any, Any]] = stage
        if agree and self.delivery.ahead:
            # On this thread, once per batch taken, never on the delivery thread: it runs
            # ahead by a number of batches that differs between ranks when the walk ends, so
            # it left one rank in a collective the others never made (the next mismatched).
            delivered = self._together(stage, epoch, steps)
        try:
            return (yield from self._returned(walk, epoch, steps, delivered))
        finally:
            if isinstance(delivered, Generator):  # the agreement over the stage
                delivered.close()
            stage.close()
            held = self._stage
            if held is not None and held[2] is stop:
                self._stage = None

    def _together(
        self, items: Iterator[tuple[Any, Any]], epoch: int, steps: list[Step]
    ) -> Iterator[tuple[Any, Any]]:
        """``items`` with the ranks' per-step agreement (:func:`meshfeed.dist.fail_together`)."""
        return fail_together(
            items,
            timeout=self.wait_timeout,
            where=lambda: f"step {steps[0].index} of epoch {epoch}",
        )

    def _close_stage(self, walk: int) -> None:
        """Stop the delivery stage of walk generation ``walk``, whose generator runs (a
        ``shutdown()`` during its ``next()``, see :meth:`_LiveWalk.close`): its delivery thread
        ends after the batch it is making. On the walk's own thread (``on_step``), where the
        stage waits unused, it is closed now: its thread joined, what it prefetched dropped."""
        stage = self._stage
        if stage is None or stage[0] != walk:
            return
        _, thread, stop, ref = stage
        stop.set()  # from any thread: no generator is touched
        delivered = ref()
        if thread == threading.get_ident() and delivered is not None:
            with contextlib.suppress(ValueError):  # running (a dataset that shuts it down)
                delivered.close()

    def _returned(
        self, walk: int, epoch: int, steps: list[Step], delivered: Iterator[tuple[Any, Any]]
    ) -> Generator[Any, None, bool]:
        """Count each delivered batch as returned (position, stats, order hooks), yield it.

        ``on_step`` runs once the batch is counted (it sees the new position); if it raises,
        the count is taken back (its phases too) and the batch is served again by the next
        walk. A batch that arrives once the walk was superseded (``shutdown()`` on another
        thread while this ``next()`` waited) is not counted: the superseded error is raised."""
        stale_from: int | None = None
        replanned, returned = self.hooks.replanned, self.hooks.returned
        for batch, events in delivered:
            if walk != self._walks:
                raise self._superseded_error()
            step = steps.pop(0)
            if replanned is not None:
                changed = replanned(epoch)
                if changed is not None:
                    self._index_cache = None
                    stale_from = changed if stale_from is None else min(stale_from, changed)
                if stale_from is not None and step.end > stale_from:
                    return True
            before = self._position, _counts_of(self._stats)
            if step.end - step.start < self.data_world_size:  # padding: a tiny last batch only
                self._count_padding(step)
            if isinstance(events, list):
                for e in events:
                    self._record(e)
            else:
                self._record(events)
            self._position = step.end
            try:
                self.telemetry.returned()  # on_step, which sees this batch counted
            except BaseException:
                self._position = before[0]
                _restore_counts(self._stats, before[1])
                _take_back(self.telemetry, events)  # made again by the next walk: once
                raise
            if returned is not None:
                returned(epoch, step.end)
            yield batch
        return False

    def _run_global(
        self, service: GlobalService, epoch: int, position: int, steps: list[Step]
    ) -> Iterator[tuple[Any, list[FetchEvents]]]:
        """For services that serve every data rank at once (Ray): one task list per step."""
        global_tasks = (
            [
                FetchTask(epoch, step.index, indices, positions)
                for positions, indices in self.plan.global_indices(step, self.data_world_size)
            ]
            for step in self._steps(epoch, position, steps)
        )
        return iter(service.map_global(global_tasks))

    def _count_padding(self, step: Step) -> None:
        """Count the samples of ``step`` that repeat the start of the epoch: this rank's, or
        with a service of every data rank (Ray) every rank's it serves."""
        # Padding exists only in a last batch shorter than the number of data ranks (the
        # caller checks this too, sparing the call per batch).
        if step.end - step.start < self.data_world_size:
            ranks = range(self.data_world_size) if self._serves_every_rank else (self.data_rank,)
            padded = sum(self.plan.rank_padding(step, r, self.data_world_size) for r in ranks)
            self._stats["padded"] += padded
            self._note_padding(padded)

    def _record(self, events: FetchEvents) -> None:
        phases = self.telemetry.phases  # Telemetry.add's work, without two calls per batch
        phases["fetch"] += events.fetch_s
        phases["collate"] += events.collate_s
        if events:
            self._stats["retries"] += events.retries
            self._stats["substituted"] += events.substituted
            self._stats["skipped"] += events.skipped
            room = MAX_REPORTED_FAILURES - len(self._stats["failures"])
            self._stats["failures"].extend(events.failures[: max(room, 0)])
            self._note_bad_samples(
                events.substituted + events.skipped,
                events.failures[0] if events.failures else None,
            )

    def stats(self) -> dict[str, Any]:
        """Counts of retries, substitutions, skips and padded samples, and the first failures.

        ``failures`` lists the first :data:`~meshfeed.fetch.MAX_REPORTED_FAILURES` bad
        samples as dicts (index, position, attempt, error, message); ``delivery`` the loop's
        waits and where batch time went (:meth:`delivery_stats`).
        """
        out = {k: (list(v) if isinstance(v, list) else v) for k, v in self._stats.items()}
        out["epoch"], out["position"] = self._epoch, self._position
        out["delivery"] = self.delivery_stats()
        described = self.hooks.describe(self._epoch, self._position)
        if described is not None:
            out["order"] = dict(described)
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The state as of the last batch returned: a small JSON-serialisable dict.

        Also a ``torch.distributed.checkpoint`` ``Stateful``: every list in it is a leaf
        (failures are rows ``[index, position, attempt, error, message]``). The state is the
        run's, not a rank's: its keys are the same on every rank (a run on another
        data-parallel size loads it), so DCP writes one rank's copy and every rank restores
        that position and those stats. That is exact when every rank saves at the same step,
        as SPMD training does; ranks that took different numbers of steps are not told apart
        (a rank knows only its own position, and a collective here would hang a rank that
        calls ``state_dict()`` alone).
        """
        fields: dict[str, Any] = {
            "seed": self.seed,
            "epoch": self._epoch,
            "position": self._position,
            "global_batch_size": self.global_batch_size,
            "data_world_size": self.data_world_size,
            "dataset_length": self.dataset_length,
            "fingerprint": self.fingerprint,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad_last": self.pad_last,
            "stats": encode_stats(self._stats),
            **self.plan.facts(),
            # Always present, like order_facts below: a checkpoint loaded through
            # torch.distributed.checkpoint keeps only the keys the loading loader's state has.
            "ramped": int(bool(self.plan.facts())),
        }
        described = self.hooks.describe(self._epoch, self._position)
        fields["order_facts"] = int(described is not None)
        if described is not None:
            fields["order"] = dict(described)
        return envelope("loader", LOADER_STATE_VERSION, **fields)

    def load_state_dict(
        self, state: dict[str, Any], *, allow_global_batch_change: bool = False
    ) -> None:
        """Continue exactly from ``state`` (any rank's; the data-parallel size may differ).

        Every field is checked against this loader. A different global batch size is refused
        unless ``allow_global_batch_change=True``, in which case the loader continues from the
        same sample position (always refused for a curriculum or a ``Mixture`` weight
        schedule, whose steps count global batches). Afterwards ``set_epoch`` to an earlier epoch raises unless
        ``allow_rewind=True``.
        """
        state = read_state(self, state, allow_global_batch_change=allow_global_batch_change)
        check_ahead(self.plan, state["epoch"], state["position"])  # a ramp resized past
        self._stats = state["stats"]
        self._epoch, self._position = state["epoch"], state["position"]
        if (
            state["data_world_size"] != self.data_world_size
            and state["global_batch_size"] == self.global_batch_size
        ):  # (another global batch: the state's plan is not this loader's to rebuild)
            self._keep_epoch_end(lambda: self.plan.with_ranks(state["data_world_size"]))
        self._resumed = True
        self._supersede(
            f"loaded a state (load_state_dict: epoch {self._epoch}, position {self._position})",
            "its batches are of the position before. Iterate the loader again (for batch in "
            "loader) to continue from the loaded state",
        )

    def _relayout(self, mesh: Any, rank: int, state: dict[str, Any] | None) -> None:
        # Everything that can refuse is checked before anything moves: a refused resize leaves
        # the loader on its layout, at its position, its iterator live.
        dp = mesh.data_world_size
        batch = check_divides(self.global_batch_size, mesh, f"resize of {self.name}")
        epoch, position = self._epoch, self._position
        if state is not None:  # a peer's, checked as the new layout will load it
            read = read_state(_Relaid(self, dp, batch), state, allow_global_batch_change=False)
            epoch, position = read["epoch"], read["position"]
        plan = resized(self.plan, dp, epoch, position)  # a ramp size ahead that dp does not divide
        relayout(self, mesh, rank, self.global_batch_size)  # stopped; placed on the new layout
        old, self.plan, self._index_cache = self.plan, plan, None
        self._keep_epoch_end(lambda: old)
        if isinstance(self.service, GlobalService):  # it serves this loader alone: rebound
            self.service.bind_mesh(mesh, resized=True)
        else:
            service = self.service
            inner = service.inner if isinstance(service, DistributedService) else service
            self.service = self._grouped(inner)
            self._groups = True  # a group formed only after this resize: wrapped at its walk
        if state is not None:  # a rank that rejoins continues from a peer's position
            self.load_state_dict(state)

    def _keep_epoch_end(self, before: Callable[[], Any]) -> None:
        """Where the plan ``before()`` (over the checkpointed run's data ranks) had ended the
        epoch, the epoch stays over: with ``pad_last=False`` the last batch is truncated to
        those ranks, and what it left out is not one more step on another data-parallel
        size (the uninterrupted run on either size takes no such step)."""
        if self.drop_last or self.pad_last:
            return
        length = self.plan.order.epoch_length(self._epoch)
        if self._position >= length:
            return
        try:
            plan = before()
        except ValueError:  # a ramp that cannot be laid over those ranks here: as loaded
            return
        if plan.step_at(self._epoch, self._position) is None:
            self._position = length

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop the live iterator (its delivery thread joined, what it prefetched dropped),
        then worker processes or actors. Idempotent; the loader can be iterated again, from
        the last batch returned (a live iterator raises on its next ``next()``).

        Called while a ``next()`` runs: from its ``on_step``, the delivery thread is joined
        before this returns, and that ``next()`` returns its batch (counted already: on_step
        saw it). From another thread, that ``next()`` joins the delivery thread before it
        ends, and raises the shutdown error in place of a batch not yet counted (the next walk
        serves it; with workers, the pool's ``PoolClosed`` may come first)."""
        self._supersede(
            "was shut down (shutdown(), or the end of its with-block)",
            "nothing more comes from this iterator. Iterate the loader again (for batch in "
            "loader) to continue from the last batch returned",
        )
        if getattr(self, "_started", False):  # __del__ of a half-built loader
            self.service.shutdown()
            self._started = False


class _LiveWalk:
    """The iterator ``iter(loader)`` returns: the loader's walk of one generation (see
    :mod:`meshfeed.loader_base`), which refuses to go on once a later one started.

    An error raised through it (a bad sample under ``on_error="raise"``, a worker that died,
    ``on_step``) ends the walk's generator; the next ``next()`` continues the same generation
    from the last batch returned (the batch that raised is served again), where a finished
    generator would have ended the epoch silently.

    Superseded while a ``next()`` runs (``shutdown()`` from ``on_step`` or from another
    thread), the walk cannot be closed then (:meth:`close`); that ``next()`` closes it before it
    returns or raises, so its delivery thread never outlives it."""

    __slots__ = ("__weakref__", "_batches", "_loader", "_walk")

    def __init__(self, loader: DataLoader, walk: int, batches: Generator[Any, None, None]) -> None:
        self._loader, self._walk, self._batches = loader, walk, batches

    def __iter__(self) -> _LiveWalk:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        if self._walk != loader._walks:
            self._stop()
        try:
            batch = next(self._batches)
        except StopIteration:
            if self._walk != loader._walks:  # closed meanwhile from another thread
                self._stop()
            raise
        except ValueError as exc:
            if self._walk != loader._walks:  # being closed from another thread: "executing"
                self._stop()
            if is_concurrent_next(exc):  # another thread's next() runs it: leave it be
                raise loader._concurrent_next_error() from None
            self._batches = loader._iterate(self._walk)  # continues from the position
            raise
        except BaseException:
            self._batches = loader._iterate(self._walk)  # continues from the position
            raise
        if self._walk != loader._walks:  # superseded while it ran; the batch was counted
            self.close()
        return batch

    def _stop(self) -> NoReturn:
        """Superseded: close what the walk still holds, and raise why."""
        self.close()
        raise self._loader._superseded_error() from None

    def close(self) -> None:
        """Stop the walk: what it prefetched is dropped, its delivery thread joined.

        A walk that runs (the call came from its ``on_step``, or from another thread during a
        ``next()``) cannot be closed: from ``on_step`` its delivery stage, which waits, is
        closed instead (the thread joined now); from another thread its delivery thread is
        told to stop after the batch it is making. Either way the ``next()`` in progress finds
        the walk superseded and closes it before it returns or raises."""
        try:
            self._batches.close()
        except ValueError:  # running
            self._loader._close_stage(self._walk)


class _Relaid:
    """A loader as a resize would lay it out (its data ranks and per-rank batch those of the new
    layout), for :func:`~meshfeed.loader_state.read_state` to check a peer's state before
    anything moves (:meth:`DataLoader._relayout`). Its plan is the loader's: the new one's
    rounding of a ramp is checked equal to it by the resize itself."""

    def __init__(self, loader: DataLoader, data_world_size: int, batch_size: int) -> None:
        self.seed, self.shuffle = loader.seed, loader.shuffle
        self.drop_last, self.pad_last = loader.drop_last, loader.pad_last
        self.batch_size, self.data_world_size = batch_size, data_world_size
        self.global_batch_size = loader.global_batch_size
        self.dataset, self.dataset_length = loader.dataset, loader.dataset_length
        self.fingerprint, self.order = loader.fingerprint, loader.order
        self.hooks, self.plan = loader.hooks, loader.plan


def _take_back(telemetry: Telemetry, events: Any) -> None:
    """Take back the phases of a batch counted and then not returned (``on_step`` raised)."""
    fetch = collate = 0.0
    for e in events if isinstance(events, list) else [events]:
        fetch += e.fetch_s
        collate += e.collate_s
    telemetry.take_back(fetch=fetch, collate=collate)


def _counts_of(stats: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """What a batch adds to ``stats``: the counts, and how many failures are listed.

    A plain copy (taken per batch: cheaper than leaving ``failures`` out); its ``failures``
    entry is not restored (:func:`_restore_counts`)."""
    return stats.copy(), len(stats["failures"])


def _restore_counts(stats: dict[str, Any], before: tuple[dict[str, Any], int]) -> None:
    """``stats`` with the counts of ``before``, and its failures list (the same list) cut
    back to the length it had."""
    counts, failures = before
    listed = stats["failures"]
    stats.update(counts)
    stats["failures"] = listed
    del listed[failures:]
