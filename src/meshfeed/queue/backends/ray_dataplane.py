"""The Ray store's data plane: large columns travel through Ray's object store, not the actor.

Data plane apart from the control plane: a put's tensor / array column of at least
``inline_bytes`` is ``ray.put`` once, by the producing client, and the actor receives only a
:class:`~meshfeed.queue.engine.columns.RemoteChunk` (its reference, length and row layout; Ray
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
:func:`tensor_out`): torch's own tensor pickling cost more than the rest of a small call.
A per-sample CPU tensor value travels as its array, or as its
:class:`~meshfeed.queue.engine.columns.Bits` where numpy lacks its dtype (uint16 / uint32 /
uint64, float8, complex32, the bit and sub-byte types, bfloat16: torch's own pickling cannot
load some of them), every way, with the call or through the object store
(:class:`_TensorValue`, :func:`tensor_out`): 1,000 int64[128] values put and got in 35-38 ms,
against 98-101 ms as tensors. Dict, list and tuple values (nested, holding tensors of any
dtype: the uint16 token ids of ``meshfeed convert``) travel to the actor pickled by
:func:`_pickler`, which moves their tensors as the worker transport does (raw bytes
out-of-band, the bits of a dtype numpy lacks; torch's own pickling, which Ray would use,
cannot load some), a put's list column of them as one (:class:`_NestedColumn`): no value is
walked, and 1,000 dicts ``{"ids": int64[128], "n": 3}`` are put and got in 24-37 ms, against
89-118 ms. They leave the actor through :func:`tensor_out`, which Ray applies at any depth.
"""

from __future__ import annotations

import asyncio
import functools
import io
import pickle
import sys
import weakref
from collections import ChainMap
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshfeed.queue.engine.columns import (
    Bits,
    Chunk,
    RemoteChunk,
    Runs,
    assemble,
    signature,
    transportable,
)
from meshfeed.queue.engine.records import SCALAR_TYPES, Ref, nbytes_of

#: Seconds between checks that a waiting caller, a lease holder or a producer is still alive.
PROBE_INTERVAL = 1.0
#: Longest wait for one liveness answer (no answer: assumed alive, asked again later).
PROBE_TIMEOUT = 5.0

_CONTAINERS = frozenset({dict, list, tuple})  # values pickled by _pickler (see _NestedValue)
_PLAIN = SCALAR_TYPES | {str, bytes}  # values that travel as they are
_PROBE: dict[str, Any] = {}  # this process's liveness probe per Ray session (worker id)


def caller_probe() -> Any:
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


async def caller_alive(probe: Any) -> bool:
    """Whether the process that owns ``probe`` (an object it ``ray.put``) still runs: Ray
    fails reading an object whose owner died (``OwnerDiedError``), even one read before.
    An answer that does not come within :data:`PROBE_TIMEOUT` counts as alive."""
    import ray

    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(probe.future())), PROBE_TIMEOUT)
    except (ray.exceptions.ObjectLostError, ray.exceptions.RayError):
        return False
    except asyncio.TimeoutError:
        return True
    return True


def _payload(value: Any) -> np.ndarray | Bits | None:
    """A plain CPU tensor as the array sharing its memory, or as its :class:`Bits` when numpy
    lacks its dtype; ``None`` for anything else (a quantized, GPU or grad tensor: kept)."""
    torch = sys.modules.get("torch")
    if (
        torch is None
        or type(value) is not torch.Tensor
        or value.requires_grad
        or value.layout != torch.strided
        or value.device.type != "cpu"
    ):
        return None
    payload = transportable(value)
    return payload if isinstance(payload, np.ndarray) or type(payload) is Bits else None


def _as_array(value: Any) -> np.ndarray | None:
    """A plain CPU tensor as the array sharing its memory, else ``None`` (keep the tensor)."""
    payload = _payload(value)
    return payload if isinstance(payload, np.ndarray) else None


def tensor_out(value: Any) -> tuple[bool, Any]:
    """Ray serializer for tensors leaving the store actor: an array when it can be one (numpy
    pickles in about a fifteenth of the time of torch's tensor pickling, measured on 64x8
    int64), the :class:`Bits` of a dtype numpy lacks (torch cannot load float8, complex32,
    ... it pickled), else the tensor's own pickle (quantized)."""
    payload = _payload(value)
    return (True, payload) if payload is not None else (False, pickle.dumps(value))


def tensor_in(payload: tuple[bool, Any]) -> Any:
    """The tensor :func:`tensor_out` sent (writable: a read-only received buffer is copied)."""
    import torch

    is_array, data = payload
    if not is_array:
        return pickle.loads(data)
    if type(data) is Bits:
        return data.tensor()  # copies a read-only array too
    return torch.from_numpy(data if data.flags.writeable else data.copy())


@dataclass(eq=False, slots=True)
class _TensorValue:
    """A client's per-sample CPU tensor value on its way to the store actor or the object
    store: pickled as the array sharing its memory, or as its :class:`Bits` where numpy lacks
    the dtype (out-of-band with Ray), it arrives as the tensor (:func:`tensor_in`: writable,
    its own memory)."""

    payload: np.ndarray | Bits

    def __reduce__(self) -> Any:
        return (tensor_in, ((True, self.payload),))


@functools.cache
def _pickler() -> type:
    """Ray's cloudpickle (classes of ``__main__``, lambdas), plain CPU tensors as the worker
    transport moves them (:func:`~meshfeed.runtime.transport.reduce_tensor`: raw bytes as an
    out-of-band buffer, the bits of a dtype numpy lacks), other tensors (quantized, GPU,
    grad) as torch pickles them. Tensors by the dispatch table, read in C: a
    ``reducer_override`` of ours would cost a Python call per container more than Ray's
    own pickling (1,000 lists of 8 small dicts: +1.6 ms)."""
    import torch
    from ray import cloudpickle

    from meshfeed.runtime.transport import reduce_tensor

    def reduce(tensor: torch.Tensor) -> Any:
        reduced = reduce_tensor(tensor.resolve_conj().resolve_neg())  # a view: its values
        return tensor.__reduce_ex__(5) if reduced is NotImplemented else reduced

    table: ChainMap[type, Any] = ChainMap(
        {torch.Tensor: reduce}, cloudpickle.CloudPickler.dispatch_table
    )

    class Pickler(cloudpickle.CloudPickler):
        dispatch_table = table

    return Pickler


def _pickled(value: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """``value`` pickled by :func:`_pickler` (protocol 5): the stream and its out-of-band
    buffers."""
    out = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    _pickler()(out, protocol=5, buffer_callback=buffers.append).dump(value)
    return out.getvalue(), buffers


def _unpickled(header: bytes, *buffers: Any) -> Any:
    """What :func:`_pickled` pickled, its tensors in memory of their own (a read-only
    received buffer is copied)."""
    own = [b if not memoryview(b).readonly else np.frombuffer(b, np.uint8).copy() for b in buffers]
    return pickle.loads(header, buffers=own)


@dataclass(eq=False, slots=True)
class _NestedValue:
    """A client's dict, list or tuple value on its way to the store actor (a checkpoint's;
    a put's travel in a :class:`_NestedColumn`): pickled by :func:`_pickler`, its tensors'
    bytes out-of-band, it arrives as the value itself, structure types and tensors of every
    dtype as they were."""

    value: Any

    def __reduce__(self) -> Any:
        header, buffers = _pickled(self.value)
        return (_unpickled, (header, *buffers))  # the buffers travel out-of-band


def _column(refs: dict[int, Ref], header: bytes, *buffers: Any) -> list[Any]:
    """The store actor's side of :class:`_NestedColumn`: the values, references in place."""
    values = _unpickled(header, *buffers)
    for i, ref in refs.items():
        values[i] = ref
    return values


@dataclass(eq=False, slots=True)
class _NestedColumn:
    """A put's list column holding a dict, list or tuple value on its way to the store
    actor: its ``values`` pickled as one by :func:`_pickler` (a pickler per value cost more
    than Ray's own pickling of small containers), the :class:`Ref` values apart (``None``
    in ``values``: Ray tracks the object references it pickles itself); it arrives as the
    list of values."""

    values: list[Any]
    refs: dict[int, Ref]

    def __reduce__(self) -> Any:
        header, buffers = _pickled(self.values)
        return (_column, (self.refs, header, *buffers))


def _tensor_chunk(array: np.ndarray) -> Chunk:
    """The store actor's side of :class:`_ArrayChunk`: the chunk as a tensor again."""
    return Chunk(tensor_in((True, array)))


@dataclass(eq=False, slots=True)
class _ArrayChunk:
    """An inline tensor chunk on its way to the store actor, pickled as its array (see
    :func:`tensor_out`); it arrives as a :class:`Chunk` of the tensor."""

    array: np.ndarray

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


class ChunkKeeper:
    """The store actor's side: the object-store chunks its samples reference, pinned while
    their producer owns them and adopted when it dies (see the module docstring). Runs on
    the actor's event loop."""

    def __init__(self, alive: Callable[[Any], Awaitable[bool]] = caller_alive) -> None:
        self.alive = alive
        self.live: weakref.WeakSet[RemoteChunk] = weakref.WeakSet()  # alive in this actor
        # Chunks whose producer still owns them: the pinned value and the producer's probe.
        self.pinned: weakref.WeakKeyDictionary[RemoteChunk, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self.by_ref: weakref.WeakValueDictionary[bytes, RemoteChunk] = (
            weakref.WeakValueDictionary()
        )  # a chunk by the reference it arrived with (see refresh)
        self.adopted = 0  # chunks adopted because their producer died
        self._watch: asyncio.Task[None] | None = None

    async def keep(self, chunks: list[RemoteChunk], probe: Any) -> None:
        """Pin the chunks of a put before it returns, so they outlive their producer (whose
        liveness ``probe`` is watched; ``None``: one that cannot be watched, adopted now)."""
        views = await asyncio.get_running_loop().run_in_executor(
            None, _pin, [c.ref for c in chunks]
        )
        for chunk, view in zip(chunks, views, strict=True):
            self.live.add(chunk)
            self.by_ref[chunk.ref.binary()] = chunk
            self.pinned[chunk] = (view, probe)
        if probe is None:
            await self._adopt(chunks)
        elif self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_producers())

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
        dead = {key for key, probe in probes.items() if not await self.alive(probe)}
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
            self._watch = None

    async def refresh(self, refs: list[Any]) -> list[Any]:
        """The current references of the chunks handed out as ``refs``: a consumer could not
        fetch them (their producer died), so the chunks of dead producers are adopted now.
        A reference this actor does not know is returned as it is."""
        chunks = [self.by_ref.get(r.binary()) for r in refs]
        known = [c for c in chunks if c is not None and c in self.pinned]
        await self._adopt(await self._dead_owners(known))
        return [r if c is None else c.ref for c, r in zip(chunks, refs, strict=True)]


# ----------------------------------------------------------------- the client's side
def wrap(value: Any, inline_bytes: int) -> Any:
    """A value of at least ``inline_bytes`` with a shape goes to the object store (a
    :class:`Ref`); a smaller one travels with the call. A plain CPU tensor travels as its
    array or bits (:class:`_TensorValue`), a dict, list or tuple (which may hold one) as
    :func:`_pickler` pickles it (:class:`_NestedValue`)."""
    import ray

    torch = sys.modules.get("torch")  # a tensor implies torch is imported already
    if torch is not None and isinstance(value, torch.Tensor):
        # As its array (numpy pickles in a fraction of torch's tensor pickling) or bits (a
        # dtype torch's pickling cannot load); a conjugate / negative view: its values.
        payload = _payload(value.resolve_conj().resolve_neg())
        if payload is not None:  # a view pickles its own elements only: no clone
            size = nbytes_of(value)
            encoded = _TensorValue(payload)
            return Ref(ray.put(encoded), size) if size >= inline_bytes else encoded
        try:  # noqa: SIM105 (contextlib.suppress: a third of this call's cost per value)
            value = value.clone()  # pickling a view would ship its whole base storage
        except (NotImplementedError, RuntimeError):  # no copy kernel (quint4x2): as it is
            pass
    elif torch is not None and type(value) in _CONTAINERS:  # no torch imported: no tensor
        return _NestedValue(value)
    size = nbytes_of(value)
    if size >= inline_bytes and hasattr(value, "shape"):
        return Ref(ray.put(value), size)
    return value


def wrap_column(column: Any, inline_bytes: int) -> Any:
    """A chunk of at least ``inline_bytes`` goes to Ray's object store once (the store
    actor pins it, and adopts it if this process dies: it outlives this process), and the
    actor gets its reference only; a smaller chunk travels with the call (one pickled column,
    cheaper than an object-store round trip). Values of a list column of at least
    ``inline_bytes`` each go to the object store one by one (see :func:`wrap`); a list column
    with a dict, list or tuple value travels pickled as one (:class:`_NestedColumn`). The
    column's value types are read once, in C."""
    import ray

    if isinstance(column, Chunk):
        data = column.__reduce__()[1][0]  # contiguous, no view of a larger storage
        if column.row_nbytes * len(column) < inline_bytes:
            array = _as_array(data)
            return column if array is None else _ArrayChunk(array)
        ref = ray.put(transportable(data))  # the actor pins it before the put returns
        return RemoteChunk(ref, len(column), column.row_nbytes, signature(data))
    kinds = set(map(type, column))
    if kinds <= _PLAIN:  # numbers, strings, bytes: nothing to wrap
        return column
    if kinds.isdisjoint(_CONTAINERS) or "torch" not in sys.modules:  # no torch: no tensors
        return [wrap(v, inline_bytes) for v in column]
    values = [v if type(v) in _CONTAINERS else wrap(v, inline_bytes) for v in column]
    refs = {i: v for i, v in enumerate(values) if type(v) is Ref}
    for i in refs:
        values[i] = None
    return _NestedColumn(values, refs)


def _references(rows: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The single :class:`Ref` values and the distinct chunk references of a reply's rows."""
    refs = [v.ref for col in rows.values() if type(col) is list for v in col if isinstance(v, Ref)]
    chunk_refs = list(
        {
            id(ref): ref
            for col in rows.values()
            if type(col) is Runs
            for ref, rows_ in col.runs
            if rows_ is not None
        }.values()
    )
    return refs, chunk_refs


def resolve(rows: dict[str, Any], refresh: Callable[[list[Any]], list[Any]]) -> dict[str, Any]:
    """Fetch what the actor handed out by reference, straight from the object store: the
    chunks of :class:`Runs` columns (each once) and single :class:`Ref` values. ``refresh``:
    the actor's current references for chunks that could not be fetched (their producer
    died before the actor adopted them)."""
    import ray

    refs, chunk_refs = _references(rows)
    if not refs and not chunk_refs:
        return rows
    try:
        values = ray.get(refs + chunk_refs)
    except ray.exceptions.ObjectLostError:  # a producer died before the actor adopted
        values = ray.get(refs + refresh(chunk_refs))
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


def resolve_rows(rows: list[dict]) -> list[dict]:
    """Checkpoint rows with their :class:`Ref` values fetched."""
    import ray

    refs = [v for row in rows for v in row.values() if isinstance(v, Ref)]
    fetched = iter(ray.get([r.ref for r in refs])) if refs else iter(())
    return [{f: next(fetched) if isinstance(v, Ref) else v for f, v in row.items()} for row in rows]
