"""Stalls at capacity: a request that can never be served, and producers and consumers that
wait on each other.

With ``capacity=C`` a get that needs more than ``C`` samples at once (``batch_size``, or a
rank-aware round of ``data_world_size * batch_size``) can never be served: it is refused at
once by :func:`check_fits`. A get that fits can still wait on a put that waits on it: held
samples too few for the waiting consumers' batches, but too many to leave room for the waiting
producers' puts (e.g. ``C=4``, 3 held, a get of 4 and a put of 4). Only a newcomer (another
task's consumer, a ``close``, a ``delete``) can end that, so :func:`describe_stall` names it:
the backends log it as a warning when a wait has lasted :data:`STALL_WARN` seconds in that
state and add it to the ``TimeoutError``, so a stall is never silent (#28).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from meshfeed.queue.engine.records import StoreOptions
from meshfeed.queue.engine.wakeups import MAX_WAIT_CHUNK, Waiters
from meshfeed.queue.samplers import LengthBalancedSampler, RankAwareSampler, Sampler

__all__ = ["STALL_WARN", "StallWatch", "check_fits", "describe_stall", "timed_out"]

log = logging.getLogger("meshfeed")
#: Seconds a put or get waits in a stall before it is logged (a stall often passes: a
#: producer completes held samples); the TimeoutError names it whenever it ends a wait.
STALL_WARN = 10.0


def round_size(sampler: Sampler, batch_size: int) -> int:
    """The samples one get plans at once: a round of every data rank's batch on a mesh."""
    if isinstance(sampler, RankAwareSampler | LengthBalancedSampler):
        return batch_size * sampler.data_world_size
    return batch_size


def check_fits(
    options: StoreOptions, sampler: Sampler, batch_size: int, prefetch: int | None = None
) -> None:
    """Refuse a get that needs more samples at once than the store can hold. ``prefetch``: the
    reader's window where its plans pin their samples (a loader's, on a store that evicts):
    the ``prefetch - 1`` rounds before this one stay held, consumed, until it acknowledges
    them (:mod:`meshfeed.queue.engine.plans`), so ``prefetch`` rounds must fit."""
    cap = options.capacity
    one = round_size(sampler, batch_size)
    window = prefetch or 1
    need = one * window
    if cap is None or need <= cap:
        return
    if window == 1:
        raise ValueError(
            f"a get of {batch_size=} plans {need} samples at once, more than the store's "
            f"capacity={cap} can ever hold, so it would wait forever; raise capacity to at "
            f"least {need} or ask for smaller batches"
        )
    raise ValueError(
        f"a reader with prefetch={window} (a StoreLoader's batches in flight) keeps the samples "
        f"of its last {window - 1} round(s) of {one} held until it moves past them, and needs "
        f"{one} more for the next: {need} samples, more than the store's capacity={cap}, so it "
        f"would wait forever; raise capacity to at least {need} (plus the samples of one put), "
        "or use prefetch=1 (and no device_prefetch) on the loader"
    )


def describe_stall(held: int, capacity: int | None, waiters: Waiters) -> str | None:
    """Why the waiting producers and consumers wait on each other, or ``None`` if they do not
    (no capacity, no producer short of room, or no consumer waiting)."""
    if capacity is None:
        return None
    free = capacity - held
    short = [w.size for w in waiters.waiters if w.kind == "producer" and (w.size or 0) > free]
    consumers = [w.request.describe() for w in waiters.waiters if w.request is not None]
    if not short or not consumers or len(short) < waiters.count("producer"):
        return None
    return (
        f"the store holds {held} samples of capacity={capacity} ({free} free): "
        f"{len(short)} put(s) wait for room for {short} new samples while "
        f"{len(consumers)} get(s) wait for samples ({'; '.join(sorted(set(consumers)))}); "
        "unless a producer completes held samples, another consumer takes some, or a "
        "close() or delete() frees room, they wait on each other. Keep batch_size x "
        "prefetch (a loader's batches in flight stay held) + samples per put <= capacity "
        "+ 1 (per task), raise capacity, or put fewer samples at a time"
    )


class StallWatch:
    """One wait's clock: its ``timeout`` (seconds, ``None``: no limit) and its stall warning:
    once it has waited :data:`STALL_WARN` seconds, the stall is logged if the store is in one
    (waits are cut to wake up for it)."""

    __slots__ = ("at", "deadline", "timeout")

    def __init__(self, timeout: float | None = None) -> None:
        now = time.monotonic()
        self.at: float | None = now + STALL_WARN
        self.timeout = timeout
        self.deadline = None if timeout is None else now + timeout

    def next(
        self,
        what: str,
        why: Callable[[], str | None],
        wake_by: Callable[[], float | None],
        longest: float = MAX_WAIT_CHUNK,
    ) -> float:
        """Seconds to wait before trying again: at most ``longest``, and no later than
        ``wake_by()`` (a ``time.monotonic()`` to try again unprompted, e.g. a lease deadline,
        or ``None``) or the stall warning. ``why()``: the stall, logged when the warning is
        due; ``TimeoutError`` naming ``what`` and the stall once the timeout ran out."""
        if self.at is not None and time.monotonic() >= self.at:
            self.at = None
            reason = why()
            if reason is not None:
                log.warning("sample store stalled: %s", reason)
        remaining = None if self.deadline is None else self.deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(timed_out(what, self.timeout, why()))
        chunk = longest if remaining is None else min(remaining, longest)
        due = wake_by()
        if due is not None:
            chunk = max(0.0, min(chunk, due - time.monotonic()))
        return chunk if self.at is None else max(0.0, min(chunk, self.at - time.monotonic()))


def timed_out(what: str, timeout: float | None, why: str | None) -> str:
    """The message of a wait that ran out of time, with the stall it was part of."""
    stalled = "" if why is None else f"; {why}"
    # Rounded: a worker's request waits for what its timeout has left (reach.py), a float
    # such as 1.4999957 for timeout=1.5, which the message shows as the 1.5 it was.
    after = round(timeout, 2) if timeout is not None and timeout >= 0.01 else timeout
    return (
        f"{what} timed out after {after}s; the store is unchanged and usable (retry, raise "
        f"the timeout, or check that producers are running){stalled}"
    )
