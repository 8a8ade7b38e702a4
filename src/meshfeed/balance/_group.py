"""The gloo group BalancedBatches' collectives run on: meshfeed's own, over the caller's ranks.

A collective still pending on a group blocks the process's exit until that group's timeout
(30 minutes for a default group). So BalancedBatches never leaves one on the caller's group:
it runs its collectives on a gloo group of meshfeed's own over the same ranks, whose timeout is
its ``timeout``, and a collective it gave up on also ends inside the backend at ``timeout``.
The caller's group only names the ranks (and, for NCCL, carries the tokens' ``all_to_all``,
unless BalancedBatches runs on another thread than the one that built it, e.g. wrapped in
:class:`~meshfeed.delivered.Delivered`: collectives issued from two threads on one group
would interleave differently on each rank, and making an NCCL group there would be a
collective on the default communicator, which the loop's thread drives; so there the tokens
move on the gloo group too, and arrive on the CPU as they do from NCCL).

Over every rank of the job this is :func:`meshfeed.dist.control_group`. Over fewer (a DP x CP
group per TP rank or pipeline stage, whose other ranks may never build a BalancedBatches) it is
made with ``torch.distributed``'s local synchronisation: only the group's ranks take part, in
the order in which they build their BalancedBatches, as they do the collectives themselves.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch.distributed as tdist

from meshfeed import dist
from meshfeed.errors import CollectiveError

__all__ = ["exchange_group", "own_group"]

#: A longer timeout overflows timedelta near 1e9 days; a year is "no limit" for a collective.
_LONGEST = 365 * 86400.0

_GROUPS: dict[tuple[tuple[int, ...], float], Any] = {}
_WORLD: list[Any] = [None]
_LOCK = threading.Lock()


def own_group(group: Any, timeout: float, owner: str = "BalancedBatches") -> Any:
    """A gloo group over ``group``'s ranks, in its rank order, whose timeout is ``timeout``
    seconds; ``group`` itself without a process group or with one rank (no collective runs).

    Made on first use (a collective of ``group``'s ranks, bounded by ``timeout``) and kept per
    ranks and timeout; on a delivery thread, that thread's own (:func:`meshfeed.dist.thread_group`).
    A rank that never arrives makes it a :class:`~meshfeed.errors.CollectiveError` naming
    ``owner``'s process group."""
    if not dist.is_distributed(group):
        return group
    if group is None:  # the default group: every rank
        ranks = tuple(range(tdist.get_world_size()))
    else:
        ranks = tuple(dist.group_ranks(group))
    if ranks == tuple(range(tdist.get_world_size())):
        return dist.control_group(timeout)
    if dist.on_delivery_thread():  # that thread's own, as dist.control_group's are
        made = dist.thread_group(
            ("own", ranks, float(timeout)), lambda: _new_group(ranks, float(timeout), owner)
        )
        return made
    with _LOCK:
        if _WORLD[0] is not tdist.group.WORLD:  # a new default group: new groups too
            _GROUPS.clear()
            _WORLD[0] = tdist.group.WORLD
        key = (ranks, float(timeout))
        if key not in _GROUPS:
            _GROUPS[key] = _new_group(ranks, float(timeout), owner)
        return _GROUPS[key]


def exchange_group(group: Any, timeout: float, built_on: int, owner: str) -> Any:
    """The group a data exchange (the tokens' ``all_to_all``) runs on: the caller's ``group``
    on the thread that built its owner (``built_on``, a ``threading.get_ident()``); on another
    thread or a delivery thread, meshfeed's gloo group over its ranks (:func:`own_group`): the
    loop's own collectives on ``group`` (DDP's, FSDP's, Megatron's gradient reduction) would
    interleave with it in another order on each rank, and making an NCCL group there would be a
    collective on the default communicator, which the loop's thread drives. The results arrive
    on the CPU either way."""
    if threading.get_ident() == built_on and not dist.on_delivery_thread():
        return group
    return own_group(group, timeout, owner)


def _new_group(ranks: tuple[int, ...], timeout: float, owner: str) -> Any:
    # Ranks out of order keep it: group rank i is the caller's group rank i.
    order: dict[str, Any] = {} if list(ranks) == sorted(ranks) else {"sort_ranks": False}
    start = time.monotonic()
    try:
        return tdist.new_group(
            list(ranks),
            timeout=datetime.timedelta(seconds=min(timeout, _LONGEST)),
            backend="gloo",
            use_local_synchronization=True,
            group_desc="meshfeed-balanced",
            **order,
        )
    except RuntimeError as exc:  # gloo's rendezvous: a rank of the group never came
        elapsed = time.monotonic() - start
        raise CollectiveError(
            f"global ranks {list(ranks)} did not all set up {owner}'s process group over them "
            f"within {elapsed:.1f}s; raise {owner}(timeout=) if a rank legitimately comes later "
            f"({' '.join(str(exc).split())[:300]})",
            this_rank=tdist.get_rank(),
            reason="timeout" if elapsed >= 0.95 * timeout else "closed",
            elapsed=elapsed,
        ) from exc
