"""A forked child keeps the remote filesystems its parent made, and never closes them.

A worker process forked from a process that has read URLs inherits that process's filesystem
objects (s3fs clients), their pooled connections, and their event loop's epoll instance: one
kernel object, shared by parent and child. fsspec drops its cached instances in the child on
first use; the collector then finalizes a dropped s3fs client there, on the thread of the
child's own event loop, and s3fs closes the client on that loop. Its connections still belong
to the parent's loop object, so closing them unregisters their sockets from the *shared* epoll
instance: the parent stops hearing those connections. Its next GET on one of them sits unread
until the client's read timeout (60 s by default), then s3fs sends the whole GET again (#29: a
limited 2-worker epoch downloaded a shard twice, and stalled, in every run of the storage
tests; the child's unregistering of the parent's socket was logged each time).

So every child keeps its parent's filesystem objects referenced until it exits (a handful of
objects; a forked worker ends with ``os._exit``, which runs no finalizer), and makes its own
for its own requests (fsspec's instance cache is per process).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

_lock = threading.Lock()
_seen: weakref.WeakSet[Any] = weakref.WeakSet()  # filesystems this process made
_forking: list[Any] = []  # what a fork in progress hands its child
_inherited: list[Any] = []  # the parent's filesystems, kept unclosed in a forked child


def remember(fs: Any) -> None:
    """``fs`` is a filesystem this process uses: a child forked later keeps it unclosed."""
    try:
        with _lock:
            _seen.add(fs)
    except TypeError:  # no weak references to it: nothing of it to keep
        pass


def _before_fork() -> None:
    with _lock:
        _forking[:] = list(_seen)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _inherited.extend(_forking)
    _forking.clear()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_forking.clear,
    after_in_child=_after_fork_in_child,
)
