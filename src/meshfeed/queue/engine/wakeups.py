"""Targeted wake-ups and bounded waits for both store backends.

A blocked ``put`` or ``get`` registers a :class:`Waiter` saying what it waits *for*: a consumer
names its partition, task and the fields it needs; a producer waits for capacity. A state
change wakes only the waiters it may serve (:meth:`Waiters.wake_consumers` for a put of some
fields to one partition, :meth:`Waiters.wake_producers` when capacity was freed), an admin
change (close, clear, delete, reset, restore) wakes every waiter, and :meth:`Waiters.cancel`
wakes the waiters of one request token, which then raise :class:`RequestCancelled`. The
backend supplies how to wake one waiter (a ``threading.Condition`` or an ``asyncio.Event``).

Request tokens: a cancelled token is refused from then on, and a request refused consumes
nothing. A token of the caller's own (any hashable) is refused by remembering it, for as long
as the store lives: the store cannot tell when the last request made with it has come. A
:class:`Token` the store issued (:meth:`Waiters.issue`) is accepted only while the store holds
it, so cancelling it drops it: the store keeps one entry per token not yet cancelled, none per
token cancelled, and a request made with it after that, however late, is refused all the same.

Fewer wake-ups for crowds of like waiters (the cost of many threads is their context switches,
not the store's work):

- consumers with the same ``group`` (one task asking the same batch of the same sampler, so on
  one state they all succeed or all fail) are woken one at a time: a change wakes the first;
  it passes the wake to the next if it got a batch and more may be ready (``more()``), or if it
  leaves without trying (cancelled, an error); one that tried and failed stops the chain, as
  the others would fail the same way;
- producers that wait for capacity with a known ``size`` (how many new samples their put
  needs, as of their last attempt) are woken in order while the freed capacity covers them; a
  woken producer that fails, or leaves without trying, wakes in the same way those that the
  capacity free then (its ``room()``) covers, or every producer if it cannot tell; and a put
  that creates samples wakes the producers whose ``ids`` it created (their put may need less).

Waiters without a group or size (the Ray backend's, a custom sampler's) are woken by every
change that may concern them, as before.

Timeouts: :func:`check_timeout` refuses NaN, negative and non-numbers by name, turns
``inf`` into ``None`` (wait without limit), and every single wait is capped at
:data:`MAX_WAIT_CHUNK` seconds, so a huge timeout (``1e10``) never overflows a wait call.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Collection, Hashable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshfeed.queue.request import GetRequest

__all__ = ["MAX_WAIT_CHUNK", "RequestCancelled", "Token", "Waiter", "Waiters", "check_timeout"]

#: Longest single wait (seconds); longer timeouts wait in chunks of this.
MAX_WAIT_CHUNK = 3600.0


class RequestCancelled(Exception):
    """A waiting request was cancelled with ``SampleStore.cancel(token)`` (a loader's
    ``shutdown()``): it consumed nothing."""


@dataclass(frozen=True, slots=True)
class Token:
    """A request token the store issued (``SampleStore.new_token()``): accepted by that store
    until cancelled, then refused without being remembered (module docstring)."""

    id: str


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
    return None if math.isinf(timeout) else float(timeout)


@dataclass(eq=False, slots=True)
class Waiter:
    """One blocked call: ``kind`` is ``"consumer"`` or ``"producer"``; a consumer's
    ``partition``, ``task`` and ``need`` (fields) say which puts may serve it."""

    kind: str
    notify: Callable[[], None]
    _: KW_ONLY
    partition: str | None = None
    task: str | None = None
    need: frozenset[str] = frozenset()
    token: Hashable | None = None
    group: Hashable | None = None  # see the module docstring
    more: Callable[[], bool] | None = None
    size: int | None = None
    ids: frozenset[Hashable] | None = None
    room: Callable[[], int | None] | None = None
    request: GetRequest | None = None
    #: Woken as the one of its group / budget, not yet tried.
    baton: bool = field(default=False, init=False)
    cancelled: bool = field(default=False, init=False)
    #: How many times a change woke it (tests check wake-ups are targeted).
    woken: int = field(default=0, init=False)

    @classmethod
    def consumer(
        cls,
        notify: Callable[[], None],
        request: GetRequest,
        *,
        group: Hashable | None = None,
        more: Callable[[], bool] | None = None,
    ) -> Waiter:
        """The waiter of a blocked ``get``: which puts may serve ``request``."""
        return cls(
            "consumer",
            notify,
            partition=request.partition,
            task=request.task,
            need=frozenset(request.need),
            token=request.token,
            group=group,
            more=more,
            request=request,
        )

    def wake(self) -> None:
        self.woken += 1
        self.notify()


class Waiters:
    """The registry of blocked calls of one store; not thread-safe (the backend locks it)."""

    def __init__(self) -> None:
        self.waiters: list[Waiter] = []
        #: The callers' own tokens cancelled: refused for as long as the store lives.
        self.cancelled: set[Hashable] = set()
        #: The tokens issued and not yet cancelled: the only :class:`Token` accepted.
        self.issued: set[Token] = set()
        self.shut = False  # the store was shut down: every call is refused

    def issue(self) -> Token:
        """A new token, accepted until :meth:`cancel`."""
        token = Token(uuid.uuid4().hex)
        self.issued.add(token)
        return token

    def refuses(self, token: Hashable | None) -> bool:
        """Whether requests made with ``token`` are refused (it was cancelled)."""
        if token is None:
            return False
        if type(token) is Token:
            return token not in self.issued
        return token in self.cancelled

    def refusal(self, token: Hashable) -> RequestCancelled:
        """The error of a request refused because ``token`` was cancelled."""
        return RequestCancelled(
            f"request with token {token!r} was cancelled; nothing was consumed (a loader's "
            "shutdown() cancels its requests)"
        )

    def add(self, waiter: Waiter) -> None:
        if self.refuses(waiter.token):
            waiter.cancelled = True
        self.waiters.append(waiter)

    def remove(self, waiter: Waiter) -> None:
        self.waiters.remove(waiter)

    def count(self, kind: str) -> int:
        return sum(1 for w in self.waiters if w.kind == kind)

    def wake_consumers(self, partition: str, fields: Collection[str]) -> None:
        """A put of ``fields`` to ``partition``: every consumer it concerns, but only the
        first of each group."""
        groups: set[Hashable] = set()
        for w in self.waiters:
            if (
                w.kind == "consumer"
                and w.partition == partition
                and (not w.need or not w.need.isdisjoint(fields))
            ):
                if w.group is None:
                    w.wake()
                elif w.group not in groups:
                    groups.add(w.group)
                    if not w.baton:  # else it is about to try, and passes the wake on
                        w.baton = True
                        w.wake()

    def wake_task(self, partition: str, task: str) -> None:
        """A get of ``task`` planned a batch other readers (replica peers) may now read."""
        for w in self.waiters:
            if w.kind == "consumer" and w.partition == partition and w.task == task:
                w.wake()

    def wake_producers(self, free: int | None = None) -> None:
        """Capacity was freed: ``free`` samples fit now (``None``: no limit, or unknown).
        Producers of known size are woken in order while ``free`` covers them."""
        for w in self.waiters:
            if w.kind != "producer":
                continue
            if free is None or w.size is None:
                w.wake()
            elif w.size <= free:
                free -= w.size
                if not w.baton:  # else woken already and about to try
                    w.baton = True
                    w.wake()

    def wake_creators(self, ids: Collection[Hashable]) -> None:
        """A put created samples ``ids``: producers waiting to put to some of them need
        less capacity now."""
        for w in self.waiters:
            if w.kind == "producer" and w.ids is not None and not w.ids.isdisjoint(ids):
                w.wake()

    def tried(self, waiter: Waiter, ok: bool) -> None:
        """``waiter`` tried (``ok``: and succeeded); pass the wake on as the module says."""
        baton, waiter.baton = waiter.baton, False
        if waiter.kind == "consumer":
            if ok and waiter.group is not None and waiter.more is not None and waiter.more():
                self._pass(waiter)
        elif baton and not ok:  # a producer woken for capacity another put took
            self.wake_producers(None if waiter.room is None else waiter.room())

    def leaving(self, waiter: Waiter) -> None:
        """``waiter`` stops waiting; if it was woken and did not try, wake who it stood for."""
        if waiter.baton:
            waiter.baton = False
            if waiter.kind == "consumer":
                self._pass(waiter)
            else:
                self.wake_producers(None if waiter.room is None else waiter.room())

    def _pass(self, waiter: Waiter) -> None:
        for w in self.waiters:
            if w is not waiter and w.group == waiter.group and w.kind == waiter.kind:
                if not w.baton:
                    w.baton = True
                    w.wake()
                return

    def wake_all(self) -> None:
        for w in self.waiters:
            w.wake()

    def cancel(self, token: Hashable) -> None:
        """Cancel the waiting and future requests made with ``token``: an issued one is
        dropped (refused as no longer issued), any other remembered."""
        if type(token) is Token:
            self.issued.discard(token)
        else:
            self.cancelled.add(token)
        for w in self.waiters:
            if w.token == token:
                w.cancelled = True
                w.wake()

    def check_open(self) -> None:
        """Refuse a call on a store that was shut down (it consumed nothing)."""
        if self.shut:
            raise RuntimeError(
                "this SampleStore was shut down (SampleStore.shutdown()); nothing was put or "
                "consumed. Build a new store (SampleStore.load restores a saved one)"
            )

    def check(self, waiter: Waiter) -> None:
        self.check_open()
        if waiter.cancelled:
            raise RequestCancelled(
                f"request with token {waiter.token!r} was cancelled while waiting; nothing "
                "was consumed (a loader's shutdown() cancels its requests)"
            )
