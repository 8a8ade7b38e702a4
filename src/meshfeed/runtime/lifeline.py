"""A worker's tie to its parent: a worker process never outlives the process that started it.

A training job is killed all the time (preemption, OOM, a failed node, Ctrl-C), often with
SIGKILL, which leaves no chance to stop workers. Three mechanisms end a worker within about a
quarter of a second of its parent's death, on every start method; each covers what another
misses:

1. **Parent-death signal** (Linux ``PR_SET_PDEATHSIG``): the kernel sends the worker SIGKILL
   when the thread that started it exits, even while the worker holds the GIL in C code or is
   stopped. Set only where that thread lives as long as the process (the main thread, or the
   ``forkserver``'s), since a pool started from a short-lived thread would otherwise lose its
   workers with the thread. The parent is checked once more after the call: it may have died
   between the fork and the ``prctl``.
2. **Parent watch** (every platform): a daemon thread in the worker waits on a pidfd of the
   parent (Linux >= 5.3) or checks every :data:`POLL` seconds that the parent is alive and
   still the worker's parent, and ends the process when it is not.
3. **No borrowed pipe ends** (``fork``): a forked worker inherits the parent's ends of every
   pipe of the pool made so far, its own task pipe's write end included, so a read would
   never see end-of-file. It closes them first.

multiprocessing's resource tracker (the shared-memory slots of :mod:`.transport` are
registered with it) exits by itself once every process holding its pipe is gone, unlinking
what a killed parent left behind; with the workers gone it follows within milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection

__all__ = ["POLL", "Parent", "close_borrowed", "in_worker", "parent_alive", "tie_to_parent"]

#: Seconds between two checks of the parent where no pidfd can be waited on.
POLL = 0.25
_PR_SET_PDEATHSIG = 1
_EXIT_CODE = 128 + signal.SIGKILL  # what the parent-death signal would have left


@dataclass(frozen=True, kw_only=True, slots=True)
class Parent:
    """Who started a worker, taken in the parent when the pool starts.

    ``pid`` is the process that owns the pool; ``direct`` says whether it is also the worker's
    operating-system parent (``fork``, ``spawn``; the ``forkserver`` is the parent otherwise);
    ``pdeathsig`` whether the parent-death signal may be set (see the module docstring).
    """

    pid: int
    direct: bool
    pdeathsig: bool

    @classmethod
    def here(cls, start_method: str) -> Parent:
        forkserver = start_method == "forkserver"
        main = threading.current_thread() is threading.main_thread()
        return cls(pid=os.getpid(), direct=not forkserver, pdeathsig=forkserver or main)


def parent_alive(parent: Parent, ppid: int) -> bool:
    """Whether the pool's process still runs and (``direct``) is still this one's parent;
    ``ppid`` is the worker's parent as seen at its start."""
    if os.getppid() != ppid:  # reparented: the parent (or the forkserver) exited
        return False
    try:
        os.kill(parent.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs (as another user, e.g. after a setuid): not a death
        return True
    return True


def _set_pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:  # no such process (then the poll check ends us), or pidfds refused
        return None


def _watch(parent: Parent, ppid: int) -> None:
    fd = _pidfd(parent.pid)
    poller = None
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
    while True:
        if poller is not None:
            if poller.poll(int(POLL * 1000)):  # a pidfd is readable once its process exits
                break
        else:
            threading.Event().wait(POLL)
        if not parent_alive(parent, ppid):
            break
    os._exit(_EXIT_CODE)


_IN_WORKER = [False]  # set by tie_to_parent: this process is a meshfeed worker


def in_worker() -> bool:
    """Whether this process is a meshfeed worker process (of any pool), not a training
    process: what a worker makes goes back through shared memory, so work meant for the
    process that owns the GPU (page-locking memory, which makes a CUDA context and cannot
    be done in a child forked after its parent used CUDA) is left to that process."""
    return _IN_WORKER[0]


def tie_to_parent(parent: Parent) -> None:
    """In a new worker, first thing: die with ``parent`` (signal, then the watch thread).

    Ends the process at once if the parent is already gone.
    """
    _IN_WORKER[0] = True
    ppid = os.getppid()
    if parent.pdeathsig:
        _set_pdeathsig()
    if (parent.direct and ppid != parent.pid) or not parent_alive(parent, ppid):
        os._exit(_EXIT_CODE)  # the parent died before the signal was armed
    threading.Thread(
        target=_watch, args=(parent, ppid), name="meshfeed-parent-watch", daemon=True
    ).start()


def close_borrowed(conns: Iterable[Connection]) -> None:
    """Close a forked worker's copies of the parent's pipe ends, so reads see end-of-file."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.close()
