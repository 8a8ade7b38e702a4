"""What a worker of a :class:`~meshfeed.runtime.pool.WorkerPool` that died, stalled or raised
becomes in the main process: :class:`WorkerError` and its kinds, and the one message each user
of the pool gives for them.

A handler's exception is re-raised as its original type when that type can be built from one
string (the worker's traceback appended to its message), else as :class:`WorkerError`. Where
that type would not print the string as given (``KeyError`` prints its repr: one line of
literal ``\n``), it is re-raised as a subclass of it that does (still caught as the type).
"""

from __future__ import annotations

import signal

__all__ = [
    "PoolClosed",
    "WorkerDied",
    "WorkerError",
    "WorkerTimeout",
    "error_text",
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


def error_text(error: BaseException) -> str:
    """``str(error)``, or where that raises (an exception's ``__str__`` is the dataset's
    code), a text naming the type: reporting a failure must not fail in turn."""
    try:
        return str(error)
    except Exception as exc:
        return f"<{type(error).__name__}, whose str() raised {type(exc).__name__}>"


def _reraise(exc_type: type[BaseException] | str, text: str, where: str) -> None:
    if isinstance(exc_type, str):
        raise WorkerError(f"{exc_type}: {text}\n\n{where}")
    message = f"{text}\n\n{where}"
    try:
        exc = exc_type(message)
    except Exception:
        raise WorkerError(f"{exc_type.__name__}: {message}") from None
    if exc_type.__module__ == "builtins" and error_text(exc) != message:
        # KeyError prints its argument's repr: one line of escapes. A builtin only: a
        # subclass of a user's type would run its metaclass and __init_subclass__ hooks.
        exc = _readable(exc_type, message, exc)
    raise exc


_READABLE: dict[type[BaseException], type[BaseException]] = {}


def _readable(exc_type: type[BaseException], message: str, exc: BaseException) -> BaseException:
    """``exc_type(message)`` as a subclass of ``exc_type`` whose ``str()`` is ``message``
    (``KeyError``'s is the repr of its argument), which pickles as ``exc_type``; ``exc``
    where no such subclass can be made."""
    sub = _READABLE.get(exc_type)
    if sub is None:
        try:
            sub = type(
                exc_type.__name__,
                (exc_type,),
                {
                    "__module__": exc_type.__module__,
                    "__qualname__": exc_type.__qualname__,
                    "__str__": _message_str,
                    "__reduce__": _reduce_as_base,
                },
            )
        except TypeError:  # a type that cannot be subclassed
            return exc
        _READABLE[exc_type] = sub
    try:
        readable = sub(message)
        readable._meshfeed_message = message  # type: ignore[attr-defined]
    except Exception:
        return exc
    return readable


def _message_str(self: BaseException) -> str:
    return str(getattr(self, "_meshfeed_message", ""))


def _reduce_as_base(self: BaseException) -> tuple[type[BaseException], tuple[object, ...]]:
    return type(self).__mro__[1], self.args
