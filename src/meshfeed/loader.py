"""DataLoader: the front door. Mesh -> order -> fetch -> batch -> deliver.

>>> loader = DataLoader(list(range(10)), batch_size=2, mesh={"dp": 2, "tp": 2}, rank=3)
>>> len(loader)          # 10 samples, global batch 2 * 2 = 4, last incomplete batch dropped
2
>>> [b.tolist() for b in loader] == [b.tolist() for b in DataLoader(
...     list(range(10)), batch_size=2, mesh={"dp": 2, "tp": 2}, rank=2)]   # tp peers agree
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import numpy as np

from meshfeed.fetch import MAX_REPORTED_FAILURES, Fetcher, FetchEvents, FetchTask, OnError
from meshfeed.mesh import DataMesh, default_rank, resolve_mesh
from meshfeed.options import check_loader_arguments
from meshfeed.order.compose import build_order
from meshfeed.order.plan import (
    BatchPlan,
    Step,
    describe_order,
    rank_bounds,
)
from meshfeed.services.base import InProcessService, Service
from meshfeed.services.distributed import DistributedService
from meshfeed.services.workers import WorkerService
from meshfeed.state import (
    STATE_VERSION,
    dataset_fingerprint,
    fingerprint_hash,
    validate_state,
)

#: How many upcoming steps' indices are computed in one vectorised order call.
_INDEX_BLOCK_STEPS = 256


class DataLoader:
    """A mesh-aware, deterministic, exactly resumable loader for map-style datasets.

    ``batch_size`` is per data rank; the global batch is ``batch_size * data_world_size``.
    Every data rank walks the same global batches (a pure function of seed, epoch and
    position) and takes its contiguous slice; tensor / context / pipeline peers compute the
    same slice, so no broadcast is needed. ``state_dict()`` is a small JSON dict; loading it
    continues exactly, also on a different data-parallel size with the same global batch.

    A :class:`~meshfeed.sources.ShardedStream` (not map-style) gets a
    :class:`~meshfeed.sources.StreamLoader` with the same arguments and interface.

    A new ``iter()`` continues from the current position (exact resumption); an epoch that
    was iterated to its end advances to the next epoch. ``set_epoch(e)`` with a different
    epoch restarts at the beginning of epoch ``e``.
    """

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> Any:
        # A stream is not map-style: the same front door hands it to the streaming loader.
        from meshfeed.sources.stream import ShardedStream

        if cls is DataLoader and isinstance(dataset, ShardedStream):
            from meshfeed.sources.stream_loader import StreamLoader

            return StreamLoader(dataset, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        mesh: Any = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 0,
        prefetch: int = 2,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        timeout: float = 300.0,
        on_error: OnError = "substitute",
        max_retries: int = 0,
        curriculum: Any = None,
        service: Service | None = None,
        multiprocessing_context: str | None = None,
    ) -> None:
        check_loader_arguments(
            batch_size=batch_size,
            seed=seed,
            num_workers=num_workers,
            prefetch=prefetch,
            timeout=timeout,
            on_error=on_error,
            max_retries=max_retries,
        )
        if service is not None and num_workers:
            raise ValueError(
                f"num_workers={num_workers} and service={type(service).__name__} both say where "
                "batches are made; configure workers on the service (e.g. "
                "WorkerService(num_workers=...)) and leave num_workers at 0"
            )
        self.mesh: DataMesh = resolve_mesh(mesh)
        _check_world(self.mesh)
        self.rank = default_rank() if rank is None else rank
        self.data_rank = self.mesh.data_rank(self.rank)  # validates the rank
        self.data_world_size = self.mesh.data_world_size
        if service is not None and hasattr(service, "bind_mesh"):
            service.bind_mesh(self.mesh)  # RayService: RemoteBatch.for_rank maps global ranks
        if service is not None and hasattr(service, "prepare"):
            dataset = service.prepare(dataset)
        try:
            length = len(dataset)
        except TypeError:
            raise ValueError(
                f"dataset of type {type(dataset).__name__} has no len(); meshfeed.DataLoader "
                "needs a map-style dataset (__len__ and __getitem__)"
            ) from None
        if length < 1:
            raise ValueError(
                f"dataset is empty (len {length}); give the loader at least one sample"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.global_batch_size = batch_size * self.data_world_size
        self.seed, self.shuffle, self.drop_last = seed, bool(shuffle), bool(drop_last)
        self.num_workers, self.prefetch, self.timeout = num_workers, prefetch, timeout
        self.pin_memory = pin_memory
        self.dataset_length = length
        self.fingerprint = dataset_fingerprint(dataset)
        self.order = build_order(
            dataset,
            curriculum=curriculum,
            dataset_length=length,
            global_batch_size=self.global_batch_size,
            seed=seed,
            shuffle=self.shuffle,
        )
        self.plan = BatchPlan(
            self.order, global_batch_size=self.global_batch_size, drop_last=drop_last
        )
        if self.drop_last and self.plan.steps(0) == 0:
            raise ValueError(
                f"the dataset ({length} samples) is smaller than one global batch "
                f"({batch_size=} x data_world_size={self.data_world_size}); with drop_last=True "
                "no batch would ever be produced. Use a smaller batch_size or drop_last=False"
            )
        self.fetcher = Fetcher(
            dataset,
            seed=seed,
            collate_fn=collate_fn,
            postprocess=getattr(curriculum, "postprocess", None),
            on_error=on_error,
            max_retries=max_retries,
        )
        self.service: Service = service or self._default_service(multiprocessing_context)
        self._started = False
        self._epoch = 0
        self._position = 0
        self._stats: dict[str, Any] = {
            "retries": 0,
            "substituted": 0,
            "skipped": 0,
            "padded": 0,
            "failures": [],
        }
        self._index_cache: tuple[int, dict[int, tuple[np.ndarray, np.ndarray]]] | None = None

    # ------------------------------------------------------------------ construction helpers
    def _default_service(self, start_method: str | None) -> Service:
        inner: Service = (
            WorkerService(
                self.num_workers,
                prefetch=self.prefetch,
                timeout=self.timeout,
                start_method=start_method,
            )
            if self.num_workers > 0
            else InProcessService()
        )
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return DistributedService(inner, agreement=self._agreement())
        return inner

    def _agreement(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "dataset_length": self.dataset_length,
            "dataset_fingerprint": fingerprint_hash(self.fingerprint),
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Steps per epoch on this rank (the same on every rank)."""
        return self.plan.steps(self._epoch)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Global samples of the current epoch consumed so far (as of the last batch returned)."""
        return self._position

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; a no-op when already in ``epoch`` (keeps a resume)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int (got {epoch=!r})")
        if epoch != self._epoch:
            self._epoch, self._position = epoch, 0

    def _block(self, step: Step) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """This rank's (positions, indices) for up to _INDEX_BLOCK_STEPS steps from ``step``.

        Full global batches (all but possibly an epoch's last) are computed in one vectorised
        shot: positions as a 2-D array, one order call, per-step rows as views.
        """
        cache = self._index_cache
        if cache is not None and cache[0] == step.epoch and step.start in cache[1]:
            return cache[1]
        G, D, d = self.global_batch_size, self.data_world_size, self.data_rank
        full = min(_INDEX_BLOCK_STEPS, (self.order.epoch_length(step.epoch) - step.start) // G)
        if full > 0:
            lo, hi = rank_bounds(G, d, D)
            starts = step.start + G * np.arange(full, dtype=np.int64)
            positions = starts[:, None] + np.arange(lo, hi, dtype=np.int64)[None, :]
            indices = self.order.indices(step.epoch, positions.ravel()).reshape(positions.shape)
            block = {s: (positions[k], indices[k]) for k, s in enumerate(starts.tolist())}
        else:  # the short last batch of an epoch (drop_last=False): may wrap around
            positions = self.plan.rank_positions(step, d, D)
            block = {step.start: (positions, self.order.indices(step.epoch, positions))}
        self._index_cache = (step.epoch, block)
        return block

    def _tasks(self, epoch: int, position: int) -> Iterator[tuple[Step, FetchTask]]:
        while (step := self.plan.step_at(epoch, position)) is not None:
            positions, indices = self._block(step)[step.start]
            yield step, FetchTask(epoch, step.index, indices, positions)
            position = step.end

    def __iter__(self) -> Iterator[Any]:
        if not self._started:
            self.service.start(self.fetcher)
            self._started = True
        epoch, position = self._epoch, self._position
        steps: list[Step] = []
        if hasattr(self.service, "map_global"):
            results = self._run_global(epoch, position, steps)
        else:

            def tasks() -> Iterator[FetchTask]:
                for step, task in self._tasks(epoch, position):
                    steps.append(step)
                    yield task

            results = self.service.map(tasks())
        for batch, events in results:
            step = steps.pop(0)
            if isinstance(events, list):
                for e in events:
                    self._record(step, e)
            else:
                self._record(step, events)
            self._position = step.end
            if self.pin_memory:
                batch = _pin(batch)
            yield batch
        # The epoch was iterated to its end: the next iter() starts the next epoch.
        if self._epoch == epoch:
            self._epoch, self._position = epoch + 1, 0

    def _run_global(self, epoch: int, position: int, steps: list[Step]) -> Iterator[Any]:
        """For services that serve every data rank at once (Ray): one task list per step."""

        def global_tasks() -> Iterator[list[FetchTask]]:
            pos = position
            while (step := self.plan.step_at(epoch, pos)) is not None:
                steps.append(step)
                yield [
                    FetchTask(epoch, step.index, indices, positions)
                    for positions, indices in self.plan.global_indices(step, self.data_world_size)
                ]
                pos = step.end

        return iter(self.service.map_global(global_tasks()))  # type: ignore[attr-defined]

    def _record(self, step: Step, events: FetchEvents) -> None:
        # Padding exists only in a last batch shorter than the number of data ranks.
        if step.end - step.start < self.data_world_size and not hasattr(self.service, "map_global"):
            self._stats["padded"] += self.plan.rank_padding(
                step, self.data_rank, self.data_world_size
            )
        if events:
            self._stats["retries"] += events.retries
            self._stats["substituted"] += events.substituted
            self._stats["skipped"] += events.skipped
            room = MAX_REPORTED_FAILURES - len(self._stats["failures"])
            self._stats["failures"].extend(events.failures[: max(room, 0)])

    def stats(self) -> dict[str, Any]:
        """Counts of retries, substitutions, skips and padded samples, and the first failures."""
        out = {k: (list(v) if isinstance(v, list) else v) for k, v in self._stats.items()}
        out["epoch"], out["position"] = self._epoch, self._position
        described = describe_order(self.order, self._epoch, self._position)
        if described is not None:
            out["order"] = described
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The state as of the last batch returned: a small JSON-serialisable dict."""
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self._epoch,
            "position": self._position,
            "global_batch_size": self.global_batch_size,
            "data_world_size": self.data_world_size,
            "dataset_length": self.dataset_length,
            "fingerprint": self.fingerprint,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "stats": {k: (list(v) if isinstance(v, list) else v) for k, v in self._stats.items()},
        }
        described = describe_order(self.order, self._epoch, self._position)
        if described is not None:
            state["order"] = described
        return state

    def load_state_dict(
        self, state: dict[str, Any], *, allow_global_batch_change: bool = False
    ) -> None:
        """Continue exactly from ``state`` (any rank's; the data-parallel size may differ).

        A different global batch size is refused unless ``allow_global_batch_change=True``, in
        which case the loader continues from the same sample position.
        """
        state = validate_state(state)
        for key, mine in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"checkpoint has {key}={state[key]!r} but this loader has {key}={mine!r}; "
                    f"build the loader with {key}={state[key]!r} to resume this run"
                )
        if (
            state["dataset_length"] != self.dataset_length
            or state["fingerprint"] != self.fingerprint
        ):
            raise ValueError(
                f"checkpoint is from another dataset (length {state['dataset_length']}, "
                f"fingerprint {state['fingerprint']!r}) than this loader's (length "
                f"{self.dataset_length}, fingerprint {self.fingerprint!r}); resume with the same dataset"
            )
        if state["global_batch_size"] != self.global_batch_size and not allow_global_batch_change:
            raise ValueError(
                f"checkpoint global batch size {state['global_batch_size']} differs from this "
                f"loader's {self.global_batch_size} (batch_size={self.batch_size} x "
                f"data_world_size={self.data_world_size}); keep the global batch (e.g. "
                f"batch_size={state['global_batch_size'] // self.data_world_size} if it divides) "
                "or pass allow_global_batch_change=True to continue from the same sample position"
            )
        if state["position"] > self.order.epoch_length(state["epoch"]):
            raise ValueError(
                f"checkpoint position {state['position']} is beyond the epoch length "
                f"{self.order.epoch_length(state['epoch'])}; the checkpoint is corrupted"
            )
        validate_order = getattr(self.order, "validate_described", None)
        if validate_order is not None and "order" in state:
            validate_order(state["order"])
        self._epoch, self._position = state["epoch"], state["position"]
        stats = state.get("stats")
        if isinstance(stats, dict):
            for key in ("retries", "substituted", "skipped", "padded"):
                if isinstance(stats.get(key), int):
                    self._stats[key] = stats[key]
            if isinstance(stats.get("failures"), list):
                self._stats["failures"] = list(stats["failures"])

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop worker processes or actors. Idempotent; the loader can be iterated again."""
        if self._started:
            self.service.shutdown()
            self._started = False

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()


def _check_world(mesh: DataMesh) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != mesh.world_size:
        raise ValueError(
            f"the mesh {mesh.sizes} has world size {mesh.world_size} but the process group has "
            f"{dist.get_world_size()} ranks; make the mesh sizes multiply to the number of processes"
        )


def _pin(batch: Any) -> Any:
    import torch

    if not torch.cuda.is_available():
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pin(v) for v in batch)
    return batch
