"""What a worker of a :class:`~meshfeed.runtime.pool.WorkerPool` that died, stalled or raised
becomes in the main process: :class:`WorkerError` and its kinds, and the one message each user
of the pool gives for them.

A handler's exception is re-raised as its original type when that type can be built from one
string (the worker's traceback appended to its message), else as :class:`WorkerError`.
"""

from __future__ import annotations

import signal

__all__ = [
    "PoolClosed",
    "WorkerDied",
    "WorkerError",
    "WorkerTimeout",
    "exit_reason",
    "failure_message",
]


class PoolClosed(RuntimeError):
    """The pool was shut down while a result was awaited, or is used after its shutdown
    (before it is started again): nothing failed, the iteration that used it is over."""


class WorkerError(RuntimeError):
    """A worker process died, stalled, or raised something that cannot be re-raised as is."""


class WorkerDied(WorkerError):
    """A worker process exited while a result of it was awaited."""

    def __init__(self, message: str, *, worker: int, pid: int | None, exitcode: int | None):
        super().__init__(message)
        self.worker, self.pid, self.exitcode = worker, pid, exitcode


class WorkerTimeout(WorkerError):
    """A worker produced nothing within the pool's timeout."""

    def __init__(self, message: str, *, worker: int, pid: int | None, timeout: float):
        super().__init__(message)
        self.worker, self.pid, self.timeout = worker, pid, timeout


def exit_reason(code: int | None) -> str:
    """What a worker's exit code says, in words (a signal's name and its usual cause)."""
    causes = {
        signal.SIGKILL: "killed: out of memory (the kernel's OOM killer), or by a user",
        signal.SIGBUS: "a memory-mapped file shrank underneath it, or a bad memory page",
        signal.SIGSEGV: "a crash in native code",
        signal.SIGTERM: "terminated",
    }
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"exit code {code}"
    cause = causes.get(signal.Signals(-code))
    return f"exit code {code}, {name}" + (f": {cause}" if cause else "")


def failure_message(error: WorkerError, *, who: str, what: str, then: str) -> str:
    """The one message for a worker of ``who`` that died or stalled while making ``what``
    (e.g. ``"step 7"``); ``then`` says what iterating again does."""
    worker, pid = getattr(error, "worker", "?"), getattr(error, "pid", "?")
    if isinstance(error, WorkerTimeout):
        why = (
            f"produced nothing for {what} within timeout={error.timeout}s (stuck, e.g. on I/O, "
            "or stopped); raise timeout= if that legitimately takes longer"
        )
    elif isinstance(error, WorkerDied):
        why = f"exited unexpectedly with {exit_reason(error.exitcode)}, while making {what}"
    else:
        why = f"failed while making {what} ({error})"
    return f"{who} worker {worker} (pid {pid}) {why}. {then}"


def _reraise(exc_type: type[BaseException] | str, text: str, where: str) -> None:
    if isinstance(exc_type, str):
        raise WorkerError(f"{exc_type}: {text}\n\n{where}")
    try:
        exc = exc_type(f"{text}\n\n{where}")
    except Exception:
        exc = WorkerError(f"{exc_type.__name__}: {text}\n\n{where}")
    raise exc
