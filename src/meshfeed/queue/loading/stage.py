"""The store loader's last step: its batches through :mod:`meshfeed.delivery`, state exact.

With ``pin_memory=True`` (and CUDA) or ``device=``, a delivery thread takes the loader's
batches ahead of the training loop, ``device_prefetch`` of them at most, and pins / copies
them there, as for :class:`meshfeed.DataLoader` (#27); otherwise the batch is made when the loop
asks, on its thread. Either way the loop's waits are timed (``stats()["delivery"]``).

A batch the thread took is not consumed until the loop gets it: :class:`Stage` keeps its entry
(``handed``) until :meth:`Stage.next` returns it, and the loader's state counts only what was
returned. :meth:`Stage.stop` (``shutdown()``, or after an error) halts the thread within about
:data:`POLL` seconds, whatever it waits for, and puts the entries it took back at the head of
the loader's queue, collated: they are returned first.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

from meshfeed.delivery import Delivery
from meshfeed.queue.loading.fetch import Entry, Got, InFlight, Late

__all__ = ["POLL", "Stage"]

#: How often a wait on the delivery thread checks whether it is to stop (seconds).
POLL = 0.1

#: What the loader makes: the next batch and its entry (None: the stream ended, or halted).
Make = Callable[[threading.Event], "tuple[Any, Entry] | None"]


class Stage:
    """``make``'s batches, in order, through ``delivery`` (module docstring); ``flight``
    is the loader's queue, where a stopped stage puts back what it took."""

    def __init__(self, delivery: Delivery, flight: InFlight, make: Make) -> None:
        self.delivery, self.flight = delivery, flight
        # Weak: the loader owns its stage, and a cycle would leave it to the garbage collector,
        # whose __del__ -> shutdown() can then run anywhere (inside the store's lock).
        self._make = weakref.WeakMethod(make)
        #: Entries taken by the stage and not yet returned, in order.
        self.handed: deque[Entry] = deque()
        self._stream: Generator[tuple[Any, Entry], None, None] | None = None
        self._halt = threading.Event()

    def next(self) -> tuple[Any, Entry]:
        """The next batch, delivered, and its entry (now returned: no longer ``handed``);
        ``StopIteration`` at the end. After an error the stage is stopped (see :meth:`stop`),
        and the next call starts it again."""
        if self._stream is None:
            self._stream = self.delivery.stage(self._items(self._halt))
        try:
            item, entry = next(self._stream)
        except BaseException:
            self.stop()
            raise
        self.handed.popleft()
        return item, entry

    def _items(self, halt: threading.Event) -> Iterator[tuple[Any, Entry]]:
        while (taken := self._take(halt)) is not None:
            self.handed.append(taken[1])
            yield taken

    def _take(self, halt: threading.Event) -> tuple[Any, Entry] | None:
        # The loader is held only during the call (a suspended _items holds no reference).
        make = self._make()
        return None if make is None else make(halt)

    def wait(self, entry: Entry, halt: threading.Event) -> Got | None:
        """``entry``'s outcome (:meth:`InFlight.wait`); None once ``halt`` is set. Only the
        delivery thread is halted, so on the loop's thread this waits as the flight does."""
        if not self.delivery.ahead:
            return self.flight.wait(entry)
        while not halt.is_set():
            with contextlib.suppress(Late):
                return self.flight.wait(entry, time.monotonic() + POLL)
        return None

    def stop(self) -> None:
        """Halt and join the delivery thread; what it took goes back to the head of the
        queue (module docstring). A no-op when nothing runs."""
        if self._stream is not None:
            self._halt.set()
            self._stream.close()  # joins the delivery thread
            self._stream, self._halt = None, threading.Event()
        self.flight.ahead.extendleft(reversed(self.handed))
        self.handed.clear()
