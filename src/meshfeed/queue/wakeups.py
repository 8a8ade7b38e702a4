"""Targeted wake-ups and bounded waits for both store backends.

A blocked ``put`` or ``get`` registers a :class:`Waiter` saying what it waits *for*: a consumer
names its partition, task and the fields it needs; a producer waits for capacity. A state
change wakes only the waiters it may serve (:meth:`Waiters.wake_consumers` for a put of some
fields to one partition, :meth:`Waiters.wake_producers` when capacity was freed), an admin
change (close, clear, delete, reset, restore) wakes every waiter, and :meth:`Waiters.cancel`
wakes the waiters of one request token, which then raise :class:`RequestCancelled`. The
backend supplies how to wake one waiter (a ``threading.Condition`` or an ``asyncio.Event``).

Timeouts: :func:`check_timeout` refuses NaN, negative and non-numbers by name, turns
``inf`` into ``None`` (wait without limit), and every single wait is capped at
:data:`MAX_WAIT_CHUNK` seconds, so a huge timeout (``1e10``) never overflows a wait call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable
from typing import Any

__all__ = ["MAX_WAIT_CHUNK", "RequestCancelled", "Waiter", "Waiters", "check_timeout"]

#: Longest single wait (seconds); longer timeouts wait in chunks of this.
MAX_WAIT_CHUNK = 3600.0


class RequestCancelled(Exception):
    """A waiting request was cancelled with ``SampleStore.cancel(token)`` (a loader's
    ``shutdown()``): it consumed nothing."""


def check_timeout(timeout: Any, what: str = "timeout") -> float | None:
    """``timeout`` as seconds or ``None`` (no limit); refuses bad values by name."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{what} must be seconds (a number) or None (got {what}={timeout!r})")
    if math.isnan(timeout):
        raise ValueError(
            f"{what} must be a number of seconds, not NaN (got {what}={timeout!r}); use None "
            "or math.inf to wait without limit"
        )
    if timeout < 0:
        raise ValueError(f"{what} must be >= 0 seconds or None (got {what}={timeout!r})")
    if math.isinf(timeout):
        return None
    return float(timeout)


class Waiter:
    """One blocked call: ``kind`` is ``"consumer"`` or ``"producer"``; a consumer's
    ``partition``, ``task`` and ``need`` (fields) say which puts may serve it."""

    __slots__ = ("cancelled", "kind", "need", "notify", "partition", "task", "token", "woken")

    def __init__(
        self,
        kind: str,
        notify: Callable[[], None],
        *,
        partition: str | None = None,
        task: str | None = None,
        need: Collection[str] = (),
        token: Hashable | None = None,
    ) -> None:
        self.kind, self.notify = kind, notify
        self.partition, self.task, self.need = partition, task, frozenset(need)
        self.token = token
        self.cancelled = False
        self.woken = 0  # how many times a change woke it (tests check wake-ups are targeted)

    def wake(self) -> None:
        self.woken += 1
        self.notify()


class Waiters:
    """The registry of blocked calls of one store; not thread-safe (the backend locks it)."""

    def __init__(self) -> None:
        self.waiters: list[Waiter] = []
        self.cancelled: set[Hashable] = set()

    def add(self, waiter: Waiter) -> None:
        if waiter.token is not None and waiter.token in self.cancelled:
            waiter.cancelled = True
        self.waiters.append(waiter)

    def remove(self, waiter: Waiter) -> None:
        self.waiters.remove(waiter)

    def count(self, kind: str) -> int:
        return sum(1 for w in self.waiters if w.kind == kind)

    def wake_consumers(self, partition: str, fields: Collection[str] | None = None) -> None:
        """A put of ``fields`` (``None``: anything, e.g. a shared plan) to ``partition``."""
        for w in self.waiters:
            if (
                w.kind == "consumer"
                and w.partition == partition
                and (fields is None or not w.need or not w.need.isdisjoint(fields))
            ):
                w.wake()

    def wake_task(self, partition: str, task: str) -> None:
        """A get of ``task`` planned a batch other readers (replica peers) may now read."""
        for w in self.waiters:
            if w.kind == "consumer" and w.partition == partition and w.task == task:
                w.wake()

    def wake_producers(self) -> None:
        for w in self.waiters:
            if w.kind == "producer":
                w.wake()

    def wake_all(self) -> None:
        for w in self.waiters:
            w.wake()

    def cancel(self, token: Hashable) -> None:
        """Cancel the waiting and future requests made with ``token``."""
        self.cancelled.add(token)
        for w in self.waiters:
            if w.token == token:
                w.cancelled = True
                w.wake()

    def check(self, waiter: Waiter) -> None:
        if waiter.cancelled:
            raise RequestCancelled(
                f"request with token {waiter.token!r} was cancelled while waiting; nothing "
                "was consumed (a loader's shutdown() cancels its requests)"
            )
