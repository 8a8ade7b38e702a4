"""The embedded backend: one :class:`StoreCore` in this process behind one lock.

Each blocked call waits on its own condition (sharing the store's lock) and is woken only by a
change that may serve it (see :mod:`meshfeed.queue.engine.wakeups`): a put wakes the consumers of
that partition that need one of the fields put, a get that freed capacity wakes producers, an
admin change wakes everyone. There is no polling: a blocked ``get`` costs nothing until a
change that concerns it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from functools import partial
from typing import Any, TypeVar

from meshfeed.queue.backends.base import Got, Peeked, try_get
from meshfeed.queue.checkpoints import state as checkpoint
from meshfeed.queue.engine.core import StoreCore, StoreOptions
from meshfeed.queue.engine.stall import StallWatch, describe_stall
from meshfeed.queue.engine.wakeups import Waiter, Waiters
from meshfeed.queue.request import GetRequest, PutRequest

T = TypeVar("T")
Key = Hashable


def wait_for(
    lock: threading.Lock,
    waiters: Waiters,
    make: Callable[[Callable[[], None]], Waiter],
    attempt: Callable[[], T | None],
    timeout: float | None,
    what: str,
    wake_by: Callable[[], float | None] = lambda: None,
    stall: Callable[[], str | None] = lambda: None,
) -> T:
    """Call ``attempt`` (``lock`` held) until it returns non-None; ``TimeoutError`` after
    ``timeout`` seconds. While waiting, the waiter ``make(notify)`` is registered in
    ``waiters``; a cancelled waiter raises :class:`RequestCancelled`. ``wake_by()``: a
    ``time.monotonic()`` by which to try again unprompted (a lease deadline), or ``None``.
    ``stall()``: why the waiters wait on each other (:mod:`meshfeed.queue.engine.stall`), logged
    once this wait has lasted ``STALL_WARN`` seconds in that state, and added to its
    ``TimeoutError``."""
    cond = threading.Condition(lock)
    waiter = make(cond.notify)
    waiters.add(waiter)
    watch = StallWatch(timeout)
    try:
        while True:
            waiters.check(waiter)
            result = attempt()
            waiters.tried(waiter, result is not None)
            if result is not None:
                return result
            cond.wait(watch.next(what, stall, wake_by))
    finally:
        waiters.remove(waiter)
        waiters.leaving(waiter)


class EmbeddedBackend:
    """In-process, thread-safe; the default backend."""

    name = None  # only a Ray store has a registered name

    def __init__(self, options: StoreOptions, core: StoreCore | None = None) -> None:
        self.core = core if core is not None else StoreCore(options)
        self.lock = threading.Lock()
        self.waiters = Waiters()

    def __getstate__(self) -> Any:
        raise TypeError(
            "an embedded SampleStore lives in one process and cannot be pickled; use "
            "SampleStore(backend='ray') to share a store with other processes"
        )

    def put(self, request: PutRequest) -> list[Key]:
        with self.lock:
            self.waiters.check_open()
            out = self.core.try_put(request)  # fast path: no waiter
            if out is None:
                partition, ids = request.partition, request.ids
                made: list[Waiter] = []

                def make(notify: Callable[[], None]) -> Waiter:
                    made.append(
                        Waiter(
                            "producer",
                            notify,
                            size=self.core.put_needs,
                            ids=None if ids is None else frozenset(ids),
                            room=self._free,
                        )
                    )
                    return made[0]

                def attempt() -> list[Key] | None:
                    got = self.core.try_put(request)
                    if got is None:  # the capacity it needs, for targeted wake-ups
                        made[0].size = self.core.put_needs
                    return got

                out = wait_for(
                    self.lock,
                    self.waiters,
                    make,
                    attempt,
                    request.timeout,
                    f"put to {partition!r} ({self.core.put_waits_for})",
                    stall=self._stall,
                )
            waiters = self.waiters
            if waiters.waiters:
                waiters.wake_consumers(request.partition, request.rows)
                if request.ids is not None:
                    waiters.wake_creators(out)
            return out

    def _stall(self) -> str | None:
        return describe_stall(self.core.held, self.core.options.capacity, self.waiters)

    def _free(self) -> int | None:
        cap = self.core.options.capacity
        return None if cap is None else cap - self.core.held

    def get(self, request: GetRequest) -> Got:
        partition, task, batch_size = request.partition, request.task, request.batch_size
        # Like requests: on one state they all succeed or all fail (wakeups.py).
        group = (
            (partition, task, request.fields, batch_size, request.sampler)
            if request.plain
            else None
        )

        def more() -> bool:
            part = self.core.partitions.get(partition)
            return part is not None and (part.closed or part.pending_count(task) >= batch_size)

        attempt = partial(try_get, self, request)
        make = partial(Waiter.consumer, request=request, group=group, more=more)

        with self.lock:
            self.waiters.check_open()
            if self.waiters.refuses(request.token):  # cancelled: refused, nothing consumed
                raise self.waiters.refusal(request.token)
            core = self.core
            # ``dropped``, not ``held``: while this get waited, puts and other gets moved
            # ``held`` both ways, and comparing it missed this get's own eviction
            planned, expired, dropped = core.planned, core.lease_expired, core.dropped
            taken = core.taken
            try:
                got = attempt()  # no waiter needed
                if got is None:
                    got = wait_for(
                        self.lock,
                        self.waiters,
                        make,
                        attempt,
                        request.timeout,
                        request.describe(),
                        self.core.next_lease_deadline,
                        self._stall,
                    )
                leased = request.lease if request.lease in self.core.leases else None
                return got[0], got[1], leased, got[2], got[3]
            finally:
                core = self.core
                if core.dropped != dropped:  # consumption (or an acknowledged lease) freed room
                    self.waiters.wake_producers(self._free())
                elif core.admitting and core.taken != taken and core.versioned(partition):
                    self.waiters.wake_producers()  # room for versioned puts to be admitted
                if core.planned != planned:  # a plan replica peers may read
                    self.waiters.wake_task(partition, task)
                if core.lease_expired != expired:  # samples returned to ready
                    self.waiters.wake_all()

    def ack(self, lease_id: str) -> None:
        with self.lock:
            dropped = self.core.dropped
            self.core.ack(lease_id)
            if self.core.dropped != dropped:
                self.waiters.wake_producers()

    def drop_consumer(self, consumer: Hashable) -> int:
        return self._admin(lambda: self.core.drop_consumer(consumer))

    def new_token(self) -> Hashable:
        with self.lock:
            return self.waiters.issue()

    def cancel(self, token: Hashable) -> None:
        with self.lock:
            self.waiters.cancel(token)

    def _admin(self, fn: Callable[[], T]) -> T:
        with self.lock:
            try:
                return fn()
            finally:
                self.waiters.wake_all()

    def reset_consumption(self, partition: str, task: str) -> None:
        self._admin(lambda: self.core.reset_consumption(partition, task))

    def replan(
        self, partition: str, task: str, start: int, sampler: Any, parts: int, unit: int
    ) -> None:
        self._admin(lambda: self.core.replan(partition, task, start, sampler, parts, unit))

    def passed(self, partition: str, task: str, sampler: Any, upto: int) -> None:
        self._admin(lambda: self.core.passed(partition, task, sampler, upto))

    def release(self, partition: str, ids: list[Key]) -> None:
        with self.lock:
            dropped = self.core.dropped
            self.core.release(partition, ids)
            if self.core.dropped != dropped:
                self.waiters.wake_producers()

    def peek(self, partition: str, ids: list[Key], fields: tuple[str, ...]) -> Peeked:
        with self.lock:
            return self.core.peek(partition, ids, fields)

    def clear(self, partition: str) -> None:
        self._admin(lambda: self.core.clear(partition))

    def delete(self, partition: str, ids: list[Key]) -> None:
        self._admin(lambda: self.core.delete(partition, ids))

    def close(self, partition: str) -> None:
        self._admin(lambda: self.core.close(partition))

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return self.core.stats(self.waiters)

    def dump(self, with_payload: bool) -> tuple[dict[str, Any], list[list[dict]]]:
        with self.lock:
            return checkpoint.dump(self.core, with_payload=with_payload)

    def restore(self, meta: Mapping[str, Any], payload: list[list[dict]] | None) -> None:
        def swap() -> None:
            old = self.core
            # Threads blocked in put/get keep waiting on the restored state (woken by _admin).
            self.core = checkpoint.restore(meta, payload, current=old, options=old.options)

        self._admin(swap)

    def shutdown(self) -> None:
        """Every later call is refused, and the calls waiting now raise (woken here)."""
        with self.lock:
            self.waiters.shut = True
            self.waiters.wake_all()
