"""The Ray backend: the store is an async Ray actor; clients in any process use the same API.

The actor wraps one :class:`StoreCore` under an ``asyncio.Condition``: a blocked ``get`` is a
suspended coroutine, so puts and other gets keep flowing, and it wakes on the next state change
(no polling).

The data plane (large columns through Ray's object store, pinned and adopted chunks) is
:mod:`meshfeed.queue.backends.ray_dataplane`; this module is the control plane.

A caller that dies while its ``get`` or ``put`` waits in the actor is noticed (see
:func:`~meshfeed.queue.backends.ray_dataplane.caller_probe`): the wait is given up, nothing consumed or
stored (a put waits for room in its client, then puts again: one whose producer died never
lands, so a restarted producer's put of the same sample is the only one; #28); leases of dead callers return to ready (see :mod:`meshfeed.queue.engine.leases`). Errors raised in the actor (``ValueError``,
``TimeoutError``, ``PartitionClosed``) are re-raised in the caller as themselves.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from functools import partial
from typing import Any

from meshfeed.queue.backends.base import Got, Peeked, try_get
from meshfeed.queue.backends.ray_dataplane import (
    PROBE_INTERVAL,
    PROBE_TIMEOUT,
    ChunkKeeper,
    caller_alive,
    caller_probe,
    resolve,
    resolve_rows,
    tensor_in,
    tensor_out,
    wrap,
    wrap_column,
)
from meshfeed.queue.checkpoints import state as checkpoint
from meshfeed.queue.engine.columns import RemoteChunk
from meshfeed.queue.engine.core import StoreCore, StoreOptions
from meshfeed.queue.engine.stall import StallWatch, describe_stall
from meshfeed.queue.engine.wakeups import MAX_WAIT_CHUNK, RequestCancelled, Waiter, Waiters
from meshfeed.queue.request import GetRequest, PutRequest

__all__ = ["NAMESPACE", "PROBE_INTERVAL", "PROBE_TIMEOUT", "RayBackend"]

Key = Hashable
NAMESPACE = "meshfeed.queue"  # named store actors live here


_TOLD: set[tuple[str, str]] = set()  # (store actor, worker id): the actor has our probe
_TELL = threading.Lock()


class _StoreActor:
    """Runs inside the Ray actor process; every public method returns ``(ok, value)``.

    Every method runs on the actor's one event loop, so the core needs no lock; a blocked
    call awaits its own ``asyncio.Event``, set only by a change that may serve it (see
    :mod:`meshfeed.queue.engine.wakeups`)."""

    def __init__(self, options: dict[str, Any]) -> None:
        import ray
        import torch

        # This process is the store's own: every tensor it sends travels as an array.
        ray.util.register_serializer(torch.Tensor, serializer=tensor_out, deserializer=tensor_in)
        self.core = StoreCore(StoreOptions.from_dict(options))  # a checkpoint comes by restore
        self.core.owning = False  # rows reach their reader pickled: copies already
        self.waiters = Waiters()
        self.abandoned = 0  # waiting gets whose caller died: given up, nothing consumed
        self.plane = ChunkKeeper(caller_alive)
        self.probes: dict[str, Any] = {}  # a caller's probe by its worker id (see register)
        self._watch: asyncio.Task[None] | None = None

    async def _watch_leases(self) -> None:
        """While leases are outstanding: every :data:`PROBE_INTERVAL` seconds return those of
        dead callers to ready and wake consumers for the returned (or expired) samples."""
        try:
            while len(self.core.leases):
                await asyncio.sleep(PROBE_INTERVAL)
                dead = [
                    lease.id
                    for lease in self.core.leases
                    if lease.alive is not None and not await caller_alive(lease.alive)
                ]
                n = self.core.drop_leases(dead) + self.core.expire_leases(time.monotonic())
                if n:
                    self.waiters.wake_all()
        finally:
            self._watch = None

    def _stall(self) -> str | None:
        return describe_stall(self.core.held, self.core.options.capacity, self.waiters)

    async def register(self, worker: str, probe: list[Any]) -> Any:
        """Remember the liveness probe of the process ``worker`` (its worker id), sent once
        so that puts and gets name their caller by id (a reference argument costs every
        call a round of Ray's borrower bookkeeping)."""
        self.probes[worker] = probe[0]
        return True, None

    async def refresh(self, refs: list[Any]) -> Any:
        """The current references of the chunks handed out as ``refs`` (see
        :meth:`ChunkKeeper.refresh`)."""
        try:
            return True, await self.plane.refresh(refs)
        except Exception as exc:  # re-raised by the client
            return False, exc

    async def _run(
        self,
        attempt: Callable[[], Any],
        timeout: float | None,
        what: str,
        make: Callable[[Callable[[], None]], Waiter] | None = None,
        probe: Any = None,
    ) -> Any:
        try:
            result = attempt()
            if result is None and make is not None:
                result = await self._wait(attempt, timeout, what, make, probe)
            return True, result
        except Exception as exc:  # re-raised by the client
            return False, exc

    async def _wait(
        self,
        attempt: Callable[[], Any],
        timeout: float | None,
        what: str,
        make: Callable[[Callable[[], None]], Waiter],
        probe: Any = None,
    ) -> Any:
        event = asyncio.Event()
        waiter = make(event.set)
        self.waiters.add(waiter)
        watch = StallWatch(timeout)  # see meshfeed.queue.engine.stall
        longest = MAX_WAIT_CHUNK if probe is None else min(MAX_WAIT_CHUNK, PROBE_INTERVAL)
        try:
            while True:
                self.waiters.check(waiter)
                result = attempt()
                if result is not None:
                    return result
                chunk = watch.next(what, self._stall, self.core.next_lease_deadline, longest)
                event.clear()
                try:
                    await asyncio.wait_for(event.wait(), chunk)
                except asyncio.TimeoutError:  # not woken: is the caller still there?
                    if probe is not None and not await caller_alive(probe):
                        self.abandoned += 1
                        raise RequestCancelled(
                            f"{what}: the caller's process is gone; the wait was given up "
                            "and nothing was stored or consumed"
                        ) from None
        finally:
            self.waiters.remove(waiter)

    async def put(self, request: PutRequest, caller: str | None = None) -> Any:
        """Store the rows now, or answer ``("full", needed)`` without waiting: the client
        waits for room with :meth:`wait_room` and puts again, so a put whose producer died
        while it waited is never stored (#28)."""
        partition, rows = request.partition, request.rows
        chunks = [column for column in rows.values() if type(column) is RemoteChunk]
        if chunks:
            probe = self.probes.get(caller) if caller else None  # an object the producer owns
            try:  # pin them, so they outlive the producer (see ray_dataplane)
                await self.plane.keep(chunks, probe)
            except Exception as exc:  # re-raised by the client
                return False, exc
        ok, out = await self._run(lambda: self.core.try_put(request), 0, "")
        if ok and out is None:
            return True, ("full", self.core.put_needs, self._room_stamp())
        self.waiters.wake_consumers(partition, rows)
        return ok, out

    def _room_stamp(self) -> tuple[int, int, int]:
        """Changes whenever room may have been freed: samples dropped or consumed, a new core."""
        return self.core.dropped, self.core.taken, id(self.core)

    async def wait_room(
        self,
        partition: str,
        need: int,
        stamp: tuple[int, int, int],
        timeout: float | None,
        caller: str | None = None,
    ) -> Any:
        """Wait (no more than ``timeout`` seconds) until room may have been freed for a put
        of ``need`` new samples refused at ``stamp``, or the partition closed; given up if
        the caller's process dies."""

        def attempt() -> bool | None:
            part = self.core.partitions.get(partition)
            changed = self._room_stamp() != tuple(stamp) or (part is not None and part.closed)
            return True if changed else None

        why = self.core.put_waits_for or f"store at capacity {self.core.options.capacity}"
        return await self._run(
            attempt,
            timeout,
            f"put to {partition!r} ({why}, when it was refused)",
            lambda notify: Waiter("producer", notify, size=need),
            self.probes.get(caller) if caller else None,
        )

    async def get(self, request: GetRequest, caller: str | None = None) -> Any:
        partition, task = request.partition, request.task
        probe = self.probes.get(caller) if caller else None  # see register, _caller_alive
        core = self.core
        # ``dropped``, not ``held``: while this get waited, puts and other gets moved ``held``
        # both ways, and comparing it missed this get's own eviction
        cached, expired, dropped = core.stats_cache_entries(), core.lease_expired, core.dropped
        taken = core.taken
        if self.waiters.refuses(request.token):  # cancelled: refused, nothing consumed
            return False, self.waiters.refusal(request.token)

        try:
            ok, out = await self._run(
                partial(try_get, self, request, probe),
                request.timeout,
                request.describe(),
                lambda notify: Waiter.consumer(notify, request),
                probe,
            )
            if not ok:
                return ok, out
            leased = request.lease if request.lease in self.core.leases else None
            if leased is not None and self._watch is None:
                self._watch = asyncio.get_running_loop().create_task(self._watch_leases())
            ids, rows, parts, versions = out
            return True, (ids, rows, leased, parts, versions)
        finally:
            core = self.core
            taken_any = core.admitting and core.taken != taken and core.versioned(partition)
            if core.dropped != dropped or taken_any:
                self.waiters.wake_producers()
            if core.stats_cache_entries() != cached:
                self.waiters.wake_task(partition, task)
            if core.lease_expired != expired:
                self.waiters.wake_all()

    async def new_token(self) -> Any:
        return True, self.waiters.issue()

    async def cancel(self, token: Any) -> Any:
        self.waiters.cancel(token)
        return True, None

    async def call(self, name: str, *args: Any) -> Any:
        """A call of the core that never waits (ack, release, peek, drop_consumer, replan,
        passed, reset_consumption, clear, delete, close, stats): it wakes the waiters it may
        serve."""

        if name == "stats":
            ok, out = await self._run(lambda: self.core.stats(self.waiters), 0, name)
            if ok:
                out["abandoned_waits"] = self.abandoned
                out["adopted_chunks"] = self.plane.adopted
            return ok, out
        dropped = self.core.dropped
        try:
            return await self._run(lambda: getattr(self.core, name)(*args), 0, name)
        finally:
            if name in ("ack", "release"):
                if self.core.dropped != dropped:
                    self.waiters.wake_producers()
            elif name != "peek":
                self.waiters.wake_all()

    async def dump(self, with_payload: bool) -> Any:
        return await self._run(
            lambda: checkpoint.dump(self.core, with_payload=with_payload), 0, "dump"
        )

    async def restore(self, meta: Any, payload: Any) -> Any:
        def swap() -> bool:
            old = self.core
            self.core = checkpoint.restore(meta, payload, current=old, options=old.options)
            self.core.owning = False
            return True

        try:
            return await self._run(swap, 0, "admin")
        finally:
            self.waiters.wake_all()  # an admin change: every waiter tries again

    async def options(self) -> Any:
        return True, self.core.options.to_dict()

    async def inspect(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(actor, *args)`` run here: the one door for diagnostics (see
        :mod:`meshfeed.testing`), so the actor carries none of its own."""
        return await self._run(lambda: fn(self, *args), 0, "inspect")


class RayBackend:
    """Client side of the Ray actor; picklable, so it can be sent to tasks and actors."""

    def __init__(self, actor: Any, inline_bytes: int, name: str | None = None) -> None:
        self.actor = actor
        self.inline_bytes = inline_bytes
        self.name = name  # set for named actors, so worker processes can connect

    @classmethod
    def create(
        cls,
        options: StoreOptions,
        *,
        inline_bytes: int,
        name: str | None = None,
        meta: Any = None,
        payload: Any = None,
    ) -> RayBackend:
        import ray

        if not ray.is_initialized():
            raise ValueError(
                "SampleStore(backend='ray') needs a running Ray; call ray.init() first"
            )
        remote = ray.remote(num_cpus=0)(_StoreActor)
        if name is not None:
            remote = remote.options(name=name, namespace=NAMESPACE)
        actor = remote.remote(options.to_dict())
        backend = cls(actor, inline_bytes, name)
        if meta is not None:
            backend.restore(meta, payload)
        return backend

    @classmethod
    def connect(cls, name: str, *, inline_bytes: int) -> tuple[RayBackend, StoreOptions]:
        """Attach to the named store actor (from any process connected to the Ray cluster)."""
        import ray

        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise ValueError(
                f"no SampleStore named {name!r} in this Ray cluster; create it with "
                f"SampleStore('ray', name={name!r}) and connect with ray.init(address=...)"
            ) from None
        backend = cls(actor, inline_bytes, name)
        return backend, StoreOptions.from_dict(backend._call(actor.options.remote()))

    def __reduce__(self) -> Any:
        return (RayBackend, (self.actor, self.inline_bytes, self.name))

    def _call(self, ref: Any) -> Any:
        import ray

        ok, value = ray.get(ref)
        if not ok:
            raise value
        return value

    def _resolve(self, rows: dict[str, Any]) -> dict[str, Any]:
        return resolve(rows, lambda refs: self._call(self.actor.refresh.remote(refs)))

    def put(self, request: PutRequest) -> list[Key]:
        rows = {f: wrap_column(col, self.inline_bytes) for f, col in request.rows.items()}
        request = request._replace(rows=rows)
        caller = self._caller()
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        while True:  # waits here, not in the actor: a dead producer's put never lands (#28)
            out = self._call(self.actor.put.remote(request, caller))
            if not (type(out) is tuple and out[0] == "full"):
                return out
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = self.actor.wait_room.remote(request.partition, out[1], out[2], left, caller)
            self._call(wait)

    def _caller(self) -> str:
        """This process's worker id; the first time per store actor, also tells the actor
        this process's liveness probe (:func:`~meshfeed.queue.backends.ray_dataplane.caller_probe`)."""
        import ray

        worker = ray.get_runtime_context().get_worker_id()
        key = (self.actor._actor_id.hex(), worker)
        if key not in _TOLD:
            with _TELL:
                if key not in _TOLD:  # in a list: Ray passes the reference, unresolved
                    self._call(self.actor.register.remote(worker, [caller_probe()]))
                    _TOLD.add(key)
        return worker

    def get(self, request: GetRequest) -> Got:
        ids, rows, leased, parts, vs = self._call(self.actor.get.remote(request, self._caller()))
        return ids, self._resolve(rows), leased, parts, vs

    def ack(self, lease_id: str) -> None:
        self._call(self.actor.call.remote("ack", lease_id))

    def drop_consumer(self, consumer: Any) -> int:
        return int(self._call(self.actor.call.remote("drop_consumer", consumer)))

    def new_token(self) -> Any:
        return self._call(self.actor.new_token.remote())

    def cancel(self, token: Any) -> None:
        self._call(self.actor.cancel.remote(token))

    def release(self, partition: str, ids: list[Key]) -> None:
        self._call(self.actor.call.remote("release", partition, ids))

    def peek(self, partition: str, ids: list[Key], fields: tuple[str, ...]) -> Peeked:
        out, rows, versions = self._call(self.actor.call.remote("peek", partition, ids, fields))
        return out, self._resolve(rows), versions

    def reset_consumption(self, partition: str, task: str) -> None:
        self._call(self.actor.call.remote("reset_consumption", partition, task))

    def replan(
        self, partition: str, task: str, start: int, sampler: Any, parts: int, unit: int
    ) -> None:
        self._call(self.actor.call.remote("replan", partition, task, start, sampler, parts, unit))

    def passed(self, partition: str, task: str, sampler: Any, upto: int) -> None:
        self._call(self.actor.call.remote("passed", partition, task, sampler, upto))

    def clear(self, partition: str) -> None:
        self._call(self.actor.call.remote("clear", partition))

    def delete(self, partition: str, ids: list[Key]) -> None:
        self._call(self.actor.call.remote("delete", partition, ids))

    def close(self, partition: str) -> None:
        self._call(self.actor.call.remote("close", partition))

    def stats(self) -> dict[str, Any]:
        return self._call(self.actor.call.remote("stats"))

    def dump(self, with_payload: bool) -> tuple[dict[str, Any], list[list[dict]]]:
        meta, payload = self._call(self.actor.dump.remote(with_payload))
        return meta, [resolve_rows(rows) for rows in payload]

    def restore(self, meta: Mapping[str, Any], payload: list[list[dict]] | None) -> None:
        if payload is not None:
            payload = [
                [{f: wrap(v, self.inline_bytes) for f, v in row.items()} for row in rows]
                for rows in payload
            ]
        self._call(self.actor.restore.remote(dict(meta), payload))

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)  # callers blocked in the actor get RayActorError at once
