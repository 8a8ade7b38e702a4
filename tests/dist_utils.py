"""Run a function on N real processes joined by a gloo process group (CPU)."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch_save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def torch_save(obj: Any, path: str) -> None:
    import torch

    torch.save(obj, path)


def run_distributed(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Spawn ``world`` gloo processes running ``fn(rank, world, *args)``; return their results.

    ``fn`` must be importable (defined at module level of a test module). A failure in any
    process fails the call; results must be torch-serialisable.
    """
    import torch

    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world, port, fn, args, out_dir),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish within {timeout}s")
        return [
            torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)
        ]
