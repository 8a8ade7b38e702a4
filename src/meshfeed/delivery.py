"""The last step of every loader: batches into page-locked memory and onto the device, off the
training loop's thread, with stall telemetry (:mod:`meshfeed.telemetry`).

Without ``pin_memory`` (or without CUDA) and without ``device``, a loader hands its batches over
as they come, timing only the loop's wait. Otherwise a *delivery thread* takes the batches from
the service ahead of the loop, ``device_prefetch`` of them at most: it copies each into pinned
memory (``pin_memory=True`` with CUDA), then, with ``device="cuda"``, issues its copy to the
device on a side CUDA stream and records an event. The loop's thread only takes the next batch
from a bounded queue and makes its current stream wait for that batch's event, so a kernel never
reads a batch before its copy finished, and the device memory is marked as used by the loop's
stream (``record_stream``), so it is not reused before the loop's kernels are done with it.
Pinned memory comes from torch's caching host allocator, which holds a block until the copies
issued from it completed; the pinning copy leaves the worker's shared-memory slot at once, so
slots keep cycling under the reuse guarantee of :mod:`meshfeed.runtime.transport`.

Why a thread: ``Tensor.pin_memory()`` is a copy (~21-35 us per 512 KiB) when torch's host
allocator has a free cached block, but a page-locking ``cudaHostAlloc`` (milliseconds) when it
has none, e.g. while the blocks of earlier batches wait for their copies' events. On the loop's
thread that cost is the accelerator's idle time; on the delivery thread it overlaps the step.

The state stays exact: the loaders update their position when a batch leaves this stage, not
when the thread takes it, so a batch copied ahead but not returned is not consumed.

The thread never outlives its walk: closing the stage (a loader's ``shutdown()``, the end of
its ``with`` block, a walk that is superseded or dropped) stops and joins it, and at exit a
hook stops the threads of walks still live (:func:`stop_at_exit`, which
:class:`~meshfeed.services.ThreadService` uses too), so none is inside torch's C++ code while
the interpreter tears down. ``device``
may be any torch device; ``"cpu"`` runs the same thread and ordering (tested without a GPU).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, TypeVar

import torch

from meshfeed import dist
from meshfeed.collate import rebuild_mapping
from meshfeed.lifecycle import in_collection, now_or_later
from meshfeed.telemetry import Telemetry

__all__ = ["EXIT_WAIT", "Delivery", "check_device", "pin", "stop_at_exit", "take_from", "to_device"]

logger = logging.getLogger("meshfeed")
T = TypeVar("T")
_POLL = 0.05  # seconds between checks of a stop flag or a dead thread


def _map(
    batch: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] | None = None
) -> Any:
    """``batch`` with ``fn`` applied to every tensor of nested mappings, sequences and
    dataclasses, each rebuilt as its own type, as torch's ``pin_memory`` does (other values are
    kept as they are): a mapping is a copy updated with its values (a ``UserDict``, e.g. a
    Hugging Face ``BatchEncoding``, a copy with its ``data`` mapped), else ``type(m)(dict)``,
    else a dict; a namedtuple ``type(t)(*items)``; another tuple (a ``torch.return_types``
    one, a subclass) ``type(t)(items)``, else a tuple; a list subclass a copy updated, else a
    list; a dataclass (frozen, or with ``init=False`` fields) a copy with its fields set."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    cls = type(batch)
    if cls is dict:  # the common cases first
        return {k: _map(v, fn, other) for k, v in batch.items()}
    if cls is list:
        return [_map(v, fn, other) for v in batch]
    if cls is tuple:
        return tuple([_map(v, fn, other) for v in batch])
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, Mapping):
        return _map_mapping(batch, fn, other)
    if isinstance(batch, tuple):
        items = [_map(v, fn, other) for v in batch]
        if hasattr(batch, "_fields"):  # namedtuple
            return cls(*items)
        try:
            return cls(items)  # torch.return_types.* (structseq), tuple subclasses
        except TypeError:
            return tuple(items)
    if isinstance(batch, list):
        items = [_map(v, fn, other) for v in batch]
        try:
            same = copy.copy(batch)
            same[:] = items
            return same
        except TypeError:
            return items
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):  # e.g. a store Batch
        if other is not None and (own := other(batch)) is not batch:
            return own  # its own hook (a pin_memory() method), as torch calls it
        fields = dataclasses.fields(batch)
        mapped = {f.name: _map(getattr(batch, f.name), fn, other) for f in fields}
        if all(f.init for f in fields):  # __init__ (and __post_init__) run again, as before
            return dataclasses.replace(batch, **mapped)
        record = copy.copy(batch)  # init=False fields: set on a copy (frozen ones too)
        for name, value in mapped.items():
            object.__setattr__(record, name, value)
        return record
    return batch if other is None else other(batch)


def _map_mapping(
    batch: Mapping[Any, Any], fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] | None
) -> Any:
    """A mapping of :func:`_map`, of its own type where it can be rebuilt safely, else a dict
    (:func:`~meshfeed.collate.rebuild_mapping`: ``batch`` itself is never changed)."""
    return rebuild_mapping(batch, {k: _map(v, fn, other) for k, v in batch.items()})


def pin(batch: Any) -> Any:
    """``batch`` with its tensors in pinned memory (unchanged without CUDA); an object of
    another type that has a ``pin_memory()`` method is replaced by what it returns, as torch's
    DataLoader does (its documented hook for custom batch types)."""
    if not torch.cuda.is_available():
        return batch
    return _map(batch, _pinned, _own_pin)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned memory; a tensor already pinned or not on the CPU (a dataset's CUDA
    tensor) as it is."""
    return t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory()


def _own_pin(value: Any) -> Any:
    """A custom batch type's own ``pin_memory()``, where it has one (else ``value``)."""
    method = getattr(value, "pin_memory", None)
    return method() if callable(method) and not isinstance(value, type) else value


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """``batch`` with its tensors on ``device`` (nested mappings, sequences and dataclasses,
    each kept as its own type: :func:`_map`). An object of another type stays as it is (its
    tensors, if any, on the CPU), said once per type in the log (:func:`_left_as_is`)."""
    return _map(batch, lambda t: t.to(device, non_blocking=non_blocking), _left_as_is)


_WARNED: set[type] = set()  # the custom types _left_as_is has told of


def _left_as_is(value: Any) -> Any:
    """``value`` itself; a custom object with a ``to()`` method (its tensors are not seen, so
    they stay on the CPU) is named once per type, with the fix."""
    cls = type(value)
    if cls in _WARNED or dataclasses.is_dataclass(value):  # a dataclass's fields are walked
        return value
    to = getattr(value, "to", None)
    if callable(to) and not isinstance(value, type):
        _WARNED.add(cls)
        logger.warning(
            "meshfeed: device= leaves %s objects of the batch as they are (a custom type: "
            "meshfeed moves the tensors of mappings, lists, tuples, namedtuples and "
            "dataclasses); make it a dataclass or a dict, or call its to() in the loop",
            cls.__qualname__,
        )
    return value


def check_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None; ``"cuda"`` is the current CUDA
    device when this is called, i.e. when the loader is built); a clear error for a bad one."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be None, a str or a torch.device (got {device=!r})")
    try:
        out = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(
            f"device={device!r} is not a torch device ({exc}); use e.g. 'cuda', 'cuda:1' or 'cpu'"
        ) from None
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} needs CUDA, which this process does not have; use device=None "
            "(batches stay on the CPU) or device='cpu'"
        )
    if out.type == "cuda" and out.index is None:
        # The delivery thread has a current device of its own: name the caller's.
        out = torch.device("cuda", torch.cuda.current_device())
        local = os.environ.get("LOCAL_RANK", "")
        if local.isdigit() and int(local) != out.index and int(local) < torch.cuda.device_count():
            logger.warning(
                "meshfeed: device=%r is cuda:%d (the current CUDA device when the loader is "
                "built), but LOCAL_RANK=%s: call torch.cuda.set_device(local_rank) before "
                "building the loader, or pass device=f'cuda:{local_rank}'",
                device,
                out.index,
                local,
            )
    return out


class Delivery:
    """Pins and copies batches to ``device`` ahead of the loop (module docstring).

    ``depth``: batches the thread may hold ready; ``timeout``: how long closing waits for the
    thread to finish the batch it is taking.
    """

    def __init__(
        self,
        *,
        pin_memory: bool,
        device: torch.device | None,
        depth: int,
        timeout: float,
        telemetry: Telemetry,
    ) -> None:
        self.pin = pin_memory and torch.cuda.is_available()
        self.device = device
        self.depth = depth
        self.timeout = timeout
        self.telemetry = telemetry
        self._side: Any = None  # the side CUDA stream, made on first use

    @property
    def ahead(self) -> bool:
        """Whether batches go through the delivery thread."""
        return self.pin or self.device is not None

    def stage(
        self, items: Iterator[tuple[Any, T]], *, stop: threading.Event | None = None
    ) -> Generator[tuple[Any, T], None, None]:
        """``(batch, meta)`` pairs of ``items`` with each batch delivered; timed per step.

        ``stop``, set from any thread (a loader's ``shutdown()`` while its loop waits in this
        stage, where it cannot be closed), ends the delivery thread after the batch it is
        making, which is dropped; the loop's wait then ends as if ``items`` had. Closing the
        stage sets it too."""
        return self._ahead(items, stop) if self.ahead else self._timed(items)

    # ------------------------------------------------------------------ the loop's side
    def _timed(self, items: Iterator[tuple[Any, T]]) -> Generator[tuple[Any, T], None, None]:
        took, clock = self.telemetry.took, time.perf_counter
        source = iter(items)
        try:
            while True:
                asked = clock()
                try:
                    item = next(source)
                except StopIteration:
                    return
                took(asked, clock(), produced=True)
                yield item
        finally:
            _close(source)

    def _streams(self) -> bool:
        """Whether copies go through the side CUDA stream (made here, on first use)."""
        if self.device is None or self.device.type != "cuda":
            return False
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return True

    def _thread_device(self) -> int | None:
        """The CUDA device the delivery thread makes current before anything else: CUDA's
        current device is per thread and a new thread's is device 0, so without this a rank on
        ``cuda:k`` would make a context on device 0 there, and an iterator run on the thread
        (``Delivered``'s inner iterator) would put its CUDA tensors on device 0. ``device``'s
        index, else the loop thread's current device where CUDA is initialised; None where this
        process has not used CUDA (the thread's default then is the loop's)."""
        if self.device is not None and self.device.type == "cuda":
            if self.device.index is not None:
                return self.device.index
            return torch.cuda.current_device()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return None

    def _hand_over(self, batch: Any, event: Any) -> None:
        """On the loop's thread: its *current* stream waits for the batch's copy, and the
        batch's memory is marked as used by that stream (not reused before its kernels ran)."""
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)

        def used(t: torch.Tensor) -> torch.Tensor:
            # The tensor itself: the structure _map rebuilds (and drops) holds the same values.
            if t.is_cuda:
                t.record_stream(current)
            return t

        _map(batch, used)

    def _ahead(
        self, items: Iterator[tuple[Any, T]], stop: threading.Event | None
    ) -> Generator[tuple[Any, T], None, None]:
        ready: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=self.depth)
        stop = threading.Event() if stop is None else stop
        held: dict[str, Any] = {}  # the thread's groups (dist.thread_group), freed below
        streams = self._streams()
        # The thread holds what it copies with, not this Delivery: through its telemetry's
        # on_step (a trainer's bound method) it would keep a dropped loader's whole graph,
        # the loop's side of this stage included, alive and never stopped.
        copier = _Copier(self.pin, self.device, self._side if streams else None)
        args = (copier, items, ready, stop, self._thread_device(), held)
        thread = threading.Thread(target=_run, args=args, name="meshfeed-delivery")
        thread.daemon = True  # never keeps a process alive; stopped at exit if still running
        stop_at_exit(thread, stop, ready, timeout=self.timeout)
        thread.start()
        tel = self.telemetry
        ended = False
        try:
            while True:
                asked = time.perf_counter()
                kind, payload = take_from(ready, thread, stop)
                if kind == "end":
                    ended = True
                    return
                if kind == "error":
                    raise payload
                item, event, made = payload
                self._hand_over(item[0], event)  # the loop's kernels start after the copy
                # Counted by the loader (telemetry), with the thread's seconds on this batch:
                # a batch made ahead and dropped (the walk ends first) adds no phase.
                tel.took(asked, time.perf_counter(), made=made)
                yield item
        finally:
            stop.set()
            # Where the cycle collector closes it, inside whatever code allocated on this
            # thread, which may hold what the thread waits for: joined on the reaper thread,
            # its groups retired (freed there, at no agreed point, they could mis-pair).
            now_or_later(self._end, ready, thread, held, ended and not in_collection())

    def _end(
        self,
        ready: queue.Queue[tuple[str, Any]],
        thread: threading.Thread,
        held: dict[str, Any],
        ended: bool,
    ) -> None:
        self._join(ready, thread)
        # Here, on the loop's thread, in its order: a walk that ended frees its groups for
        # the next; one left part way retires them (dist.free_thread_groups).
        dist.free_thread_groups(held.get("groups"), ended and not thread.is_alive())

    def _join(self, ready: queue.Queue[tuple[str, Any]], thread: threading.Thread) -> None:
        if thread is threading.current_thread():
            # Closed on the delivery thread itself (a loader dropped while the thread made its
            # batch is collected there): it sees the stop flag once this returns.
            return
        deadline = time.monotonic() + self.timeout
        while thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                ready.get_nowait()  # a thread blocked in put() sees the stop flag
            thread.join(_POLL)
        if thread.is_alive():
            logger.warning(
                "meshfeed: the delivery thread did not stop within timeout=%.0f s (it waits for "
                "a batch being made); it ends once that batch arrives",
                self.timeout,
            )


# ---------------------------------------------------------------------- the thread's side
@dataclasses.dataclass(frozen=True, slots=True)
class _Copier:
    """What the delivery thread pins and copies with (``side``: the side CUDA stream, None
    where copies do not go through it)."""

    pin: bool
    device: torch.device | None
    side: Any

    def prepare(self, batch: Any) -> tuple[Any, Any, float, float]:
        """``batch`` pinned and copied (on the side stream); the copy's event or None, and
        the seconds spent pinning and copying (added by the loop when the batch is counted)."""
        pin_s = copy_s = 0.0
        if self.pin:
            start = time.perf_counter()
            batch = pin(batch)
            pin_s = time.perf_counter() - start
        device = self.device
        if device is None:
            return batch, None, pin_s, copy_s
        start = time.perf_counter()
        event = None
        if self.side is None:
            batch = to_device(batch, device)
        else:
            with torch.cuda.stream(self.side):
                batch = to_device(batch, device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.side)
        copy_s = time.perf_counter() - start
        return batch, event, pin_s, copy_s


def _run(
    copier: _Copier,
    items: Iterator[tuple[Any, T]],
    ready: queue.Queue[tuple[str, Any]],
    stop: threading.Event,
    cuda_device: int | None,
    held: dict[str, Any],
) -> None:
    """The delivery thread: ``items`` made, pinned and copied, handed to the loop."""
    source = iter(items)
    clock = time.perf_counter
    try:
        # Its collectives (Delivered's inner iterator's) on groups apart from the loop's.
        held["groups"] = dist.mark_delivery_thread()
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)  # this thread's own (see _thread_device)
        if copier.side is not None:  # all it issues (an inner iterator's kernels too) before
            torch.cuda.set_stream(copier.side)  # the event
        while not stop.is_set():
            start = clock()
            try:
                batch, meta = next(source)
            except StopIteration:
                _put(ready, stop, ("end", None))
                return
            produce = clock() - start
            batch, event, pin_s, copy_s = copier.prepare(batch)
            _put(ready, stop, ("item", ((batch, meta), event, (produce, pin_s, copy_s))))
    except BaseException as exc:  # handed to the loop, raised there
        if not _put(ready, stop, ("error", exc)):
            with contextlib.suppress(queue.Full):  # told to stop: a loop still waiting
                ready.put_nowait(("error", exc))  # (shutdown() on another thread) gets it
    finally:
        _close(source)  # the generator runs on this thread: closed here


#: Background threads to stop at exit, with their stop flag, queue and longest wait (weak keys:
#: a thread that ended and was dropped leaves, and the table keeps none alive).
_AT_EXIT: weakref.WeakKeyDictionary[threading.Thread, tuple[threading.Event, Any, float]] = (
    weakref.WeakKeyDictionary()
)
_AT_EXIT_LOCK = threading.Lock()
#: At exit, the longest wait for one thread to finish the batch it is making. Torch's own
#: work ends well within it; a thread still waiting after it (for producers that will not come,
#: a stuck worker) is in Python code, where the interpreter's teardown stops it harmlessly.
EXIT_WAIT = 2.0


def stop_at_exit(
    thread: threading.Thread,
    stop: threading.Event,
    ready: queue.Queue[Any] | None = None,
    *,
    timeout: float = EXIT_WAIT,
) -> None:
    """Have ``thread`` (a daemon thread that runs torch code: a delivery thread, a
    :class:`~meshfeed.services.ThreadService` thread) stopped and joined before the interpreter
    tears down, if it still runs then: ``stop`` is set and ``ready`` (the queue it may be
    blocked putting into) drained; it may finish the batch it is making, up to ``timeout``
    (at most :data:`EXIT_WAIT`) seconds."""
    with _AT_EXIT_LOCK:
        _AT_EXIT[thread] = (stop, ready, min(timeout, EXIT_WAIT))


@atexit.register
def _stop_at_exit() -> None:
    """Stop and join the threads of :func:`stop_at_exit` still running before teardown.

    A loop that ends while an iterator is live (``data_iter = iter(loader)``, a ``break``, an
    exception) leaves its threads running; a daemon thread still inside torch's C++ code when
    the interpreter finalizes is killed there, which aborts the process (SIGABRT, "terminate
    called without an active exception").
    """
    with _AT_EXIT_LOCK:
        live = [(t, *v) for t, v in _AT_EXIT.items() if t.is_alive()]
    live = [row for row in live if row[0] is not threading.current_thread()]
    for _, stop, _, _ in live:
        stop.set()
    for thread, _, ready, wait in live:
        deadline = time.monotonic() + wait
        while thread.is_alive() and time.monotonic() < deadline:
            if ready is not None:
                with contextlib.suppress(queue.Empty):
                    ready.get_nowait()  # a thread blocked in put() sees the stop flag
            thread.join(_POLL)


def _put(ready: queue.Queue[tuple[str, Any]], stop: threading.Event, item: tuple[str, Any]) -> bool:
    """Put ``item`` on ``ready`` unless told to ``stop`` first; whether it was put."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


def take_from(
    ready: queue.Queue[tuple[str, Any]],
    thread: threading.Thread,
    stop: threading.Event | None = None,
) -> tuple[str, Any]:
    """``thread``'s next message on ``ready``; an error if the thread is gone without one,
    ``("end", None)`` if it was told to ``stop`` (it drops what it had then)."""
    while True:
        try:
            return ready.get(timeout=_POLL)
        except queue.Empty:
            if not thread.is_alive() and ready.empty():
                if stop is not None and stop.is_set():
                    return "end", None
                raise RuntimeError(
                    f"meshfeed: the {thread.name} thread ended without a batch or an error; "
                    "this is a bug, please report it with the loader's options"
                ) from None


def _close(source: Iterator[Any]) -> None:
    if isinstance(source, Generator):
        source.close()
