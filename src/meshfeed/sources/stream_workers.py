"""Where a stream slot's pipeline runs: in the calling process or in one worker process each.

A slot pipeline is :func:`~meshfeed.sources.stream.slot_batches` then ``collate``, over the
pieces assigned to one (data rank, worker). ``next()`` returns ``(batch, state after it)`` or
``(None, state)`` at the end, so the loader can record the state of the last batch it returned.

:class:`ProcessSlots` runs each slot in its own process of a :class:`~meshfeed.runtime.WorkerPool`
(requests of ``prefetch`` batches, two outstanding per worker): a dead worker is noticed at
once and a stalled one after ``timeout`` seconds, never a hang, and the workers are stopped (SIGTERM, then
SIGKILL) before :class:`StreamWorkerError` is raised. A worker's exception is raised as
:class:`StreamWorkerError` chained to the original (``__cause__``), with its traceback.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshfeed.collate import default_collate
from meshfeed.nodes.base import Deferred, Node
from meshfeed.runtime import WorkerDied, WorkerError, WorkerPool, WorkerTimeout
from meshfeed.sources.stream import Piece, PieceReader, ShardedStream, slot_batches

__all__ = [
    "InProcessSlots",
    "LiveState",
    "ProcessSlots",
    "SlotConfig",
    "SlotPipeline",
    "StreamWorkerError",
]


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


def _reader_of(node: Any) -> PieceReader:
    """The :class:`PieceReader` at the bottom of a slot's node chain."""
    while not isinstance(node, PieceReader):
        node = node.source
    return node


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


def _state_of(node: Node[Any]) -> dict[str, Any]:
    return node.state_dict()


def _moved_on(node: Node[Any]) -> dict[str, Any]:
    raise ValueError(
        "this stream loader's state is no longer known exactly: collate_fn raised on the batch "
        "after it, and the slot's shuffle buffer had already moved past that batch; restore from a "
        "checkpoint saved before the error (or use num_workers >= 1, where the state of the "
        "last batch returned is kept as sent)"
    )


class LiveState(Deferred):
    """The state of an in-process slot pipeline, written out only when materialised.

    Exact as long as the pipeline has not moved on since: the loader replaces it with every
    batch (and at the end of the slot) and materialises it before the pipeline is used again.
    ``skipped`` is the slot's skip count at once (read per batch, without the state). Never
    pickled: it refers to the live pipeline.
    """

    __slots__ = ("skipped",)

    def __init__(self, node: Node[Any], skipped: int) -> None:
        super().__init__(_state_of, node)
        self.skipped = skipped


class InProcessSlots:
    """Every slot of this rank in the calling process; states are :class:`LiveState`, so a
    batch costs no state snapshot (the loader materialises one only when it saves)."""

    def __init__(self, configs: list[SlotConfig], states: list[dict[str, Any] | None]) -> None:
        self.pipes = [SlotPipeline(c, s) for c, s in zip(configs, states, strict=True)]
        self._readers = [_reader_of(p.node) for p in self.pipes]
        self._last: list[LiveState | None] = [None] * len(self.pipes)

    def next(self, w: int) -> tuple[Any, LiveState]:
        pipe, reader = self.pipes[w], self._readers[w]
        cursor = reader.cursor()
        try:
            rows = pipe.node.next()
        except StopIteration:
            return None, LiveState(pipe.node, reader.skipped)
        except Exception:
            # A read raised: the reader may have counted rows of the batch that was never
            # returned. After a first batch the buffer is full and changes only after a read
            # succeeds, so rewinding the reader makes the live state again the state as of
            # the last batch returned. (Before one, the loader holds the state it started
            # from, not a live one.)
            if self._last[w] is not None:
                reader.rewind(cursor)
            raise
        try:
            batch = pipe.collate(rows)
        except Exception:
            # The pipeline moved past a batch that was never returned. Without a buffer the
            # reader rewinds; a buffer cannot, so the last state returned must not be
            # written out as if it were exact.
            if getattr(pipe.node, "source", None) is reader:
                reader.rewind(cursor)
            elif self._last[w] is not None:
                self._last[w].fn = _moved_on  # type: ignore[union-attr]
            raise
        self._last[w] = live = LiveState(pipe.node, reader.skipped)
        return batch, live

    def close(self) -> None:
        self.pipes = []


class _ChunkHandler:
    """A worker's handler: request ``count`` -> up to ``count`` ``(batch, snapshot)`` pairs,
    ending early after the end marker ``(None, snapshot)``.

    An error after some batches of a chunk is held back: those batches are returned, and the
    error is raised by the next request, so the main process sees it at the same batch as
    without chunks (the step at which every rank stops does not depend on the chunk size).
    """

    def __init__(self, pipe: SlotPipeline) -> None:
        self.pipe = pipe
        self.error: Exception | None = None

    def __call__(self, count: int) -> list[tuple[Any, dict[str, Any]]]:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        out: list[tuple[Any, dict[str, Any]]] = []
        for _ in range(count):
            try:
                batch, snap = self.pipe.next()
            except Exception as exc:
                if not out:
                    raise
                self.error = exc
                break
            out.append((batch, snap))
            if batch is None:
                break
        return out


def _start_slot(
    worker: int,
    num_workers: int,
    configs: list[SlotConfig],
    states: list[dict[str, Any] | None],
) -> Callable[[int], list[tuple[Any, dict[str, Any]]]]:
    return _ChunkHandler(SlotPipeline(configs[worker], states[worker]))


class ProcessSlots:
    """One worker process per slot (a :class:`~meshfeed.runtime.WorkerPool`).

    Each request asks a worker for ``prefetch`` batches at once (one pipe message and one
    shared-memory slot for all of them, so the main process pays its per-message cost once per
    ``prefetch`` batches; the first request of a worker asks for one), and two requests are kept
    outstanding per worker so it never waits for the main process: up to ``3 * prefetch``
    batches per worker are made ahead of the one returned. ``timeout`` bounds the wait for one
    request's batches.
    """

    _IN_FLIGHT = 2

    def __init__(
        self,
        configs: list[SlotConfig],
        states: list[dict[str, Any] | None],
        *,
        prefetch: int,
        timeout: float | None,
        start_method: str | None = None,
    ) -> None:
        self.chunk = max(1, prefetch)
        self.pool = WorkerPool(
            len(configs),
            timeout=timeout,
            start_method=start_method,
            name="meshfeed-stream-worker",
            ring=self._IN_FLIGHT + 2,
        )
        self.timeout = self.pool.timeout
        self.ready: list[deque[tuple[Any, dict[str, Any]]]] = [deque() for _ in configs]
        self.ended = [False] * len(configs)
        self.pool.start(_start_slot, configs, states)
        for w in range(len(configs)):
            # The first request is for one batch, so the first batch is not held back while
            # the rest of a chunk is made.
            self._request(w, 1)
            for _ in range(self._IN_FLIGHT - 1):
                self._request(w)

    def _request(self, w: int, count: int | None = None) -> None:
        try:
            self.pool.send(w, count or self.chunk)
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
        ready = self.ready[w]
        if not ready:
            if self.pool.pending(w) == 0:
                self._request(w)
            try:
                chunk = self.pool.recv(w)
            except WorkerError as e:
                self.close()
                raise self._translate(w, e) from None
            except Exception as e:
                self.close()
                raise StreamWorkerError(f"{type(e).__name__}: {e}") from e
            ready.extend(chunk)
            self.ended[w] = bool(chunk) and chunk[-1][0] is None
            if not self.ended[w]:
                self._request(w)
            if not ready:  # a worker answers every request with one pair at least
                self.close()
                raise StreamWorkerError(f"stream worker {w} returned an empty chunk")
        return ready.popleft()

    def close(self) -> None:
        self.pool.shutdown()
