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
references (re-read on restore, so rows need not be JSON); a worker that has run out keeps its
end state (rows it read looking for one more batch count as read, with or without worker
processes). Save each data rank's own state; resume needs the same shards, data-parallel size
and ``num_workers``. Taking the state costs nothing per batch: without workers the loader keeps
the live pipeline's state and writes it out only in ``state_dict()``.

Rows that are None are skipped and counted in ``stats()["skipped"]``, cumulatively over epochs
and carried through ``state_dict()`` (as ``meshfeed.DataLoader.stats()`` counts); the first
skip of a run is logged as a warning on the ``"meshfeed"`` logger. ``len()`` is known only
when the stream has row counts; then every rank also stops after exactly ``len()`` steps
without communication.

**Errors.** A stream cannot re-read or replace one row, so ``on_error`` is ``"raise"`` for
streams (the default, ``None``, means it): a batch whose reading raises raises on its rank,
and every other rank raises at the same step, because the per-batch all-reduce also carries
"I failed". ``on_error="skip"`` / ``"substitute"``, ``max_retries > 0``, ``curriculum=`` and
``service=`` are refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from meshfeed.dist import all_min, check_agreement, is_distributed
from meshfeed.errors import RankError
from meshfeed.loader_base import LoaderBase, check_epoch, pin
from meshfeed.nodes.base import materialize
from meshfeed.order.permutation import derive_seed
from meshfeed.sources.stream import ShardedStream
from meshfeed.sources.stream_workers import InProcessSlots, LiveState, ProcessSlots, SlotConfig
from meshfeed.state import check_count, envelope, fingerprint_hash, open_envelope

__all__ = ["STREAM_STATE_VERSION", "StreamLoader", "StreamRankError"]

#: Version 2 (meshfeed 0.2): the one envelope (``kind="stream_loader"``; version 1 wrote
#: ``kind="stream"``), ``stats`` carries ``unread_rows``, and a slot without shuffle buffer keeps
#: no buffer state.
STREAM_STATE_VERSION = 2
_log = logging.getLogger("meshfeed")
_BUFFER_OP = 0x5342
# One int per batch in the all-reduce(MIN): every rank learns whether all have a batch and
# whether any failed, in the same collective.
_FAILED, _EXHAUSTED, _HAVE = 0, 1, 2


#: Another data rank failed to make its batch at this step; its own error says why. The
#: same class as the map-style loader's (one error for every door).
StreamRankError = RankError


class StreamLoader(LoaderBase):
    """A mesh-aware loader for sharded streams (see the module docstring)."""

    name = "StreamLoader"
    failures_hint = "loader.stats()['skipped'] (rows that were None)"

    def __init__(
        self,
        dataset: ShardedStream,
        *,
        batch_size: int,
        mesh: Any = None,
        device_mesh: Any = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 0,
        prefetch: int = 2,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        timeout: float = 300.0,
        on_error: str | None = None,
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
        super().__init__(
            batch_size=batch_size,
            mesh=mesh,
            device_mesh=device_mesh,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            num_workers=num_workers,
            prefetch=prefetch,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            timeout=timeout,
            on_error=on_error,
            max_retries=max_retries,
            multiprocessing_context=multiprocessing_context,
        )
        for name, value, default in (
            ("on_error", on_error, "raise"),
            ("max_retries", max_retries, 0),
            ("curriculum", curriculum, None),
            ("service", service, None),
        ):
            if value is not None and value != default:
                raise ValueError(
                    f"StreamLoader does not support {name}={value!r}: a stream has no random "
                    "access, so a row cannot be retried, replaced, gated or fetched elsewhere "
                    f"(errors raise on every rank at the same step); leave {name} at its "
                    "default, or use a map-style dataset with meshfeed.DataLoader"
                )
        self.on_error = "raise"
        self.stream = dataset
        self.slots = max(1, num_workers)
        self.fingerprint = dataset.fingerprint
        self._checked = False
        self._slots: InProcessSlots | ProcessSlots | None = None
        self._skipped_done = 0
        self._unread_rows = 0
        self._warned_unread = False
        self._worker_states: list[dict[str, Any] | LiveState | None] = [None] * self.slots
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

    def _enter_epoch(self, epoch: int) -> None:
        self._close_slots()
        self._epoch = epoch
        self._reset_epoch_state()

    # ------------------------------------------------------------------ iteration
    def _open_slots(self) -> InProcessSlots | ProcessSlots:
        self._close_slots()
        configs = self._configs(self._epoch)
        states = [materialize(s) for s in self._worker_states]
        if self.num_workers == 0:
            self._slots = InProcessSlots(configs, states)
        else:
            self._slots = ProcessSlots(
                configs,
                states,
                prefetch=self.prefetch,
                timeout=self.wait_timeout,
                start_method=self.multiprocessing_context,
            )
        return self._slots

    def _close_slots(self) -> None:
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def _next_local(self, slots: InProcessSlots | ProcessSlots) -> tuple[Any, int, Any] | None:
        """The next batch of this rank in round-robin order, or None when every worker is done."""
        if self.slots == 1:
            if self._exhausted[0]:
                return None
            batch, state = slots.next(0)
            if batch is None:
                self._exhausted[0] = True
                self._worker_states[0] = state
                return None
            return batch, 0, state
        for k in range(self.slots):
            w = (self._next_worker + k) % self.slots
            if self._exhausted[w]:
                continue
            batch, state = slots.next(w)
            if batch is None:
                # the slot's end state: rows read after its last batch (a short batch that
                # drop_last dropped) count as read, whether the slot runs here or in a worker
                self._exhausted[w] = True
                self._worker_states[w] = state
                continue
            return batch, w, state
        return None

    def __iter__(self) -> Iterator[Any]:
        self._check_agreement()
        epoch = self._epoch
        # Known row counts align the ranks by construction; the agreement stays as a guard.
        cap = len(self) if self.stream.rows is not None else None
        slots = self._open_slots()
        # The per-batch agreement is a collective only where there are other ranks; alone,
        # this rank's own status is the minimum (and costs no call per batch).
        distributed = is_distributed()
        skipped = [_skipped(st) for st in self._worker_states]
        try:
            while True:
                error: Exception | None = None
                got = None
                if cap is None or self._steps < cap:
                    try:
                        got = self._next_local(slots)
                    except Exception as exc:  # raised on every rank at this step, below
                        error = exc
                mine = _FAILED if error else _HAVE if got is not None else _EXHAUSTED
                status = all_min([mine], timeout=self.wait_timeout)[0] if distributed else mine
                if error is not None:
                    raise error
                if status == _FAILED:
                    raise StreamRankError(
                        f"another data rank failed to make its batch at step {self._steps} of "
                        f"epoch {self._epoch} (this is data rank {self.data_rank}); see that "
                        "rank's error. Every rank stops here so that none waits forever",
                        step=self._steps,
                    )
                if status == _EXHAUSTED or got is None:
                    break
                batch, w, state = got
                self._worker_states[w] = state
                self._next_worker = (w + 1) % self.slots
                self._steps += 1
                now = _skipped(state)
                if now != skipped[w]:
                    self._note_bad_samples(now - skipped[w], None)
                    skipped[w] = now
                yield pin(batch) if self.pin_memory else batch
            if self._epoch == epoch:
                self._count_unread(epoch)
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
                self.wait_timeout,
            )
            self._checked = True

    def _count_unread(self, epoch: int) -> None:
        """Add the rows no rank read in ``epoch`` (known only with row counts); warn once."""
        unread = self.stream.unread_rows(
            epoch,
            self.data_world_size,
            self.slots,
            seed=self.seed,
            shuffle=self.shuffle,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
        )
        if not unread:
            return
        self._unread_rows += unread
        if not self._warned_unread:
            self._warned_unread = True
            _log.warning(
                "StreamLoader: %d rows of epoch %d were not read by any data rank (ranks stop "
                "together when the first runs out, and drop_last drops short batches). Whole "
                "shards are assigned when the stream has no rows= or its shard count divides "
                "ranks x workers (%d x %d): pass rows= to ShardedStream so shards are split by "
                "row ranges, or use equal-sized shards in a multiple of ranks x workers. "
                "Counted in stats()['unread_rows']",
                unread,
                epoch,
                self.data_world_size,
                self.slots,
            )

    def _epoch_skipped(self) -> int:
        return sum(_skipped(s) for s in self._worker_states)

    def stats(self) -> dict[str, Any]:
        """Epoch, steps taken this epoch, per-worker exhaustion, rows skipped (None) and rows
        left unread.

        ``skipped`` and ``unread_rows`` are cumulative: every epoch so far, carried through
        ``state_dict()``. ``unread_rows`` counts, per completed epoch, the rows no data rank
        read because ranks stop together or ``drop_last`` dropped a short batch (see
        :meth:`ShardedStream.unread_rows`); it stays 0 for a stream without ``rows=``, where the
        number is unknowable without reading the shards.
        """
        return {
            "epoch": self._epoch,
            "steps": self._steps,
            "skipped": self._skipped_done + self._epoch_skipped(),
            "unread_rows": self._unread_rows,
            "exhausted_workers": sum(self._exhausted),
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """This data rank's state as of the last batch returned (JSON-serialisable)."""
        return envelope(
            "stream_loader",
            STREAM_STATE_VERSION,
            **self._identity(),
            epoch=self._epoch,
            steps=self._steps,
            next_worker=self._next_worker,
            exhausted=list(self._exhausted),
            workers=[materialize(s) for s in self._worker_states],
            stats={
                "skipped": self._skipped_done + self._epoch_skipped(),
                "unread_rows": self._unread_rows,
            },
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly from ``state`` (this data rank's own, same configuration).

        Every field is checked here, each worker's state too (loaded into a fresh pipeline of
        this epoch's pieces, so a shuffle buffer's rows are read once more): a bad state fails
        now, naming the field, rather than at the first batch.
        """
        what = "stream loader state"
        state = open_envelope(
            state,
            kind="stream_loader",
            version=STREAM_STATE_VERSION,
            fields={
                "epoch": int,
                "steps": int,
                "next_worker": int,
                "exhausted": list,
                "workers": list,
                "stats": dict,
            },
            what=what,
            legacy_kinds=("stream",),
        )
        for key, value in self._identity().items():
            if state.get(key) != value or type(state.get(key)) is not type(value):
                raise ValueError(
                    f"checkpoint has {key}={state.get(key)!r} but this stream loader has "
                    f"{key}={value!r}; a stream resumes only with the same shards, seeds, "
                    "shuffle buffer, batch size, data rank, data-parallel size and num_workers"
                )
        check_epoch(state["epoch"], what)
        steps = check_count(state["steps"], name="steps", what=what)
        workers, exhausted = state["workers"], state["exhausted"]
        if (
            len(workers) != self.slots
            or len(exhausted) != self.slots
            or not all(isinstance(x, bool) for x in exhausted)
            or not all(w is None or isinstance(w, dict) for w in workers)
            or not 0 <= state["next_worker"] < self.slots
        ):
            raise ValueError(
                f"{what} has workers={workers!r}, exhausted={exhausted!r}, "
                f"next_worker={state['next_worker']!r} for {self.slots} worker slot(s); the "
                "checkpoint is corrupted"
            )
        self._check_workers(state["epoch"], workers)
        this_epoch = sum(_skipped(w) for w in workers)
        stats = state["stats"]
        if set(stats) != {"skipped", "unread_rows"}:
            raise ValueError(
                f"{what} has stats={stats!r}, expected the counts 'skipped' and 'unread_rows'; "
                "the checkpoint is corrupted"
            )
        skipped = check_count(stats["skipped"], name="skipped", what=what)
        unread = check_count(stats["unread_rows"], name="unread_rows", what=what)
        if skipped < this_epoch:
            raise ValueError(
                f"{what} has stats={stats!r}, but its workers skipped {this_epoch} rows "
                "this epoch alone; the checkpoint is corrupted"
            )
        self._close_slots()
        self._epoch, self._steps = state["epoch"], steps
        self._next_worker = state["next_worker"]
        self._exhausted = list(exhausted)
        self._worker_states = list(workers)
        self._skipped_done = skipped - this_epoch
        self._unread_rows = unread
        self._warned_unread = unread > 0
        self._resumed = True

    def _check_workers(self, epoch: int, workers: list[dict[str, Any] | None]) -> None:
        """Load each worker state into a throwaway pipeline of ``epoch``'s pieces."""
        for w, (config, ws) in enumerate(zip(self._configs(epoch), workers, strict=True)):
            if ws is None:
                continue
            node = config.rows()
            try:
                node.load_state_dict(ws)
            except ValueError as e:
                raise ValueError(f"stream loader state, worker {w}: {e}") from e

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
        if getattr(self, "_slots", None) is not None:  # __del__ of a half-built loader
            self._close_slots()


def _skipped(state: dict[str, Any] | LiveState | None) -> int:
    if isinstance(state, LiveState):
        return state.skipped
    while isinstance(state, dict) and "source" in state:
        state = state["source"]
    return int(state.get("skipped", 0)) if isinstance(state, dict) else 0
