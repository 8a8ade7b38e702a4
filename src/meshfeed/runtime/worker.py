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
from meshfeed.runtime.lifeline import Parent, close_borrowed, tie_to_parent
from meshfeed.runtime.transport import SlotWriter

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
    except Exception as exc:
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
        except Exception as exc:
            entries.append((False, _error_entry(exc)))
    try:
        return writer.encode((entries, time.perf_counter() - start))
    except Exception as exc:  # a result that cannot be pickled: every task of it fails
        return pickle.dumps(("error", *_error_entry(exc)), 5)


def _error_entry(exc: BaseException) -> tuple[Any, str, str]:
    tb = traceback.format_exc()
    try:
        exc_type: Any = pickle.loads(pickle.dumps(type(exc)))
    except Exception:  # a local class: only its name can travel
        exc_type = type(exc).__name__
    return exc_type, str(exc), tb
