"""The lifecycle every loader shares: ``shutdown()``, a ``with`` block, and collection.

A loader collected without ``shutdown()`` shuts itself down. Where reference counting collects
it (``del loader``, a function returning), that happens at once, on that thread. Where the
cycle collector does, it cannot happen there: the collector runs inside whatever code allocated
at that moment, on any thread, possibly while that thread holds a lock the shutdown needs (a
store's, while a request reads its rows: the shutdown's cancel waited for that lock forever, a
hang seen with 6 ranks' loaders per step), or on one of the loader's own threads, which its
shutdown joins. Such a shutdown, and the ``finally`` of a walk's generator that waits for locks
or threads (:func:`now_or_later`), is handed to one daemon thread, ``meshfeed-reaper`` (started
the first time, idle but for these, never ended: from then on a worker process forked on
Python 3.12 warns that this process has threads), which runs it once no collection runs.
At exit, what it has not run yet gets :data:`EXIT_WAIT` seconds (the exit handlers of the
loaders' threads and worker processes stop those anyway).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Self

__all__ = ["EXIT_WAIT", "Lifecycle", "in_collection", "later", "now_or_later"]

logger = logging.getLogger("meshfeed")
#: At exit, how long the reaper may still run what it was handed.
EXIT_WAIT = 2.0


class Lifecycle:
    """``shutdown()`` stops a loader's worker processes or actors; it must be idempotent.

    A ``with`` block calls it on exit, and a loader that is collected without it calls it too,
    so a forgotten loader does not leave processes behind (module docstring: when the cycle
    collector finds it, on the ``meshfeed-reaper`` thread).
    """

    def shutdown(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if in_collection() and later(self.shutdown):
            return  # resurrected until the reaper has run its shutdown (PEP 442: once)
        with contextlib.suppress(Exception):
            self.shutdown()


class _Collecting(threading.local):
    active = False


_COLLECTING = _Collecting()
#: Whether a collection runs on any thread (CPython runs one at a time): the reaper waits for
#: its end, so that it never closes a generator the collection is about to finalize. A plain
#: flag, polled: a lock or an event here could be held by the code the collection interrupted.
_ANY_COLLECTING = [False]


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    _COLLECTING.active = _ANY_COLLECTING[0] = phase == "start"


gc.callbacks.append(_on_collection)


def in_collection() -> bool:
    """Whether the cycle collector runs on this thread now: a finalizer (``__del__``, a
    generator's ``finally`` that the collector runs) is inside whatever code allocated."""
    return _COLLECTING.active


def now_or_later(fn: Callable[..., object], *args: Any) -> None:
    """``fn(*args)`` now, or, inside a cycle collection (:func:`in_collection`), on the reaper
    thread once it ends: for a generator's ``finally`` that waits for a lock or a thread,
    which the code the collector interrupted on this thread may hold."""
    if not (in_collection() and later(fn, *args)):
        fn(*args)


_LATER: queue.SimpleQueue[tuple[Callable[..., object], tuple[Any, ...]]] = queue.SimpleQueue()
_REAPER: list[threading.Thread] = []
_REAPER_LOCK = threading.Lock()  # taken to start the reaper, never waited for
_STATE = {"pid": os.getpid(), "busy": False}  # whose tables these are; the reaper at work


def _start_reaper() -> bool:
    """Start the reaper unless it runs; whether it runs. Started on first use, inside a
    collection: a thread started earlier would make every later fork of a worker process warn
    ("multi-threaded, use of fork() may lead to deadlocks", Python 3.12). Starting a thread
    there waits for nothing the interrupted code holds, unless that code is threading's own
    bookkeeping of a thread's start or end (its table lock is re-entrant; the lock a new
    thread takes on Python 3.12 and older is held only there)."""
    if _STATE["pid"] != os.getpid():  # a forked child, collecting before its fork hook ran
        _forget_reaper()
    if _REAPER and _REAPER[0].is_alive():
        return True
    if not _REAPER_LOCK.acquire(blocking=False):
        return True  # being started (on another thread, or on this one, interrupted)
    try:
        if not _REAPER or not _REAPER[0].is_alive():
            thread = threading.Thread(target=_reap, name="meshfeed-reaper", daemon=True)
            thread.start()
            _REAPER[:] = [thread]
        return True
    except Exception:  # can't create new thread (at interpreter shutdown, at a limit)
        return False
    finally:
        _REAPER_LOCK.release()


def _forget_reaper() -> None:
    """In a forked child: no reaper runs there (threads do not survive a fork), and the lock
    may have been held by a thread that does not exist there: both made anew."""
    global _LATER, _REAPER_LOCK
    _LATER, _REAPER_LOCK = queue.SimpleQueue(), threading.Lock()
    _REAPER.clear()
    _STATE.update(pid=os.getpid(), busy=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_reaper)


def later(fn: Callable[..., object], *args: Any) -> bool:
    """Queue ``fn(*args)`` for the reaper thread (started here on first use; what raises
    there is logged); ``False`` where it cannot run (the interpreter exits): the caller runs
    it. ``SimpleQueue.put`` never waits, and may be called from a finalizer."""
    if sys.is_finalizing() or not _start_reaper():
        return False
    _LATER.put((fn, args))
    return True


def _reap() -> None:
    while True:
        fn, args = _LATER.get()
        while _ANY_COLLECTING[0]:  # the collection that handed it over is still running
            time.sleep(0.001)
        _STATE["busy"] = True
        try:
            fn(*args)
        except BaseException:  # kept running; said, as Python says a finalizer's error
            logger.warning(
                "meshfeed: %s raised while ending a loader the cycle collector freed",
                getattr(fn, "__qualname__", fn),
                exc_info=True,
            )
        finally:
            _STATE["busy"] = False
        del fn, args  # not kept until the next one arrives


@atexit.register
def _reap_left() -> None:
    """At exit, the reaper gets :data:`EXIT_WAIT` seconds for what it still has, the item
    at work included: a marker queued behind it, waited for (a join in there may wait for a
    thread's timeout)."""
    if _REAPER and _REAPER[0].is_alive() and (_STATE["busy"] or not _LATER.empty()):
        done = threading.Event()
        _LATER.put((done.set, ()))
        done.wait(EXIT_WAIT)
