"""StreamLoader: the DataLoader of a :class:`ShardedStream` (per data rank, exactly resumable).

>>> stream = ShardedStream([lambda: range(0, 6), lambda: range(10, 16)])
>>> [b.tolist() for b in StreamLoader(stream, batch_size=3, shuffle=False)]
[[0, 1, 2], [3, 4, 5], [10, 11, 12], [13, 14, 15]]

The arguments are the DataLoader's. Data rank ``d`` reads only its own shards (see
:mod:`meshfeed.sources.stream`); with ``num_workers=k`` worker ``w`` of the rank reads its own
sub-shards and the rank's batches are taken from the workers round-robin in a fixed order
(an exhausted worker is passed over), so the output does not depend on timing.

**Ranks stop together** (torchdata's ``fullsync``): after each local batch, every rank joins
one ``all_reduce(MIN)`` of a single int ("I have a batch") when ``torch.distributed`` is
initialised; when any rank has run out, the epoch ends on every rank at the same step. The
wait is bounded by ``timeout``: a rank that never arrives is reported, never waited for
forever. The next ``iter()`` starts the next epoch (shards re-permuted when ``shuffle``).

**State** is per data rank: the epoch, the steps taken, the round-robin cursor and, per worker,
the shard cursor, the in-shard row offset and the shuffle buffer as ``[shard, row]``
references (re-read on restore, so rows need not be JSON). Save each data rank's own state;
resume needs the same shards, data-parallel size and ``num_workers``.

Rows that are None are skipped and counted in ``stats()["skipped"]``, cumulatively over epochs
and carried through ``state_dict()`` (as ``meshfeed.DataLoader.stats()`` counts); ``on_error`` and
``max_retries`` apply to map-style datasets only. ``len()`` is known only when the stream has
row counts; then every rank also stops after exactly ``len()`` steps without communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from meshfeed.dist import all_ranks_have_a_batch, check_agreement
from meshfeed.mesh import DataMesh, default_rank, resolve_mesh
from meshfeed.options import check_loader_arguments
from meshfeed.order.permutation import derive_seed
from meshfeed.sources.stream import ShardedStream
from meshfeed.sources.stream_workers import InProcessSlots, ProcessSlots, SlotConfig
from meshfeed.state import fingerprint_hash

__all__ = ["STREAM_STATE_VERSION", "StreamLoader"]

STREAM_STATE_VERSION = 1
_BUFFER_OP = 0x5342


class StreamLoader:
    """A mesh-aware loader for sharded streams (see the module docstring)."""

    def __init__(
        self,
        dataset: ShardedStream,
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
        on_error: str = "substitute",
        max_retries: int = 0,
        curriculum: Any = None,
        service: Any = None,
        multiprocessing_context: str | None = None,
    ) -> None:
        if not isinstance(dataset, ShardedStream):
            raise TypeError(
                f"StreamLoader reads a meshfeed.sources.ShardedStream (got "
                f"{type(dataset).__name__}); use meshfeed.DataLoader for map-style datasets"
            )
        check_loader_arguments(
            batch_size=batch_size,
            seed=seed,
            num_workers=num_workers,
            prefetch=prefetch,
            timeout=timeout,
            on_error=on_error,
            max_retries=max_retries,
        )
        if curriculum is not None or service is not None:
            raise ValueError(
                "a stream has no random access, so curriculum= and service= do not apply; "
                "use a map-style dataset with meshfeed.DataLoader for them"
            )
        self.mesh: DataMesh = resolve_mesh(mesh)
        self.rank = default_rank() if rank is None else rank
        self.data_rank = self.mesh.data_rank(self.rank)
        self.data_world_size = self.mesh.data_world_size
        self.stream = dataset
        self.batch_size, self.seed = batch_size, seed
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.num_workers, self.prefetch, self.timeout = num_workers, prefetch, float(timeout)
        self.collate_fn, self.pin_memory = collate_fn, pin_memory
        self.multiprocessing_context = multiprocessing_context
        self.slots = max(1, num_workers)
        self.fingerprint = dataset.fingerprint
        self._checked = False
        self._slots: InProcessSlots | ProcessSlots | None = None
        self._epoch = 0
        self._skipped_done = 0
        self._worker_states: list[dict[str, Any] | None] = [None] * self.slots
        self._reset_epoch_state()
        # Validate the assignment now: a wrong configuration fails at construction.
        self._configs(0)

    def _reset_epoch_state(self) -> None:
        # Skip counts live in the worker states, which restart with each epoch: bank them.
        self._skipped_done += self._epoch_skipped()
        self._steps = 0
        self._next_worker = 0
        self._worker_states = [None] * self.slots
        self._exhausted = [False] * self.slots

    # ------------------------------------------------------------------ assignment
    def _configs(self, epoch: int) -> list[SlotConfig]:
        pieces = self.stream.assign(
            epoch, self.data_world_size, self.slots, seed=self.seed, shuffle=self.shuffle
        )[self.data_rank]
        size = self.stream.shuffle_buffer if self.shuffle else 0
        return [
            SlotConfig(
                stream=self.stream,
                pieces=pieces[w],
                batch_size=self.batch_size,
                drop_last=self.drop_last,
                shuffle_buffer=size,
                shuffle_seed=derive_seed(
                    _BUFFER_OP, self.stream.seed, self.seed, epoch, self.data_rank, w
                ),
                collate_fn=self.collate_fn,
            )
            for w in range(self.slots)
        ]

    def __len__(self) -> int:
        """Steps per epoch (the same on every rank); only when the stream has row counts."""
        if self.stream.rows is None:
            raise TypeError(
                "this stream has no row counts, so its length is unknown; pass rows= to "
                "ShardedStream or iterate without len()"
            )
        per_rank = []
        assignment = self.stream.assign(
            self._epoch, self.data_world_size, self.slots, seed=self.seed, shuffle=self.shuffle
        )
        for slots in assignment:
            steps = 0
            for pieces in slots:
                rows = sum(
                    (p.stop if p.stop is not None else self.stream.rows[p.shard]) - p.start
                    for p in pieces
                )
                steps += rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)
            per_rank.append(steps)
        return min(per_rank)

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; a no-op when already in ``epoch`` (keeps a resume)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int (got {epoch=!r})")
        if epoch != self._epoch:
            self._close_slots()
            self._epoch = epoch
            self._reset_epoch_state()

    # ------------------------------------------------------------------ iteration
    def _open_slots(self) -> InProcessSlots | ProcessSlots:
        self._close_slots()
        configs = self._configs(self._epoch)
        states = list(self._worker_states)
        if self.num_workers == 0:
            self._slots = InProcessSlots(configs, states)
        else:
            self._slots = ProcessSlots(
                configs,
                states,
                prefetch=self.prefetch,
                timeout=self.timeout,
                start_method=self.multiprocessing_context,
            )
        return self._slots

    def _close_slots(self) -> None:
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def _next_local(self, slots: InProcessSlots | ProcessSlots) -> tuple[Any, int, Any] | None:
        """The next batch of this rank in round-robin order, or None when every worker is done."""
        for k in range(self.slots):
            w = (self._next_worker + k) % self.slots
            if self._exhausted[w]:
                continue
            batch, state = slots.next(w)
            if batch is None:
                self._exhausted[w] = True
                continue
            return batch, w, state
        return None

    def __iter__(self) -> Iterator[Any]:
        self._check_agreement()
        epoch = self._epoch
        # Known row counts align the ranks by construction; the agreement stays as a guard.
        cap = len(self) if self.stream.rows is not None else None
        slots = self._open_slots()
        try:
            while True:
                got = None if cap is not None and self._steps >= cap else self._next_local(slots)
                if not all_ranks_have_a_batch(got is not None, self.timeout):
                    break
                assert got is not None  # every rank, this one included, has a batch
                batch, w, state = got
                self._worker_states[w] = state
                self._next_worker = (w + 1) % self.slots
                self._steps += 1
                yield _pin(batch) if self.pin_memory else batch
            if self._epoch == epoch:
                self._epoch = epoch + 1
                self._reset_epoch_state()
        finally:
            if self._slots is slots:
                self._close_slots()

    def _check_agreement(self) -> None:
        """Once: every rank must read the same stream with the same settings (bounded wait)."""
        if not self._checked:
            check_agreement(
                {
                    "seed": self.seed,
                    "batch_size": self.batch_size,
                    "num_workers": self.slots,
                    "shuffle": int(self.shuffle),
                    "drop_last": int(self.drop_last),
                    "stream fingerprint": fingerprint_hash(self.fingerprint),
                },
                self.timeout,
            )
            self._checked = True

    def _epoch_skipped(self) -> int:
        return sum(_skipped(s) for s in self._worker_states)

    def stats(self) -> dict[str, Any]:
        """Epoch, steps taken this epoch, per-worker exhaustion, and rows skipped (None).

        ``skipped`` is cumulative: every epoch so far, carried through ``state_dict()``.
        """
        return {
            "epoch": self._epoch,
            "steps": self._steps,
            "skipped": self._skipped_done + self._epoch_skipped(),
            "exhausted_workers": sum(self._exhausted),
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """This data rank's state as of the last batch returned (JSON-serialisable)."""
        return {
            "version": STREAM_STATE_VERSION,
            "kind": "stream",
            **self._identity(),
            "epoch": self._epoch,
            "steps": self._steps,
            "next_worker": self._next_worker,
            "exhausted": list(self._exhausted),
            "workers": list(self._worker_states),
            "stats": {"skipped": self._skipped_done + self._epoch_skipped()},
        }

    def load_state_dict(self, state: dict[str, Any], **_: Any) -> None:
        """Continue exactly from ``state`` (this data rank's own, same configuration)."""
        if not isinstance(state, dict) or state.get("kind") != "stream":
            raise ValueError(
                "not a stream loader state (missing kind='stream'); pass the dict that "
                "StreamLoader.state_dict() returned"
            )
        if state.get("version") != STREAM_STATE_VERSION:
            raise ValueError(
                f"stream state has version={state.get('version')!r}, this meshfeed reads "
                f"version {STREAM_STATE_VERSION}; resume with the meshfeed that wrote it"
            )
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ValueError(
                    f"checkpoint has {key}={state.get(key)!r} but this stream loader has "
                    f"{key}={value!r}; a stream resumes only with the same shards, seeds, "
                    "shuffle buffer, batch size, data rank, data-parallel size and num_workers"
                )
        workers, exhausted = state.get("workers"), state.get("exhausted")
        counters = [state.get(k) for k in ("epoch", "steps", "next_worker")]
        if (
            not isinstance(workers, list)
            or len(workers) != self.slots
            or not isinstance(exhausted, list)
            or len(exhausted) != self.slots
            or not all(isinstance(c, int) and c >= 0 for c in counters)
        ):
            raise ValueError(
                f"stream state has workers={workers!r}, exhausted={exhausted!r}, "
                f"epoch/steps/next_worker={counters!r} for {self.slots} worker slot(s); the "
                "checkpoint is corrupted"
            )
        this_epoch = sum(_skipped(w) for w in workers)
        # Like DataLoader, stats are optional in a state (counting restarts at this epoch's).
        stats = state.get("stats", {"skipped": this_epoch})
        skipped = stats.get("skipped") if isinstance(stats, dict) else None
        if not isinstance(skipped, int) or skipped < this_epoch:
            raise ValueError(
                f"stream state has stats={stats!r}, but its workers skipped {this_epoch} rows "
                "this epoch alone; the checkpoint is corrupted"
            )
        self._close_slots()
        self._epoch, self._steps = int(state["epoch"]), int(state["steps"])
        self._next_worker = int(state["next_worker"]) % self.slots
        self._exhausted = [bool(x) for x in exhausted]
        self._worker_states = list(workers)
        self._skipped_done = skipped - this_epoch

    def _identity(self) -> dict[str, Any]:
        """What a resume must match: the configuration that decides which rows come when."""
        return {
            "seed": self.seed,
            "stream_seed": self.stream.seed,
            "shuffle_buffer": self.stream.shuffle_buffer,
            "data_rank": self.data_rank,
            "data_world_size": self.data_world_size,
            "num_workers": self.slots,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "fingerprint": self.fingerprint,
        }

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop worker processes. Idempotent; the loader can be iterated again."""
        self._close_slots()

    def __enter__(self) -> StreamLoader:
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


def _skipped(state: dict[str, Any] | None) -> int:
    while isinstance(state, dict) and "source" in state:
        state = state["source"]
    return int(state.get("skipped", 0)) if isinstance(state, dict) else 0


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
