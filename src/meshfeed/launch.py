"""Launch a function on N local processes joined by a gloo process group.

The demo and the multi-process tests use this to run real ``torch.distributed`` ranks on one
machine (CPU, gloo). Production jobs use torchrun; meshfeed reads the same environment.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
)

from meshfeed.dist import _check_timeout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out_dir: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        try:
            result = fn(rank, world, *args)
        except BaseException:  # noted first: the peers may fail on the torn-down group sooner
            with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
                f.write(f"{time.time():.6f}\n{traceback.format_exc()}")
            raise
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        # No rank tears the group down while a peer may still be receiving from it (that
        # aborted a peer's process now and then). Bounded; a group that ``fn`` left in a failed
        # collective (a test of timeouts) cannot complete it, and that is not an error here.
        with contextlib.suppress(RuntimeError):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo processes; return the results.

    ``fn`` must be importable (a module-level function). An exception in any process is
    raised here (``ProcessRaisedException`` naming the rank that raised first, with its
    traceback: its peers, left in a torn-down group, fail after it); a rank that exits without
    a result is named; a run longer than ``timeout`` seconds kills the processes and raises
    ``TimeoutError``, so a broken collective cannot hang the caller. ``timeout`` is checked as
    :mod:`meshfeed.dist` checks its own (positive seconds; ``math.inf``: a year).
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive number of processes (got {world=})")
    timeout = _check_timeout(timeout)
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world, port, fn, args, out_dir),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"{world} processes did not finish within {timeout}s")
        except ProcessException as exc:
            first = _first_failure(out_dir, world)
            died = isinstance(exc, ProcessExitedException) and not os.path.exists(
                os.path.join(out_dir, f"{exc.error_index}.err")
            )  # killed by a signal, or exited in native code: that is the first failure
            if first is None or died:
                raise
            rank, text = first
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise ProcessRaisedException(
                f"rank {rank} of {world} raised first (the failures of other ranks follow from "
                f"it):\n\n{text}",
                rank,
                ctx.processes[rank].pid,
            ) from exc
        missing = [r for r in range(world) if not os.path.exists(os.path.join(out_dir, f"{r}.pt"))]
        if missing:
            codes = [ctx.processes[r].exitcode for r in missing]
            raise RuntimeError(
                f"rank(s) {missing} of {world} exited (exit codes {codes}) without returning a "
                "result: fn called sys.exit or os._exit; return a value from fn instead"
            )
        return [
            torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)
        ]


def _first_failure(out_dir: str, world: int) -> tuple[int, str] | None:
    """The rank whose ``fn`` raised first, and its traceback (None: no ``fn`` raised)."""
    noted = []
    for r in range(world):
        path = os.path.join(out_dir, f"{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                when, _, text = f.read().partition("\n")
            noted.append((float(when), r, text))
    if not noted:
        return None
    _, rank, text = min(noted)
    return rank, text
