"""Where a stream slot's pipeline runs: in the calling process or in one worker process each.

A slot pipeline is :func:`~meshfeed.sources.stream.slot_batches` then ``collate``, over the
pieces assigned to one (data rank, worker). ``next()`` returns ``(batch, state after it)`` or
``(None, state)`` at the end, so the loader can record the state of the last batch it returned.

:class:`ProcessSlots` runs each slot in its own process of a :class:`~meshfeed.runtime.WorkerPool`
(``prefetch`` requests outstanding per worker): a dead worker is noticed at once and a stalled
one after ``timeout`` seconds, never a hang, and the workers are stopped (SIGTERM, then
SIGKILL) before :class:`StreamWorkerError` is raised. A worker's exception is raised as
:class:`StreamWorkerError` chained to the original (``__cause__``), with its traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshfeed.collate import default_collate
from meshfeed.nodes.base import Node
from meshfeed.runtime import WorkerDied, WorkerError, WorkerPool, WorkerTimeout
from meshfeed.sources.stream import Piece, ShardedStream, slot_batches

__all__ = ["InProcessSlots", "ProcessSlots", "SlotConfig", "SlotPipeline", "StreamWorkerError"]


class StreamWorkerError(WorkerError):
    """A stream worker died, stalled or raised."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotConfig:
    """Everything a slot needs to build its pipeline (picklable)."""

    stream: ShardedStream
    pieces: list[Piece]
    batch_size: int
    drop_last: bool
    shuffle_buffer: int
    shuffle_seed: int
    collate_fn: Callable[[list[Any]], Any] | None

    def rows(self) -> Node[list[Any]]:
        """A fresh node of this slot's batches of plain rows (before ``collate``)."""
        return slot_batches(
            self.stream,
            self.pieces,
            shuffle_buffer=self.shuffle_buffer,
            seed=self.shuffle_seed,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
        )


class SlotPipeline:
    """The pipeline of one slot (:func:`~meshfeed.sources.stream.slot_batches` then
    ``collate``), with explicit state."""

    def __init__(self, config: SlotConfig, state: dict[str, Any] | None) -> None:
        self.node = config.rows()
        self.collate = config.collate_fn or default_collate
        if state is not None:
            self.node.load_state_dict(state)

    def next(self) -> tuple[Any, dict[str, Any]]:
        """``(batch, snapshot after it)``, or ``(None, snapshot)`` at the end; the snapshot
        may hold :class:`~meshfeed.nodes.Deferred` fields (``materialize`` it to save it)."""
        try:
            rows = self.node.next()
        except StopIteration:
            return None, self.node.snapshot()
        return self.collate(rows), self.node.snapshot()


class InProcessSlots:
    """Every slot of this rank in the calling process."""

    def __init__(self, configs: list[SlotConfig], states: list[dict[str, Any] | None]) -> None:
        self.pipes = [SlotPipeline(c, s) for c, s in zip(configs, states, strict=True)]

    def next(self, w: int) -> tuple[Any, dict[str, Any]]:
        return self.pipes[w].next()

    def close(self) -> None:
        self.pipes = []


def _start_slot(
    worker: int,
    num_workers: int,
    configs: list[SlotConfig],
    states: list[dict[str, Any] | None],
) -> Callable[[Any], tuple[Any, dict[str, Any]]]:
    pipe = SlotPipeline(configs[worker], states[worker])
    return lambda _request: pipe.next()


class ProcessSlots:
    """One worker process per slot (a :class:`~meshfeed.runtime.WorkerPool`); ``prefetch``
    batches requested ahead per worker."""

    def __init__(
        self,
        configs: list[SlotConfig],
        states: list[dict[str, Any] | None],
        *,
        prefetch: int,
        timeout: float | None,
        start_method: str | None = None,
    ) -> None:
        self.prefetch = prefetch
        self.pool = WorkerPool(
            len(configs),
            timeout=timeout,
            start_method=start_method,
            name="meshfeed-stream-worker",
            ring=prefetch + 2,
        )
        self.timeout = self.pool.timeout
        self.pool.start(_start_slot, configs, states)
        for w in range(len(configs)):
            for _ in range(prefetch):
                self._request(w)

    def _request(self, w: int) -> None:
        try:
            self.pool.send(w, "next")
        except WorkerError as e:
            raise self._translate(w, e) from None

    def _translate(self, w: int, error: WorkerError) -> StreamWorkerError:
        if isinstance(error, WorkerTimeout):
            return StreamWorkerError(
                f"stream worker {w} produced no batch within timeout={self.timeout}s; the "
                "reader may be stuck on I/O. Raise timeout= if a batch legitimately takes longer"
            )
        if isinstance(error, WorkerDied):
            return StreamWorkerError(
                f"stream worker {w} (pid {error.pid}) exited with exit code {error.exitcode}; "
                "it may have run out of memory or been killed. Restore from the last checkpoint"
            )
        return StreamWorkerError(str(error))

    def next(self, w: int) -> tuple[Any, dict[str, Any]]:
        if not self.pool.started:
            raise StreamWorkerError("ProcessSlots.next() after close(); open new slots")
        if self.pool.pending(w) == 0:
            self._request(w)
        try:
            batch, state = self.pool.recv(w)
        except WorkerError as e:
            self.close()
            raise self._translate(w, e) from None
        except Exception as e:
            self.close()
            raise StreamWorkerError(f"{type(e).__name__}: {e}") from e
        if batch is not None:
            self._request(w)
        return batch, state

    def close(self) -> None:
        self.pool.shutdown()
