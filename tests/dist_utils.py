"""Multi-process test support: real gloo ranks via meshfeed.launch, and the order in which
ranks' processes exit (a rank that gave up on a stalled peer must be able to leave)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from meshfeed.launch import free_port, run_distributed

__all__ = ["exit_order", "free_port", "run_distributed"]


def exit_order(
    target: Callable[..., Any],
    world: int,
    out_dir: str,
    within: float,
    *,
    wait_rest: bool = False,
) -> list[int]:
    """Spawn ``target(rank, world, port, out_dir)`` for every rank and return the ranks whose
    processes had exited when the first one did (within ``within`` seconds). ``wait_rest``:
    then let the others finish until that deadline (they write their results); any process
    still alive after it is killed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + within
        while all(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        first = [r for r, p in enumerate(procs) if not p.is_alive()]
        if wait_rest:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return first
