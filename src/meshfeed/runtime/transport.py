"""How a worker's result reaches the main process: a small header through the pipe, the
tensor and array bytes through a ring of shared-memory slots owned by the main process.

Encoding is pickle protocol 5 with out-of-band buffers: every contiguous CPU tensor (as a
numpy view; bfloat16, float8 and other dtypes numpy lacks as the bits of an
integer dtype of their width) and numpy array becomes one raw buffer; everything else
(dicts, lists, strings, ints, the tensors' shapes and dtypes) stays in the pickled header.
A worker writes the buffers of one result (or of one message's results, when several cheap
tasks travel together) into one free slot (64-byte aligned) and sends the header. The default
collation of a worker's fetcher stacks the batch straight into the slot its reply will use
(:meth:`SlotWriter.open`, :meth:`SlotWriter.take`): no fresh allocation per batch, whose pages
the kernel may have to fault in again every batch, and no copy into the slot; only buffers
made elsewhere are copied, after it (one worker over cheap samples: 2.7-3.4x the batches per
second, ``benchmarks/bench_worker_batch.py``, ``results/worker_batch.txt``). A ``collate_fn`` of
the user never gets slot memory (it might keep a batch, and slots are written again). The main
process rebuilds the tensors as views of the slot, through a mapping of its own, and *lends*
the slot to them: it goes back to the worker (with a later task message) only once the last
tensor viewing it is gone. When the training loop keeps more than ``ring`` results alive, a
further result is copied out of its slot instead (one ``memcpy``), so slots keep cycling; a
worker never has more than ``2 * ring`` slots.

**The reuse guarantee is exact:** no slot is written while any tensor the training loop holds
views it, so a batch can be kept, modified or sent elsewhere for as long as the caller likes.
It survives the death of its worker once its header was read, and the pool's shutdown: the
slots belong to the main process, which unlinks them at shutdown, and a lent slot's memory
stays mapped until its last view is gone.

Why a ring and not torch's shared-memory storages (``tensor.share_memory_()`` and passing
file descriptors): torch creates, maps and later unmaps one new shared-memory file per tensor
per batch and passes its descriptor over a Unix socket. Measured with
``benchmarks/bench_loader.py --quick --only transport`` (one worker, 128 KiB batches, 3 runs on
a shared 2-core machine, load average 11-15): the ring costs the receiving process 24-28 us of
CPU per batch (pipe message ~7 us, one copy ~4 us, header unpickle ~8-14 us), torch's storages
187-239 us; wall time per batch 129-210 us against 1,270-1,949 us. The ring also leaves the
received batch independent of the worker (torch's tensor stays mapped to a file the worker
made). The ring maps each slot once per pool (attach ~35-55 us, not per batch); those figures
are of the copy-per-batch protocol, which lending replaced (see ``bench_loader.py --only
workers`` for the main process's CPU per batch now).

Slots grow to fit: a result too large for every free slot (or sent before any slot exists)
travels in-band through the pipe once, with its size; the main process then creates slots of
that size (rounded up to a power of two) and the worker retires smaller ones. Results whose
buffers total less than :data:`SMALL` bytes always travel in-band (a pipe write is cheaper
than a slot for them).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import mmap
import pickle
import weakref
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

__all__ = [
    "SMALL",
    "OffHostTensorError",
    "SlotReader",
    "SlotWriter",
    "bits_carrier",
    "dumps",
    "from_bits",
    "loads",
    "off_host",
    "reduce_tensor",
]

#: Results whose tensor/array bytes total less than this travel through the pipe.
SMALL = 16 * 1024
_ALIGN = 64
_MIN_SLOT = 256 * 1024


_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS: dict[torch.dtype, tuple[torch.dtype, str] | None] = {}


def bits_carrier(dtype: torch.dtype) -> tuple[torch.dtype, str] | None:
    """How a tensor of ``dtype`` that numpy has no dtype for (bfloat16, the float8 family,
    complex32, the bit and sub-byte types) moves: as its raw bits, viewed as the integer
    dtype of its width, with the name to view it back by (:func:`from_bits`). ``None`` when
    numpy has the dtype (the tensor moves as itself) or torch cannot view it as bits (the
    quantized dtypes: torch's own pickling carries them). Decided once per dtype."""
    try:
        return _BITS[dtype]
    except KeyError:
        pass
    carrier: tuple[torch.dtype, str] | None = None
    try:
        probe = torch.empty(0, dtype=dtype)
    except (TypeError, RuntimeError, NotImplementedError):
        probe = None
    wide = _CARRIERS.get(dtype.itemsize)
    if probe is not None and wide is not None and not probe.is_quantized:
        try:
            probe.numpy()
        except (TypeError, RuntimeError):
            with contextlib.suppress(TypeError, RuntimeError, NotImplementedError):
                probe.view(wide).view(dtype)
                carrier = (wide, str(dtype).removeprefix("torch."))
    _BITS[dtype] = carrier
    return carrier


def from_bits(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """``tensor`` (bits moved by :func:`bits_carrier`) viewed as ``dtype`` again (``None``:
    it moved as itself)."""
    return tensor if dtype is None else tensor.view(getattr(torch, dtype))


def _tensor_from_numpy(array: np.ndarray, dtype: str | None) -> torch.Tensor:
    return from_bits(torch.from_numpy(array), dtype)


def _tensor_from_buffer(
    buffer: Any, np_dtype: str, shape: tuple[int, ...], dtype: str | None
) -> torch.Tensor:
    array = np.frombuffer(buffer, dtype=np_dtype).reshape(shape)
    return _tensor_from_numpy(array, dtype)


def reduce_tensor(obj: Any) -> Any:
    """The reduction of a plain CPU tensor as its raw bytes (one out-of-band buffer under
    protocol 5) plus dtype and shape, the bits of a dtype numpy lacks viewed as an integer
    dtype of its width (:func:`bits_carrier`); a tensor that is not contiguous goes through
    numpy's own pickling. ``NotImplemented`` for anything else (pickled as usual)."""
    if (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.requires_grad
        and not obj.is_conj()
        and not obj.is_neg()
    ):
        dtype = None
        bits = bits_carrier(obj.dtype)
        if bits is not None:  # numpy has no such dtype: move its bits
            obj, dtype = obj.view(bits[0]), bits[1]
        try:
            array = obj.numpy()
        except (TypeError, RuntimeError):  # quantized: torch's own pickling
            return NotImplemented
        if not array.flags.c_contiguous:
            return _tensor_from_numpy, (array, dtype)
        # Straight to a PickleBuffer: numpy's reduce of an array costs twice as much.
        return _tensor_from_buffer, (
            pickle.PickleBuffer(array),
            array.dtype.str,
            array.shape,
            dtype,
        )
    return NotImplemented


class OffHostTensorError(ValueError):
    """A worker's result holds a tensor that is not in host memory (see :func:`off_host`)."""


def off_host(
    obj: Any, who: str = "a worker's result", where: str = "num_workers=0"
) -> OffHostTensorError | None:
    """The error for a tensor of ``who`` (a result that must reach the training process
    through host memory) that lives on a device (``cuda:0``, ``meta``...), else ``None``.
    Pickled as torch pickles it, a CUDA tensor would come back on the device the worker used
    (``cuda:0`` for every rank of a node), after a copy through host memory, and every worker
    would hold a CUDA context of its own: refused with the fix instead (``where``: how to
    make the batches in the training process)."""
    if not isinstance(obj, torch.Tensor) or obj.device.type == "cpu":
        return None
    return OffHostTensorError(
        f"{who} holds a tensor on device {str(obj.device)!r} (shape {tuple(obj.shape)}, "
        f"{obj.dtype}); it reaches the training process through host memory, so its tensors "
        "must be on the CPU. Return CPU tensors from the dataset, the stream and collate_fn, "
        "and let the loader move each batch: device='cuda' copies it from pinned memory on a "
        f"side stream while the step runs; or make the batches in the training process "
        f"({where})"
    )


class _BatchPickler(pickle.Pickler):
    """Pickles CPU tensors as their raw bytes plus dtype and shape (:func:`reduce_tensor`);
    refuses a tensor on a device (:func:`off_host`)."""

    def reducer_override(self, obj: Any) -> Any:
        reduced = reduce_tensor(obj)
        if reduced is NotImplemented:
            error = off_host(obj)
            if error is not None:
                raise error
        return reduced


def dumps(obj: Any, buffers: list[pickle.PickleBuffer] | None = None) -> bytes:
    """Pickle ``obj``; with ``buffers`` given, tensor and array bytes are appended to it
    instead of being copied into the result."""
    out = io.BytesIO()
    callback = None if buffers is None else buffers.append
    _BatchPickler(out, protocol=5, buffer_callback=callback).dump(obj)
    return out.getvalue()


def loads(data: bytes, buffers: list[Any] | None = None) -> Any:
    return pickle.loads(data, buffers=buffers)


class SlotWriter:
    """The worker's side: the slots it may write into, and the encoding of one result."""

    def __init__(self) -> None:
        self.slots: dict[int, shared_memory.SharedMemory] = {}
        self.free: set[int] = set()
        self.need = 0  # the largest result seen; free slots smaller than it are retired
        self.retired: list[int] = []
        # The slot a message's reply goes to, open for collation to write into (see open()):
        # (slot id, the slot as bytes, its address, bytes taken so far).
        self._open: tuple[int, np.ndarray, int, int] | None = None
        self._closing: list[shared_memory.SharedMemory] = []  # retired, still viewed here

    def update(self, frees: list[int], added: list[tuple[int, str]]) -> None:
        for sid, name in added:
            self.slots[sid] = shared_memory.SharedMemory(name=name)
            self.free.add(sid)
        self.free.update(frees)
        for sid in [s for s in self.free if self.slots[s].size < self.need]:
            self.free.discard(sid)
            self._closing.append(self.slots.pop(sid))
            self.retired.append(sid)
        self._closing = [shm for shm in self._closing if not _closed(shm)]

    # ------------------------------------------------------------------ writing in place
    def open(self) -> None:
        """Open the free slot that this message's reply will use, so that the default
        collation writes the batch's tensors straight into it (:meth:`take`): no fresh
        allocation per batch in the worker (whose pages the kernel may have to fault in
        again) and no copy into the slot. Only once a result's size is known (``need``)."""
        fits = [s for s in self.free if self.slots[s].size >= self.need] if self.need else []
        if fits:
            sid = min(fits)
            buf = self.slots[sid].buf
            assert buf is not None  # an open segment always has a buffer
            slot = np.frombuffer(buf, dtype=np.uint8)
            self._open = (sid, slot, slot.ctypes.data, 0)

    def take(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of the open slot (64-byte aligned) for a tensor of the reply, or None
        when no slot is open or it has no room left."""
        if self._open is None:
            return None
        sid, slot, address, used = self._open
        start = -(-used // _ALIGN) * _ALIGN
        if start + nbytes > len(slot):
            return None
        self._open = (sid, slot, address, start + nbytes)
        return slot[start : start + nbytes]

    def encode(self, obj: Any) -> bytes:
        """The header for ``obj``; its buffers are written into a free slot when one fits
        (buffers already in the open slot stay where they are)."""
        opened, self._open = self._open, None
        buffers: list[pickle.PickleBuffer] = []
        meta = dumps(obj, buffers)
        raws = [b.raw() for b in buffers]
        layout: list[tuple[int, int]] = []
        total = 0
        for raw in raws:
            layout.append((total, raw.nbytes))
            total += -(-raw.nbytes // _ALIGN) * _ALIGN
        retired, self.retired = self.retired, []
        if total < SMALL:
            return pickle.dumps(("ok", None, meta, [bytes(r) for r in raws], 0, retired), 5)
        if opened is not None:
            placed = _place(opened, raws)
            if placed is not None:
                sid, layout, total = placed
                self.free.discard(sid)
                self.need = max(self.need, total)
                return pickle.dumps(("ok", sid, meta, layout, total, retired), 5)
        self.need = max(self.need, total)
        # Not the open slot: the buffers collation wrote there would be copied over themselves.
        skip = None if opened is None else opened[0]
        fits = [s for s in self.free if self.slots[s].size >= total and s != skip]
        if not fits:  # in-band once; the main process adds slots of this size
            return pickle.dumps(("ok", None, meta, [bytes(r) for r in raws], total, retired), 5)
        sid = min(fits)
        self.free.discard(sid)
        view = self.slots[sid].buf
        assert view is not None  # an open segment always has a buffer
        slot = np.frombuffer(view, dtype=np.uint8, count=total)
        for (offset, nbytes), raw in zip(layout, raws, strict=True):
            # numpy's copy: about 1.5x the speed of a memoryview slice assignment
            np.copyto(slot[offset : offset + nbytes], np.frombuffer(raw, dtype=np.uint8))
        del slot, view
        return pickle.dumps(("ok", sid, meta, layout, total, retired), 5)

    def close(self) -> None:
        self._open = None
        left = [shm for shm in [*self.slots.values(), *self._closing] if not _closed(shm)]
        if left:  # viewed by garbage not yet collected (an error's traceback)?
            gc.collect()
            _STUCK.extend(shm for shm in left if not _closed(shm))
        self.slots, self._closing = {}, []


def _place(
    opened: tuple[int, np.ndarray, int, int], raws: list[Any]
) -> tuple[int, list[tuple[int, int]], int] | None:
    """The reply's buffers in the open slot: those the collation wrote there stay, the
    others are copied after what it took; (slot id, layout, extent), or None when they do
    not all fit."""
    sid, slot, address, end = opened
    layout: list[tuple[int, int]] = []
    copies: list[tuple[int, Any]] = []
    for raw in raws:
        nbytes = raw.nbytes
        at = np.frombuffer(raw, dtype=np.uint8).ctypes.data - address
        if 0 <= at <= len(slot) - nbytes:
            layout.append((at, nbytes))
        else:
            start = -(-end // _ALIGN) * _ALIGN
            layout.append((start, nbytes))
            copies.append((start, raw))
            end = start + nbytes
    if end > len(slot):
        return None
    for start, raw in copies:
        np.copyto(slot[start : start + raw.nbytes], np.frombuffer(raw, dtype=np.uint8))
    return sid, layout, max((at + n for at, n in layout), default=0)


#: Mappings still viewed when their writer closed: kept, so that no ``__del__`` fails on them.
_STUCK: list[shared_memory.SharedMemory] = []


def _closed(shm: shared_memory.SharedMemory) -> bool:
    """Close the worker's mapping of ``shm``; False while something here still views it
    (a reply's tensor not yet collected): it is tried again later."""
    try:
        shm.close()
    except BufferError:
        return False
    return True


class SlotReader:
    """The main process's side for one worker: creates, reads and finally unlinks its slots."""

    def __init__(self, ring: int) -> None:
        self.ring = ring
        self.slots: dict[int, shared_memory.SharedMemory] = {}
        self.next_id = 0
        self.frees: list[int] = []  # slots done with, to hand back with the next task
        self.added: list[tuple[int, str]] = []
        self.lent: set[int] = set()  # slots the returned results still view
        self._watch: dict[int, weakref.ref[Any]] = {}  # per lent slot: its views' base
        self._lend_maps: dict[int, Any] = {}
        self.enabled = ring > 0
        self._largest = 0  # the largest slot made (so reserve() is one comparison)

    def take_updates(self) -> tuple[list[int], list[tuple[int, str]]]:
        frees, added = self.frees, self.added
        self.frees, self.added = [], []
        return frees, added

    def decode(self, kind_slot_meta: tuple[Any, ...]) -> Any:
        _, sid, meta, layout, total, retired = kind_slot_meta
        for r in retired:
            self._drop(r)
        if sid is None:
            obj = loads(meta, [bytearray(b) for b in layout])
            if total and self.enabled:
                self._grow(total)
            return obj
        shm_view = self.slots[sid].buf
        assert shm_view is not None  # an open segment always has a buffer
        if len(self.lent) < self.ring:
            # Lend the slot: the result's tensors view it, and it goes back to the worker
            # once the last of them is gone (never while one is alive). The views hold a
            # mapping of their own, so the slot can be unlinked (and its first mapping closed)
            # at shutdown while results still live; the memory goes with the last of them.
            del shm_view
            base = np.frombuffer(self._lendable(sid), dtype=np.uint8, count=total)
            self.lent.add(sid)
            # A weak reference kept here (a quarter of the cost of weakref.finalize per batch):
            # its callback runs where the last view dies.
            self._watch[sid] = weakref.ref(base, functools.partial(self._returned, sid))
            return loads(meta, [base.data[o : o + n] for o, n in layout])
        # The training loop keeps many results alive: copy this one out, so the slot cycles.
        view = np.empty(total, dtype=np.uint8).data  # not zero-filled: it is overwritten
        view[:] = shm_view[:total]  # the one copy
        del shm_view
        obj = loads(meta, [view[o : o + n] for o, n in layout])
        self.frees.append(sid)
        return obj

    def _lendable(self, sid: int) -> Any:
        """A second mapping of slot ``sid`` for lent views (one per slot, made once)."""
        mapped = self._lend_maps.get(sid)
        if mapped is None:
            shm = self.slots[sid]
            mapped = self._lend_maps[sid] = mmap.mmap(shm._fd, shm.size)  # type: ignore[attr-defined]
        return mapped

    def _returned(self, sid: int, _: object = None) -> None:
        # The callback of the weak reference to the views' base (``_``): runs where the last
        # view of a lent slot died (any thread); list, set and dict operations are atomic
        # under the GIL.
        self.lent.discard(sid)
        self._watch.pop(sid, None)
        if sid in self.slots:
            self.frees.append(sid)

    def _drop(self, sid: int) -> None:
        """Unlink a slot; unmap it now unless results still view it (then when they go)."""
        shm = self.slots.pop(sid)
        self._lend_maps.pop(sid, None)  # unmapped when the last view of it is gone
        shm.close()
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()

    def reserve(self, nbytes: int) -> None:
        """Make slots for results of ``nbytes`` now, when none is that large, so that they
        go to the worker with the next task message (a result too large for every slot
        would otherwise travel through the pipe once, and only then grow the slots)."""
        if self.enabled and nbytes >= SMALL and nbytes > self._largest:
            self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        size = max(_MIN_SLOT, 1 << (nbytes - 1).bit_length())
        big_enough = sum(
            1 for sid, s in self.slots.items() if s.size >= size and sid not in self.lent
        )
        for _ in range(self.ring - big_enough):
            try:
                shm = shared_memory.SharedMemory(create=True, size=size)
            except OSError:  # /dev/shm full or absent: results keep travelling in-band
                self.enabled = False
                return
            self.slots[self.next_id] = shm
            self._largest = max(self._largest, size)
            self.added.append((self.next_id, shm.name))
            self.next_id += 1

    def close(self) -> None:
        """Unlink every slot (call once the worker is gone); a slot that results still view
        stays mapped until they are gone."""
        for sid in list(self.slots):
            self._drop(sid)
