"""One background thread: batches made in this process, ``prefetch`` of them ahead, in order.

For batches whose cost is waiting rather than computing (a sample store's ``get`` waiting for
producers, a remote read): one thread takes the tasks in order and makes each, so the calling
loop finds the next batch made while it trained on the last. The thread takes a task only
while fewer than ``prefetch`` are taken and not passed, so at most ``prefetch`` are in flight
(:attr:`ThreadService.in_flight`, the one the loop holds included). Results, and the first
error, come back in task order; the thread stops at the first error.

An abandoned ``map`` (the loop stopped early, or closed it) stops its thread after the task it
is making, and closing the map waits for that, up to ``join`` seconds: a store request is
cancelled by its token and ends at once, so a store loader's ``shutdown()`` returns with the
thread gone. A task that cannot be interrupted here and takes longer is left to end on its own
(the thread is a daemon; a warning says so); at exit a thread still running is stopped and
joined before the interpreter tears down (:func:`meshfeed.delivery.stop_at_exit`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

from meshfeed.delivery import EXIT_WAIT, stop_at_exit, take_from
from meshfeed.lifecycle import now_or_later
from meshfeed.protocols import Fetch
from meshfeed.tasks import FetchEvents, FetchTask

__all__ = ["ThreadService"]

_POLL = 0.05  # seconds between checks of the stop flag
logger = logging.getLogger(__name__)


class ThreadService:
    """Makes batches on one background thread, up to ``prefetch`` tasks ahead (module
    docstring); the same results, in the same order, as :class:`InProcessService`."""

    def __init__(
        self, prefetch: int = 2, *, name: str = "meshfeed-fetch", join: float = EXIT_WAIT
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1 for ThreadService (got {prefetch=})")
        if isinstance(join, bool) or not isinstance(join, int | float) or not 0 <= join < 1e9:
            raise ValueError(
                f"join must be the seconds a closed map waits for its thread, >= 0 and finite "
                f"(got {join=!r})"
            )
        self.prefetch, self.name, self.join = prefetch, name, float(join)
        self._fetcher: Fetch | None = None

    @property
    def in_flight(self) -> int:
        """The most tasks a ``map`` holds taken and not yet passed: ``prefetch``, the batch the
        loop is given included."""
        return self.prefetch

    def start(self, fetcher: Fetch) -> None:
        self._fetcher = fetcher

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        fetcher = self._fetcher
        if fetcher is None:
            raise RuntimeError("ThreadService.map() before start(); call start(fetcher) first")
        return self._run(fetcher, iter(tasks))

    def _run(self, fetcher: Fetch, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, Any]]:
        done: queue.Queue[tuple[str, Any]] = queue.Queue()
        room = threading.Semaphore(self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(
            target=_work, args=(fetcher, tasks, done, room, stop), name=self.name, daemon=True
        )
        stop_at_exit(thread, stop)  # not left inside a fetch while the interpreter tears down
        thread.start()
        try:
            while True:
                kind, payload = take_from(done, thread)
                if kind == "end":
                    return
                if kind == "error":
                    raise payload
                yield payload
                room.release()  # the loop is done with it: the thread may take one more
        finally:
            stop.set()
            now_or_later(self._join, thread)  # where the cycle collector closes it: after

    def _join(self, thread: threading.Thread) -> None:
        """Wait (up to ``join`` seconds) for a stopped map's thread to end its task."""
        if thread is threading.current_thread():  # closed by the task itself: ends on return
            return
        thread.join(self.join)
        if thread.is_alive():
            logger.warning(
                "meshfeed: the %s thread did not stop within %.1f s (it is making a batch that "
                "cannot be interrupted); it ends once that batch is made",
                thread.name,
                self.join,
            )

    def shutdown(self) -> None:
        """Nothing to stop: a map's thread ends with its map."""


def _work(
    fetcher: Fetch,
    tasks: Iterator[FetchTask],
    done: queue.Queue[tuple[str, Any]],
    room: threading.Semaphore,
    stop: threading.Event,
) -> None:
    try:
        while not stop.is_set():
            if not room.acquire(timeout=_POLL):
                continue
            if stop.is_set():
                return
            try:
                task = next(tasks)
            except StopIteration:
                done.put(("end", None))
                return
            done.put(("item", fetcher(task)))
    except BaseException as exc:  # handed to the loop, raised there in order
        done.put(("error", exc))
