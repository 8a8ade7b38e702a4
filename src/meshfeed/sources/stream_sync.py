"""Keeping the ranks of a stream together: tiny all-reduces with a bounded wait.

Streams have no known length, so ranks can run out at different steps. After each local batch
every rank joins one ``all_reduce(MIN)`` of a single int ("I have a batch"), torchdata's
``fullsync`` semantics at one collective per batch instead of one per element. Every wait is
bounded by a timeout: a rank that stalls, dies or stops iterating is reported on the others
instead of hanging them. Without an initialised process group (or with one rank) these are
local no-ops, so single-process simulations of all ranks run the same code.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

__all__ = ["all_ranks_have_a_batch", "check_agreement"]


def all_ranks_have_a_batch(mine: bool, timeout: float) -> bool:
    """True when every rank has a next batch (one all_reduce(MIN) of one int)."""
    return bool(_all_reduce([1 if mine else 0], "min", timeout)[0])


def check_agreement(values: Mapping[str, int], timeout: float) -> None:
    """Raise ValueError on every rank if any of these small ints differs across ranks."""
    names = list(values)
    low = _all_reduce([int(values[n]) for n in names], "min", timeout)
    high = _all_reduce([int(values[n]) for n in names], "max", timeout)
    for name, lo, hi in zip(names, low, high, strict=True):
        if lo != hi:
            raise ValueError(
                f"stream loaders disagree on {name} across ranks (values from {lo} to {hi}); "
                "build every rank's StreamLoader with the same stream and settings"
            )


def _all_reduce(values: list[int], op: str, timeout: float) -> list[int]:
    """All-reduce a few int64s over the default group with a bounded wait (local if no group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    reduce_op = dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX
    message = (
        f"rank {dist.get_rank()} waited more than timeout={timeout}s for the other ranks to "
        "agree on the stream; a rank has stalled, died or stopped iterating"
    )
    try:
        work = dist.all_reduce(t, op=reduce_op, async_op=True)
        done = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise RuntimeError(message) from exc
    if done is False:
        raise RuntimeError(message)
    return [int(x) for x in t.cpu().tolist()]
