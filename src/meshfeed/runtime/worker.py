"""The worker's side of a :class:`~meshfeed.runtime.pool.WorkerPool`: the process's main
loop, which runs ``init`` once and then the handler on every task sent to it, and the error
entries that carry a failed task (or a failed ``init``) back to the main process.
"""

from __future__ import annotations

import pickle
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from meshfeed.collate import stack_into
from meshfeed.runtime.failures import error_text
from meshfeed.runtime.lifeline import Parent, close_borrowed, tie_to_parent
from meshfeed.runtime.transport import OffHostTensorError, SlotWriter

__all__: list[str] = []


def _worker_main(
    worker: int,
    num_workers: int,
    init: Callable[..., Callable[[Any], Any]],
    args: tuple[Any, ...],
    tasks: Connection,
    results: Connection,
    parent: Parent,
    borrowed: tuple[Connection, ...],
) -> None:
    # Die with the parent, however it dies (see meshfeed.runtime.lifeline).
    tie_to_parent(parent)
    close_borrowed(borrowed)
    # One thread per worker: the workers are the parallelism, and an OpenMP pool inherited
    # through fork deadlocks on its first parallel region.
    torch.set_num_threads(1)
    # Ctrl-C reaches the whole process group: the main process handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_error: tuple[Any, str, str] | None = None
    handler: Callable[[Any], Any] | None = None
    try:
        handler = init(worker, num_workers, *args)
    except BaseException as exc:  # reported, as a handler's (see _run_tasks)
        init_error = _error_entry(exc)
    writer = SlotWriter()
    stack_into(writer.take)  # the default collation stacks into the reply's slot
    try:
        while True:
            try:
                message = pickle.loads(tasks.recv_bytes())
            except (EOFError, OSError, KeyboardInterrupt):
                return
            if message is None:
                return
            todo, frees, added = message
            writer.update(frees, added)
            if handler is None:  # every task fails with the error of init
                results.send_bytes(writer.encode(([(False, init_error)] * len(todo), 0.0)))
                continue
            results.send_bytes(_run_tasks(handler, todo, writer))
    finally:
        writer.close()


def _run_tasks(handler: Callable[[Any], Any], tasks: list[Any], writer: SlotWriter) -> bytes:
    """One reply for a message of ``tasks``: per task ``(True, result)`` or ``(False, error)``
    (a task that raises does not stop the rest), and the seconds they took together; the
    results' buffers share one slot."""
    start = time.perf_counter()
    writer.open()
    entries: list[tuple[bool, Any]] = []
    for task in tasks:
        try:
            entries.append((True, handler(task)))
        except BaseException as exc:
            # KeyboardInterrupt, SystemExit, GeneratorExit raised by the task's code too: the
            # worker ignores SIGINT (a Ctrl-C stops the main process, which stops us), so one
            # of them here came from that code; exiting on it would hide it behind an exit code.
            entries.append((False, _error_entry(exc)))
    try:
        return writer.encode((entries, time.perf_counter() - start))
    except OffHostTensorError as exc:  # a CUDA tensor: the error says why and what to do
        return pickle.dumps(("error", ValueError, str(exc), traceback.format_exc()), 5)
    except Exception as exc:  # a result that cannot be pickled: every task of it fails
        exc_type, text, tb = _error_entry(exc)
        text = (
            f"{text}: a result of this worker (in a loader, a batch: what collate_fn "
            "returned, or the samples themselves) cannot be pickled to be sent to the main "
            "process; return tensors, numpy arrays and plain Python values (no locks, "
            "generators, open files or handles), or make the batches in the main process "
            "(num_workers=0)"
        )
        return pickle.dumps(("error", exc_type, text, tb), 5)


def _error_entry(exc: BaseException) -> tuple[Any, str, str]:
    """What travels of ``exc``: its type (the name alone for a local class, and for a
    ``BaseException`` that is no ``Exception``, re-raised as a WorkerError rather than as a
    Ctrl-C or an exit of the main process), its text and the worker's traceback."""
    tb = traceback.format_exc()
    text = error_text(exc)
    if not isinstance(exc, Exception):
        why = (
            "workers ignore SIGINT (a Ctrl-C stops the main process, which stops them), so "
            "the task's code raised it"
            if isinstance(exc, KeyboardInterrupt)
            else "raised by the task's code"
        )
        said = f"{text} " if text else ""
        return type(exc).__name__, f"{said}({why}; the worker reported it instead of exiting)", tb
    try:
        return pickle.loads(pickle.dumps(type(exc))), text, tb
    except Exception:  # a local class: only its name can travel
        return type(exc).__name__, text, tb
