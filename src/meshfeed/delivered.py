"""Delivery for any resumable iterator: pinned / on the device ahead of the loop, with the
stall telemetry of the loaders, and a state that stays exact.

The loaders deliver their own batches (``pin_memory=``, ``device=``); :class:`Delivered` gives
the same to an iterator built on top of one, e.g. :class:`meshfeed.balance.BalancedBatches`,
whose micro-steps are made after the loader's delivery (on the delivery thread, whose CUDA
device is the loop's; its collectives there run on groups of that thread's own, see
:func:`meshfeed.dist.control_group`, and BalancedBatches exchanges its tokens on gloo there):

>>> it = Delivered(iter([{"x": torch.ones(2)}] * 3), device="cpu")   # doctest: +SKIP

The delivery thread takes items of ``inner`` ahead of the loop and, right after each, asks
``inner.state_dict()``: the state of the item the loop got last is the one ``state_dict()``
returns, so a checkpoint never counts an item read ahead but not returned. Once ``inner``
ended (``StopIteration``), it is ``inner``'s state then: a loader's names the start of its next
epoch, which the next ``next()`` reads. The state is ``inner``'s own (its ``kind`` and
``version``); ``load_state_dict`` stops the thread, hands the state to ``inner`` and starts
again from there.

``on_step`` runs once the item counts as returned (``state_dict()`` there is of that item); if
it raises, the item is not returned: the state stays as before it and the next ``next()``
returns it (see :mod:`meshfeed.telemetry`). ``shutdown()`` stops and joins the delivery thread.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

from meshfeed.delivery import Delivery, check_device
from meshfeed.lifecycle import Lifecycle
from meshfeed.options import check_delivery
from meshfeed.protocols import Stateful
from meshfeed.telemetry import StepTiming, Telemetry

__all__ = ["Delivered"]


class Delivered(Lifecycle):
    """``inner``'s items delivered pinned (``pin_memory=True`` with CUDA) and / or on
    ``device``, ``device_prefetch`` ahead, off the loop's thread (module docstring).

    ``inner`` must have ``state_dict`` / ``load_state_dict`` when those are used here; the
    other arguments mean what they mean on :class:`meshfeed.DataLoader`. ``stats()`` is the
    telemetry (``DataLoader.stats()["delivery"]``); ``timeout`` bounds closing the thread.
    """

    def __init__(
        self,
        inner: Any,
        *,
        pin_memory: bool = False,
        device: Any = None,
        device_prefetch: int = 2,
        on_step: Callable[[StepTiming], Any] | None = None,
        warn_wait_share: float | None = 0.25,
        timeout: float = 300.0,
    ) -> None:
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be True or False (got {pin_memory=!r})")
        check_delivery(device, device_prefetch, on_step, warn_wait_share)
        self.inner = inner
        self.telemetry = Telemetry(
            f"Delivered({type(inner).__name__})", warn_wait_share=warn_wait_share, on_step=on_step
        )
        self.delivery = Delivery(
            pin_memory=pin_memory,
            device=check_device(device),
            depth=device_prefetch,
            timeout=timeout,
            telemetry=self.telemetry,
        )
        self._stream: Generator[tuple[Any, Any], None, None] | None = None
        self._state: dict[str, Any] | None = None
        #: ``inner``'s walk generation when the thread started reading (a loader's ``walk``);
        #: items read under another one are stale (see :meth:`_moved`).
        self._walk: int | None = None
        #: The stream ended in an error: the next one rewinds ``inner`` to ``_state`` first.
        self._rewind = False
        #: An item ``on_step`` raised on, with its state: the next one returned.
        self._held: tuple[Any, Any] | None = None

    def __iter__(self) -> Delivered:
        return self

    def __next__(self) -> Any:
        if self._held is not None:  # refused by on_step last time: returned now
            (item, state), self._held = self._held, None
            now = time.perf_counter()
            self.telemetry.took(now, now)
        else:
            item, state = self._next_read()
        before, self._state = self._state, state
        try:
            self.telemetry.returned()  # on_step, which sees this item counted
        except BaseException:  # not returned: the state as before, the item next in line
            self._state, self._held = before, (item, state)
            raise
        return item

    def _next_read(self) -> tuple[Any, Any]:
        """The next item read ahead, with ``inner``'s state after it.

        If ``inner`` moved meanwhile (a loader's ``set_epoch``, ``load_state_dict`` or a new
        iterator, called on it directly), what was read ahead is dropped and reading starts
        again from where ``inner`` now is. An error ends the stream: the next call rewinds
        ``inner`` to the last item returned (items read ahead are not lost) and reads on."""
        while True:
            if self._stream is None:
                self._start()
            assert self._stream is not None
            try:
                item, state = next(self._stream)
            except StopIteration:
                # ``inner``'s walk is over and the delivery thread done with it: its state is
                # now past the end (a loader's: the next epoch), not the last item's.
                self._stream = None
                if isinstance(self.inner, Stateful):
                    self._state = dict(self.inner.state_dict())
                raise
            except BaseException:
                if not self._moved():
                    self._stop()
                    self._rewind = True
                    raise
            else:
                if not self._moved():
                    return item, state
            self._stop()  # inner moved: its new position is the one to read from
            self._state, self._rewind = None, False

    def _start(self) -> None:
        inner = self.inner
        if isinstance(inner, Stateful):
            if self._rewind and self._state is not None:
                inner.load_state_dict(self._state)
            if self._state is None:
                self._state = dict(inner.state_dict())  # before the thread touches it
        self._rewind, self._walk = False, None
        # A weak proxy on the delivery thread: a strong reference from there would keep a
        # dropped Delivered, and the stage that stops that thread, alive for good.
        self._stream = self.delivery.stage(type(self)._items(weakref.proxy(self)))

    def _moved(self) -> bool:
        """Whether ``inner`` (a loader) started another walk than the one being read."""
        now = getattr(self.inner, "walk", None)
        return self._walk is not None and now is not None and now != self._walk

    def _items(self) -> Iterator[tuple[Any, Any]]:
        """On the delivery thread: each item with ``inner``'s state right after it."""
        inner = self.inner
        stateful = isinstance(inner, Stateful)
        it = iter(inner)
        self._walk = getattr(inner, "walk", None)
        for item in it:
            yield item, dict(inner.state_dict()) if stateful else None

    def _stateful(self) -> Stateful:
        if not isinstance(self.inner, Stateful):
            raise TypeError(
                f"{type(self.inner).__name__} has no state_dict/load_state_dict; Delivered "
                "checkpoints what its inner iterator checkpoints"
            )
        return self.inner

    def state_dict(self) -> dict[str, Any]:
        """``inner``'s state as of the last item returned (not of items read ahead), or as it
        ended, once it raised ``StopIteration``."""
        inner = self._stateful()
        return dict(self._state) if self._state is not None else dict(inner.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stop reading ahead, and continue ``inner`` from ``state``."""
        inner = self._stateful()
        self._stop()
        inner.load_state_dict(state)
        self._state, self._held, self._rewind = dict(state), None, False

    def stats(self) -> dict[str, Any]:
        """The loop's waits per step and where time went (see :mod:`meshfeed.telemetry`)."""
        return self.telemetry.report()

    def _stop(self) -> None:
        if self._stream is not None:
            self._stream.close()  # joins the delivery thread
            self._stream = None
        self._walk = None

    def shutdown(self) -> None:
        """Stop the delivery thread (not ``inner``); idempotent."""
        self._stop()
