"""A file lock (``flock``) with a bounded wait, shared by the processes of one node."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from typing import TypeVar

from meshfeed.errors import SourceError

T = TypeVar("T")


class FileLock:
    """``flock`` on one lock file: shared (readers of an entry) or exclusive (its writer).

    Locks belong to the open file description, so two ``FileLock`` objects on the same file
    exclude each other even inside one process (threads of one process are safe). The kernel
    drops the lock when the process dies, however it dies. Waits poll with a growing pause and
    end at ``deadline`` with a :class:`SourceError` that says what was waited for.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None  # set first: __del__ runs even when the open below fails
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)

    def try_acquire(self, *, exclusive: bool) -> bool:
        if self._fd is None:
            raise ValueError(f"the lock on {self.path} is closed")
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def acquire(self, *, exclusive: bool, deadline: float, what: str) -> bool:
        """Take the lock before ``deadline`` (``time.monotonic``); True if it had to wait."""
        _, waited = self.wait_for(
            lambda: True if self.try_acquire(exclusive=exclusive) else None, deadline, what
        )
        return waited

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
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def __del__(self) -> None:
        self.close()
