"""Where a stream slot's pipeline runs: in the calling process or in one worker process each.

A slot pipeline is ``PieceReader -> ShuffleBuffer -> Batcher -> collate`` over the pieces
assigned to one (data rank, worker). ``next()`` returns ``(batch, state after it)`` or
``(None, state)`` at the end, so the loader can record the state of the last batch it returned.

:class:`ProcessSlots` runs each slot in its own process. The main process asks for batches
(``prefetch`` requests outstanding per worker) over a duplex pipe and waits on the pipe *and*
the process sentinel with a timeout: a dead worker is noticed at once and a stalled one after
``timeout`` seconds, never a hang. Batches travel as :mod:`meshfeed.services.wire` bytes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from meshfeed.collate import default_collate
from meshfeed.nodes.batch import Batcher
from meshfeed.nodes.shuffle import ShuffleBuffer
from meshfeed.services.wire import dumps, loads
from meshfeed.sources.stream import Piece, PieceReader, ShardedStream

__all__ = ["InProcessSlots", "ProcessSlots", "SlotConfig", "SlotPipeline", "StreamWorkerError"]


class StreamWorkerError(RuntimeError):
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


class SlotPipeline:
    """The pipeline of one slot, with explicit state."""

    def __init__(self, config: SlotConfig, state: dict[str, Any] | None) -> None:
        stream = config.stream
        self.reader = PieceReader(stream, config.pieces)
        self.shuffle = ShuffleBuffer(
            self.reader,
            size=config.shuffle_buffer,
            seed=config.shuffle_seed,
            ref=lambda item: item[0],
            load=lambda refs: list(zip(refs, stream.load_rows(refs), strict=True)),
        )
        self.batcher = Batcher(
            self.shuffle, batch_size=config.batch_size, drop_last=config.drop_last
        )
        self.collate = config.collate_fn or default_collate
        if state is not None:
            self.batcher.restore(state)

    def next(self) -> tuple[Any, dict[str, Any]]:
        try:
            rows = self.batcher.next()
        except StopIteration:
            return None, self.batcher.get_state()
        return self.collate([row for _, row in rows]), self.batcher.get_state()


class InProcessSlots:
    """Every slot of this rank in the calling process."""

    def __init__(self, configs: list[SlotConfig], states: list[dict[str, Any] | None]) -> None:
        self.pipes = [SlotPipeline(c, s) for c, s in zip(configs, states, strict=True)]

    def next(self, w: int) -> tuple[Any, dict[str, Any]]:
        return self.pipes[w].next()

    def close(self) -> None:
        self.pipes = []


def _worker_main(
    config: SlotConfig, state: dict[str, Any] | None, conn: Connection, worker: int
) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        pipe = SlotPipeline(config, state)
    except Exception as exc:
        conn.send_bytes(dumps(("error", type(exc).__name__, str(exc), traceback.format_exc())))
        return
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if request is None:
            return
        try:
            batch, state = pipe.next()
            conn.send_bytes(dumps(("ok", batch, state)))
        except Exception as exc:
            with contextlib.suppress(Exception):
                conn.send_bytes(
                    dumps(("error", type(exc).__name__, str(exc), traceback.format_exc()))
                )
            return


class ProcessSlots:
    """One process per slot; ``prefetch`` batches requested ahead per worker."""

    def __init__(
        self,
        configs: list[SlotConfig],
        states: list[dict[str, Any] | None],
        *,
        prefetch: int,
        timeout: float,
        start_method: str | None = None,
    ) -> None:
        methods = mp.get_all_start_methods()
        ctx: Any = mp.get_context(start_method or ("fork" if "fork" in methods else "spawn"))
        self.timeout, self.prefetch = float(timeout), prefetch
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.outstanding: list[int] = []
        for w, (config, state) in enumerate(zip(configs, states, strict=True)):
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(config, state, theirs, w),
                name=f"meshfeed-stream-worker-{w}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
            self.outstanding.append(0)
            for _ in range(prefetch):
                self._request(w)

    def _request(self, w: int) -> None:
        try:
            self.conns[w].send("next")
        except OSError:
            self._died(w)
        self.outstanding[w] += 1

    def _died(self, w: int) -> NoReturn:
        proc = self.procs[w]
        proc.join(timeout=1.0)
        self.close()
        raise StreamWorkerError(
            f"stream worker {w} (pid {proc.pid}) exited with exit code {proc.exitcode}; it may "
            "have run out of memory or been killed. Restore from the last checkpoint"
        )

    def next(self, w: int) -> tuple[Any, dict[str, Any]]:
        if self.outstanding[w] == 0:
            self._request(w)
        conn, proc = self.conns[w], self.procs[w]
        ready = wait([conn, proc.sentinel], timeout=self.timeout)
        if not ready:
            self.close()
            raise StreamWorkerError(
                f"stream worker {w} produced no batch within timeout={self.timeout}s; the "
                "reader may be stuck on I/O. Raise timeout= if a batch legitimately takes longer"
            )
        try:
            if conn not in ready and not conn.poll(0.05):
                self._died(w)
            message = loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._died(w)
        self.outstanding[w] -= 1
        if message[0] == "error":
            _, kind, text, tb = message
            self.close()
            raise StreamWorkerError(f"{kind}: {text}\n\n(raised in stream worker {w}:)\n{tb}")
        _, batch, state = message
        if batch is not None:
            self._request(w)
        return batch, state

    def close(self) -> None:
        procs, self.procs = self.procs, []
        for c in self.conns:
            with contextlib.suppress(OSError, ValueError, BrokenPipeError):
                c.send(None)
        for p in procs:
            p.join(timeout=0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
        for c in self.conns:
            c.close()
        self.conns, self.outstanding = [], []
