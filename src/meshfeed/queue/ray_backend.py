"""The Ray backend: the store is an async Ray actor; clients in any process use the same API.

The actor wraps one :class:`StoreCore` under an ``asyncio.Condition``: a blocked ``get`` is a
suspended coroutine, so puts and other gets keep flowing, and it wakes on the next state change
(no polling).

Data plane apart from the control plane: a put's tensor / array column of at least
``inline_bytes`` is ``ray.put`` once, by the producing client, and the actor receives only a
:class:`~meshfeed.queue.columns.RemoteChunk` (its reference, length and row layout; Ray
resolves only top-level arguments, so the reference stays one). A ``get`` returns which rows
of which chunks; the consuming client fetches those chunks straight from the object store
(one ``ray.get`` for the batch) and gathers the rows itself.

Ownership: Ray frees an object when the process that put it (its owner) exits, and Ray >= 2.56
removed ``ray.put(_owner=...)``. While the producer lives, the chunk stays the producer's
object: the actor borrows its reference (so Ray keeps it) and, before the put returns,
*pins* it: a thread of the actor process maps it from the object store (zero-copy for arrays,
no byte copied). The actor watches each producer's liveness (:func:`_caller_probe`, every
:data:`PROBE_INTERVAL` seconds while it has pinned chunks) and *adopts* the chunks of a
producer seen dead: it puts the pinned bytes again, now owned by the actor, and hands out the
new reference from then on. A consumer whose fetch fails because the producer died before the
actor noticed asks the actor (:meth:`_StoreActor.refresh`), which adopts at once. So a
producer task or process may exit right after its put, and a chunk's bytes are written once
while its producer lives (adopting at every put wrote them twice: about half the put's time
for 1 MiB rows). The actor drops a chunk's reference when no held sample has a row of it
(every declared task consumed it, or it was deleted / cleared), and Ray frees it. Smaller
columns travel with the call, CPU tensors as the arrays sharing their memory both ways (see
:func:`_tensor_out`): torch's own tensor pickling cost more than the rest of a small call.

A caller that dies while its ``get`` waits in the actor is noticed (see
:func:`_caller_probe`): the wait is given up, nothing consumed; leases of dead callers return
to ready (see :mod:`meshfeed.queue.leases`). Errors raised in the actor (``ValueError``,
``TimeoutError``, ``PartitionClosed``) are re-raised in the caller as themselves.
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

from meshfeed.queue import checkpoint
from meshfeed.queue.backend import Got
from meshfeed.queue.columns import (
    Cell,
    Chunk,
    RemoteChunk,
    Runs,
    assemble,
    signature,
    transportable,
)
from meshfeed.queue.core import Ref, StoreCore, StoreOptions, nbytes_of
from meshfeed.queue.request import GetRequest
from meshfeed.queue.wakeups import MAX_WAIT_CHUNK, RequestCancelled, Waiter, Waiters

Key = Hashable
NAMESPACE = "meshfeed.queue"  # named store actors live here


#: Seconds between checks that a waiting caller, or a lease holder, is still alive.
PROBE_INTERVAL = 1.0
#: Longest wait for one liveness answer (no answer: assumed alive, asked again later).
PROBE_TIMEOUT = 5.0

_PROBE: dict[str, Any] = {}  # this process's liveness probe per Ray session (worker id)
_TOLD: set[tuple[str, str]] = set()  # (store actor, worker id): the actor has our probe
_TELL = threading.Lock()


def _caller_probe() -> Any:
    """An object this process owns, so the store actor can tell when the process is gone.

    Ray keeps an object only as long as its owner (the process that ``ray.put`` it) lives,
    and reading an object whose owner died raises ``OwnerDiedError``: this works on a local
    Ray without the dashboard (which ``ray.util.state`` needs) and without naming the caller
    (a task, an actor, a driver alike)."""
    import ray

    worker = ray.get_runtime_context().get_worker_id()
    probe = _PROBE.get(worker)
    if probe is None:
        _PROBE.clear()  # a reference of an earlier session is useless
        probe = _PROBE[worker] = ray.put(None)
    return probe


def _as_array(value: Any) -> np.ndarray | None:
    """A plain CPU tensor as the array sharing its memory, else ``None`` (keep the tensor)."""
    torch = sys.modules.get("torch")
    if (
        torch is None
        or type(value) is not torch.Tensor
        or value.requires_grad
        or value.layout != torch.strided
        or value.device.type != "cpu"
    ):
        return None
    array = transportable(value)
    return array if isinstance(array, np.ndarray) else None


def _tensor_out(value: Any) -> tuple[bool, Any]:
    """Ray serializer for tensors leaving the store actor: an array when it can be one (numpy
    pickles in about a fifteenth of the time of torch's tensor pickling, measured on 64x8
    int64), else the tensor's own pickle."""
    array = _as_array(value)
    return (True, array) if array is not None else (False, pickle.dumps(value))


def _tensor_in(payload: tuple[bool, Any]) -> Any:
    """The tensor :func:`_tensor_out` sent (writable: a read-only received buffer is copied)."""
    import torch

    is_array, data = payload
    if not is_array:
        return pickle.loads(data)
    return torch.from_numpy(data if data.flags.writeable else data.copy())


def _tensor_chunk(array: np.ndarray) -> Chunk:
    """The store actor's side of :class:`_ArrayChunk`: the chunk as a tensor again."""
    import torch

    return Chunk(torch.from_numpy(array if array.flags.writeable else array.copy()))


class _ArrayChunk:
    """An inline tensor chunk on its way to the store actor, pickled as its array (see
    :func:`_tensor_out`); it arrives as a :class:`Chunk` of the tensor."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> Any:
        return (_tensor_chunk, (self.array,))


def _pin(refs: list[Any]) -> list[Any]:
    """The values of ``refs``, mapped from the object store (zero-copy for arrays; run in a
    thread of the store actor): they keep the bytes readable even after their owner exits."""
    import ray

    return list(ray.get(refs))


def _own(values: list[Any]) -> list[Any]:
    """References to copies of ``values`` owned by this process (a thread of the actor)."""
    import ray

    return [ray.put(v) for v in values]


class _StoreActor:
    """Runs inside the Ray actor process; every public method returns ``(ok, value)``.

    Every method runs on the actor's one event loop, so the core needs no lock; a blocked
    call awaits its own ``asyncio.Event``, set only by a change that may serve it (see
    :mod:`meshfeed.queue.wakeups`)."""

    def __init__(self, options: dict[str, Any], meta: Any = None, payload: Any = None) -> None:
        import ray
        import torch

        # This process is the store's own: every tensor it sends travels as an array.
        ray.util.register_serializer(torch.Tensor, serializer=_tensor_out, deserializer=_tensor_in)
        opts = StoreOptions.from_dict(options)
        self.core = (
            StoreCore(opts) if meta is None else checkpoint.restore(meta, payload, options=opts)
        )
        self.waiters = Waiters()
        self.abandoned = 0  # waiting gets whose caller died: given up, nothing consumed
        self.chunks: weakref.WeakSet[RemoteChunk] = weakref.WeakSet()  # alive in this actor
        # Chunks whose producer still owns them: the pinned value and the producer's probe.
        self.pinned: weakref.WeakKeyDictionary[RemoteChunk, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self.by_ref: weakref.WeakValueDictionary[bytes, RemoteChunk] = (
            weakref.WeakValueDictionary()
        )  # a chunk by the reference it arrived with (see refresh)
        self.adopted = 0  # chunks adopted because their producer died
        self.probes: dict[str, Any] = {}  # a caller's probe by its worker id (see register)
        self._watch: asyncio.Task[None] | None = None
        self._watch_owners: asyncio.Task[None] | None = None

    async def _caller_alive(self, probe: Any) -> bool:
        """Whether the process that owns ``probe`` (an object it ``ray.put``) still runs: Ray
        fails reading an object whose owner died (``OwnerDiedError``), even one read before.
        An answer that does not come within :data:`PROBE_TIMEOUT` counts as alive."""
        import ray

        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(probe.future())), PROBE_TIMEOUT
            )
        except (ray.exceptions.ObjectLostError, ray.exceptions.RayError):
            return False
        except asyncio.TimeoutError:
            return True
        return True

    async def _watch_leases(self) -> None:
        """While leases are outstanding: every :data:`PROBE_INTERVAL` seconds return those of
        dead callers to ready and wake consumers for the returned (or expired) samples."""
        try:
            while len(self.core.leases):
                await asyncio.sleep(PROBE_INTERVAL)
                dead = [
                    lease.id
                    for lease in self.core.leases
                    if lease.alive is not None and not await self._caller_alive(lease.alive)
                ]
                n = self.core.drop_leases(dead) + self.core.expire_leases(time.monotonic())
                if n:
                    self.waiters.wake_all()
        finally:
            self._watch = None

    async def register(self, worker: str, probe: list[Any]) -> Any:
        """Remember the liveness probe of the process ``worker`` (its worker id), sent once
        so that puts and gets name their caller by id (a reference argument costs every
        call a round of Ray's borrower bookkeeping)."""
        self.probes[worker] = probe[0]
        return True, None

    async def _adopt(self, chunks: list[RemoteChunk]) -> None:
        """Own ``chunks`` (pinned ones whose producer died): put their bytes again."""
        chunks = [c for c in dict.fromkeys(chunks) if c in self.pinned]
        if not chunks:
            return
        values = [self.pinned[c][0] for c in chunks]
        refs = await asyncio.get_running_loop().run_in_executor(None, _own, values)
        for chunk, ref in zip(chunks, refs, strict=True):
            if chunk in self.pinned:  # not adopted by a concurrent call meanwhile
                chunk.ref = ref
                del self.pinned[chunk]
                self.adopted += 1

    async def _dead_owners(self, chunks: list[RemoteChunk] | None = None) -> list[RemoteChunk]:
        """Those of the pinned ``chunks`` (``None``: all) whose producer is gone, one probe per
        producer. No chunk is referenced across the probes' waits, so a chunk consumed
        meanwhile is freed at once."""
        pinned = self.pinned
        probes = {
            probe.binary(): probe
            for c, (_, probe) in list(pinned.items())
            if probe is not None and (chunks is None or c in chunks)
        }  # no probe: a put that adopts its chunks itself
        del chunks
        dead = {key for key, probe in probes.items() if not await self._caller_alive(probe)}
        return [
            c
            for c, (_, probe) in list(pinned.items())
            if probe is not None and probe.binary() in dead
        ]

    async def _watch_producers(self) -> None:
        """While chunks are pinned: every :data:`PROBE_INTERVAL` seconds adopt those whose
        producer died (their bytes stay readable through the pin until then)."""
        try:
            while len(self.pinned):
                await asyncio.sleep(PROBE_INTERVAL)
                await self._adopt(await self._dead_owners())
        finally:
            self._watch_owners = None

    async def refresh(self, refs: list[Any]) -> Any:
        """The current references of the chunks handed out as ``refs``: a consumer could not
        fetch them (their producer died), so the chunks of dead producers are adopted now.
        A reference this actor does not know is returned as it is."""
        try:
            chunks = [self.by_ref.get(r.binary()) for r in refs]
            known = [c for c in chunks if c is not None and c in self.pinned]
            await self._adopt(await self._dead_owners(known))
            return True, [r if c is None else c.ref for c, r in zip(chunks, refs, strict=True)]
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
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                self.waiters.check(waiter)
                result = attempt()
                if result is not None:
                    return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"{what} timed out after {timeout}s; the store is unchanged and usable "
                        "(retry, raise the timeout, or check that producers are running)"
                    )
                chunk = MAX_WAIT_CHUNK if remaining is None else min(remaining, MAX_WAIT_CHUNK)
                if probe is not None:
                    chunk = min(chunk, PROBE_INTERVAL)
                due = self.core.next_lease_deadline()
                if due is not None:
                    chunk = max(0.0, min(chunk, due - time.monotonic()))
                event.clear()
                try:
                    await asyncio.wait_for(event.wait(), chunk)
                except asyncio.TimeoutError:
                    if probe is not None and not await self._caller_alive(probe):
                        self.abandoned += 1
                        raise RequestCancelled(
                            f"{what}: the caller's process is gone; the wait was given up "
                            "and nothing was consumed"
                        ) from None
        finally:
            self.waiters.remove(waiter)

    async def put(
        self,
        partition: str,
        rows: Any,
        ids: Any,
        groups: Any,
        timeout: float | None,
        caller: str | None = None,
    ) -> Any:
        what = f"put to {partition!r} (store at capacity {self.core.options.capacity})"
        chunks = [column for column in rows.values() if type(column) is RemoteChunk]
        if chunks:
            probe = self.probes.get(caller) if caller else None  # an object the producer owns
            try:  # pin them, so they outlive the producer (see the module docstring)
                views = await asyncio.get_running_loop().run_in_executor(
                    None, _pin, [c.ref for c in chunks]
                )
            except Exception as exc:  # re-raised by the client
                return False, exc
            for chunk, view in zip(chunks, views, strict=True):
                self.chunks.add(chunk)
                self.by_ref[chunk.ref.binary()] = chunk
                self.pinned[chunk] = (view, probe)
            if probe is None:  # a producer that cannot be watched: own the chunks now
                await self._adopt(chunks)
            elif self._watch_owners is None:
                self._watch_owners = asyncio.get_running_loop().create_task(self._watch_producers())
        out = await self._run(
            lambda: self.core.try_put(partition, rows, ids, groups),
            timeout,
            what,
            lambda notify: Waiter("producer", notify),
        )
        self.waiters.wake_consumers(partition, rows)
        return out

    async def get(self, request: GetRequest, caller: str | None = None) -> Any:
        partition, task = request.partition, request.task
        probe = self.probes.get(caller) if caller else None  # see register, _caller_alive
        core = self.core
        # ``dropped``, not ``held``: while this get waited, puts and other gets moved ``held``
        # both ways, and comparing it missed this get's own eviction
        cached, expired, dropped = core.stats_cache_entries(), core.lease_expired, core.dropped

        def attempt() -> Any:
            return self.core.try_get(request, alive=probe)

        try:
            ok, out = await self._run(
                attempt,
                request.timeout,
                request.describe(),
                lambda notify: Waiter(
                    "consumer",
                    notify,
                    partition=partition,
                    task=task,
                    need=request.need,
                    token=request.token,
                ),
                probe,
            )
            if not ok:
                return ok, out
            leased = request.lease if request.lease in self.core.leases else None
            if leased is not None and self._watch is None:
                self._watch = asyncio.get_running_loop().create_task(self._watch_leases())
            return True, (*out, leased)
        finally:
            core = self.core
            if core.dropped != dropped:
                self.waiters.wake_producers()
            if core.stats_cache_entries() != cached:
                self.waiters.wake_task(partition, task)
            if core.lease_expired != expired:
                self.waiters.wake_all()

    async def ack(self, lease_id: str) -> Any:
        dropped = self.core.dropped
        try:
            return await self._run(lambda: self.core.ack(lease_id), 0, "ack")
        finally:
            if self.core.dropped != dropped:
                self.waiters.wake_producers()

    async def drop_consumer(self, consumer: Any) -> Any:
        return await self._admin(lambda: self.core.drop_consumer(consumer))

    async def cancel(self, token: Any) -> Any:
        self.waiters.cancel(token)
        return True, None

    async def call(self, name: str, *args: Any) -> Any:
        """An admin call that never waits: reset_consumption, clear, delete, close, stats."""

        if name == "stats":
            self.core.waiting_consumers = self.waiters.count("consumer")
            self.core.waiting_producers = self.waiters.count("producer")
            ok, out = await self._run(self.core.stats, 0, name)
            if ok:
                out["abandoned_waits"] = self.abandoned
                out["adopted_chunks"] = self.adopted
            return ok, out
        dropped = self.core.dropped
        try:
            return await self._run(lambda: getattr(self.core, name)(*args), 0, name)
        finally:
            if name == "release":
                if self.core.dropped != dropped:
                    self.waiters.wake_producers()
            elif name not in ("stats", "peek"):
                self.waiters.wake_all()

    async def _admin(self, fn: Callable[[], Any]) -> Any:
        try:
            return await self._run(fn, 0, "admin")
        finally:
            self.waiters.wake_all()

    async def dump(self, with_payload: bool) -> Any:
        return await self._run(
            lambda: checkpoint.dump(self.core, with_payload=with_payload), 0, "dump"
        )

    async def restore(self, meta: Any, payload: Any) -> Any:
        def swap() -> bool:
            old = self.core
            self.core = checkpoint.restore(meta, payload, current=old, options=old.options)
            return True

        return await self._admin(swap)

    async def options(self) -> Any:
        return True, self.core.options.to_dict()

    async def reinit(self, options: dict[str, Any]) -> Any:
        """Start over with an empty store (lets tests reuse one actor process)."""

        def swap() -> bool:
            self.core = StoreCore(StoreOptions.from_dict(options))
            return True

        return await self._admin(swap)

    async def live_chunks(self) -> int:
        """How many object-store chunks this actor still references (tests check a chunk's
        reference goes once no task can read it; Ray then frees the object)."""
        gc.collect()
        return len(self.chunks)

    async def chunk_kinds(self) -> list[str]:
        """Type names of the chunks behind every stored cell."""
        return sorted(
            {
                type(v.chunk).__name__
                for p in self.core.partitions.values()
                for k in p.samples
                for v in p.cells(k).values()
                if type(v) is Cell
            }
        )

    async def held_types(self) -> list[str]:
        """Type names of every stored value (tests check large payloads stay references)."""
        return sorted(
            {
                type(v).__name__
                for p in self.core.partitions.values()
                for k in p.samples
                for v in p.cells(k).values()
            }
        )


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

    def _wrap(self, value: Any) -> Any:
        import ray

        torch = sys.modules.get("torch")  # a tensor implies torch is imported already
        if torch is not None and isinstance(value, torch.Tensor):
            value = value.clone()  # pickling a view would ship its whole base storage
        size = nbytes_of(value)
        if size >= self.inline_bytes and hasattr(value, "shape"):
            return Ref(ray.put(value), size)
        return value

    def _wrap_column(self, column: Any) -> Any:
        """A chunk of at least ``inline_bytes`` goes to Ray's object store once (the store
        actor pins it, and adopts it if this process dies: it outlives this process), and the
        actor gets its reference only; a smaller chunk travels with the call (one pickled column,
        cheaper than an object-store round trip). Values of a list column of at least
        ``inline_bytes`` each go to the object store one by one."""
        import ray

        if isinstance(column, Chunk):
            data = column.__reduce__()[1][0]  # contiguous, no view of a larger storage
            if column.row_nbytes * len(column) < self.inline_bytes:
                array = _as_array(data)
                return column if array is None else _ArrayChunk(array)
            ref = ray.put(transportable(data))  # the actor pins it before the put returns
            return RemoteChunk(ref, len(column), column.row_nbytes, signature(data))
        return [self._wrap(v) for v in column]

    def _resolve(self, rows: dict[str, Any]) -> dict[str, Any]:
        """Fetch what the actor handed out by reference, straight from the object store: the
        chunks of :class:`Runs` columns (each once) and single :class:`Ref` values."""
        import ray

        refs = [
            v.ref for col in rows.values() if type(col) is list for v in col if isinstance(v, Ref)
        ]
        chunk_refs = list(
            {
                id(ref): ref
                for col in rows.values()
                if type(col) is Runs
                for ref, rows_ in col.runs
                if rows_ is not None
            }.values()
        )
        if not refs and not chunk_refs:
            return rows
        try:
            values = ray.get(refs + chunk_refs)
        except ray.exceptions.ObjectLostError:  # a producer died before the actor adopted
            current = self._call(self.actor.refresh.remote(chunk_refs))
            values = ray.get(refs + current)
        fetched = iter(values[: len(refs)])
        chunks = {id(r): v for r, v in zip(chunk_refs, values[len(refs) :], strict=True)}
        out: dict[str, Any] = {}
        for f, col in rows.items():
            if type(col) is list:
                out[f] = [next(fetched) if isinstance(v, Ref) else v for v in col]
            elif type(col) is Runs:
                keyed = Runs([(id(r) if n is not None else r, n) for r, n in col.runs], col.is_np)
                out[f] = assemble(keyed, chunks)
            else:
                out[f] = col
        return out

    def put(
        self,
        partition: str,
        rows: Mapping[str, list[Any]],
        ids: Any,
        groups: Any,
        timeout: float | None,
    ) -> list[Key]:
        wrapped = {f: self._wrap_column(col) for f, col in rows.items()}
        caller = None
        if any(type(col) is RemoteChunk for col in wrapped.values()):
            caller = self._caller()
        return self._call(self.actor.put.remote(partition, wrapped, ids, groups, timeout, caller))

    def _caller(self) -> str:
        """This process's worker id; the first time per store actor, also tells the actor
        this process's liveness probe (:func:`_caller_probe`)."""
        import ray

        worker = ray.get_runtime_context().get_worker_id()
        key = (self.actor._actor_id.hex(), worker)
        if key not in _TOLD:
            with _TELL:
                if key not in _TOLD:  # in a list: Ray passes the reference, unresolved
                    self._call(self.actor.register.remote(worker, [_caller_probe()]))
                    _TOLD.add(key)
        return worker

    def get(self, request: GetRequest) -> Got:
        ids, rows, leased = self._call(self.actor.get.remote(request, self._caller()))
        return ids, self._resolve(rows), leased

    def ack(self, lease_id: str) -> None:
        self._call(self.actor.ack.remote(lease_id))

    def drop_consumer(self, consumer: Any) -> int:
        return int(self._call(self.actor.drop_consumer.remote(consumer)))

    def cancel(self, token: Any) -> None:
        self._call(self.actor.cancel.remote(token))

    def release(self, partition: str, ids: list[Key]) -> None:
        self._call(self.actor.call.remote("release", partition, ids))

    def peek(
        self, partition: str, ids: list[Key], fields: tuple[str, ...]
    ) -> tuple[list[Key], dict[str, list[Any]]]:
        out, rows = self._call(self.actor.call.remote("peek", partition, ids, fields))
        return out, self._resolve(rows)

    def reset_consumption(self, partition: str, task: str) -> None:
        self._call(self.actor.call.remote("reset_consumption", partition, task))

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
        return meta, [self._resolve_rows(rows) for rows in payload]

    def _resolve_rows(self, rows: list[dict]) -> list[dict]:
        import ray

        refs = [v for row in rows for v in row.values() if isinstance(v, Ref)]
        fetched = iter(ray.get([r.ref for r in refs])) if refs else iter(())
        return [
            {f: next(fetched) if isinstance(v, Ref) else v for f, v in row.items()} for row in rows
        ]

    def restore(self, meta: Mapping[str, Any], payload: list[list[dict]] | None) -> None:
        if payload is not None:
            payload = [
                [{f: self._wrap(v) for f, v in row.items()} for row in rows] for rows in payload
            ]
        self._call(self.actor.restore.remote(dict(meta), payload))

    def reinit(self, options: StoreOptions) -> None:
        self._call(self.actor.reinit.remote(options.to_dict()))

    def refresh(self, refs: list[Any]) -> list[Any]:
        """The current references of chunks handed out as ``refs`` (see the actor's)."""
        return list(self._call(self.actor.refresh.remote(list(refs))))

    def live_chunks(self) -> int:
        import ray

        return int(ray.get(self.actor.live_chunks.remote()))

    def chunk_kinds(self) -> list[str]:
        import ray

        return list(ray.get(self.actor.chunk_kinds.remote()))

    def held_types(self) -> list[str]:
        import ray

        return list(ray.get(self.actor.held_types.remote()))

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)  # callers blocked in the actor get RayActorError at once
