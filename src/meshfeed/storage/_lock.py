"""A file lock (``flock``) with a bounded wait, shared by the processes of one node.

A forked child closes its copies of every open lock's descriptor at once (``os.register_at_fork``).
``flock`` belongs to the open file description, which a fork shares: a child that kept the copy
of a lock another thread held at the fork (a download in flight, the cache-wide lock) would keep
that lock for its whole life after the parent let go, and every process waiting for it would
wait ``lock_timeout``. Closing the child's copy leaves the parent's lock as it is.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from meshfeed.errors import SourceError

T = TypeVar("T")


class FileLock:
    """``flock`` on one lock file (or, ``directory=True``, on a folder): shared (readers of an
    entry) or exclusive (its writer).

    Locks belong to the open file description, so two ``FileLock`` objects on the same file
    exclude each other even inside one process (threads of one process are safe). The kernel
    drops the lock when the process dies, however it dies. Waits poll with a growing pause and
    end at ``deadline`` with a :class:`SourceError` that says what was waited for.
    """

    def __init__(self, path: str, *, directory: bool = False) -> None:
        self.path = path
        self._fd: int | None = None  # set first: __del__ runs even when the open below fails
        flags = os.O_RDONLY if directory else os.O_RDWR | os.O_CREAT
        with _registry:
            self._fd = os.open(path, flags, 0o666)
            _open[id(self)] = weakref.ref(self)

    def try_acquire(self, *, exclusive: bool) -> bool:
        if self._fd is None:
            raise ValueError(f"the lock on {self.path} is closed")
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def acquire(self, *, exclusive: bool, deadline: float, what: str) -> None:
        """Take the lock before ``deadline`` (``time.monotonic``)."""
        self.wait_for(lambda: self.try_acquire(exclusive=exclusive) or None, deadline, what)

    def wait_for(
        self, attempt: Callable[[], T | None], deadline: float, what: str
    ) -> tuple[T, bool]:
        """Call ``attempt`` until it returns something other than None, pausing a growing
        while between calls; return that and whether it had to wait. Past ``deadline`` a
        :class:`SourceError` says what was waited for."""
        pause, waited = 0.002, False
        while (result := attempt()) is None:
            waited = True
            if time.monotonic() >= deadline:
                raise SourceError(
                    f"timed out waiting for the cache lock {self.path} ({what}); another process "
                    "holds it: wait for it to finish, or raise lock_timeout"
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 0.1)
        return result, waited

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with _registry:
            fd, self._fd = self._fd, None
            _open.pop(id(self), None)
        if fd is not None:
            os.close(fd)  # releases the lock

    def __del__(self) -> None:
        self.close()


# every open FileLock of this process, so that a forked child can close its copies
_open: dict[int, weakref.ref[FileLock]] = {}
# held from a descriptor's open to its registration, and across a fork: no child gets a copy
# it does not know of (re-entrant: a lock collected inside the block closes itself)
_registry = threading.RLock()


def _close_in_child() -> None:
    """In a forked child: close the copies of the parent's lock descriptors (never unlock:
    ``LOCK_UN`` on the shared description would release the parent's lock)."""
    global _registry
    for ref in list(_open.values()):
        lock = ref()
        if lock is not None and lock._fd is not None:
            fd, lock._fd = lock._fd, None
            os.close(fd)
    _open.clear()
    _registry = threading.RLock()


os.register_at_fork(
    before=lambda: _registry.acquire(),
    after_in_parent=lambda: _registry.release(),
    after_in_child=_close_in_child,
)
