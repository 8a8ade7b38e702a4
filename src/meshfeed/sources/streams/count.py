"""Counting a stream's rows at start, every shard within a bound.

A :class:`~meshfeed.sources.ShardedStream` without ``rows=`` counts its shards once, in the
process that measures it (the loader's, at construction). A reader that stalls there (a hung
mount, a callable that never returns) used to hang the job with no word (#28), since no worker
and no collective was involved. :func:`count_rows` counts in a helper thread and waits for each
shard at most ``timeout`` seconds, then raises ``TimeoutError`` naming the shard and the fix.

The bound is the loader's ``timeout`` while a loader measures its dataset (it enters
:func:`wait_limit`), else :data:`DEFAULT_TIMEOUT` (the loader's default). A stalled count's
thread cannot be stopped from Python: it is a daemon and is left blocked in the reader.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

from meshfeed.sources.streams.readers import shard_name

__all__ = ["DEFAULT_TIMEOUT", "count_rows", "wait_limit"]

#: The bound on counting one shard outside a loader (seconds): the loader's default timeout.
DEFAULT_TIMEOUT = 300.0
_LIMIT: ContextVar[float] = ContextVar("meshfeed_count_limit", default=DEFAULT_TIMEOUT)


@contextlib.contextmanager
def wait_limit(timeout: float) -> Iterator[None]:
    """Bound the row counts started inside this block by ``timeout`` seconds per shard
    (``math.inf``: no bound)."""
    token = _LIMIT.set(float(timeout))
    try:
        yield
    finally:
        _LIMIT.reset(token)


def count_rows(count: Callable[[Any], int], shards: Sequence[Any]) -> list[int]:
    """``[count(shard) for shard in shards]``, each within the current :func:`wait_limit`.

    Raises ``TimeoutError`` naming the first shard not counted in time; an error of ``count``
    is raised as itself.
    """
    limit = _LIMIT.get()
    results: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    def work() -> None:
        for shard in shards:
            try:
                results.put((True, int(count(shard))))
            except BaseException as exc:  # handed to the waiting thread, raised there
                results.put((False, exc))
                return

    threading.Thread(target=work, name="meshfeed-count-rows", daemon=True).start()
    out: list[int] = []
    for shard in shards:
        try:
            ok, value = results.get(timeout=None if math.isinf(limit) else limit)
        except queue.Empty:
            raise TimeoutError(
                f"counting the rows of shard {shard_name(shard)!r} took more than {limit:g} s "
                "(its reader stalled or is very slow); pass rows= to ShardedStream (or open a "
                "dataset with an index: ShardedStream.from_index), or raise the loader's "
                "timeout="
            ) from None
        if not ok:
            raise value
        out.append(value)
    return out
