"""The embedded backend: one :class:`StoreCore` in this process behind a ``threading.Condition``.

Every state change (put, get, close, delete, clear, reset) notifies all waiters; a waiter
re-tries its operation and otherwise waits again, up to its deadline. There is no polling: a
blocked ``get`` costs nothing until something changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

from meshfeed.queue import checkpoint
from meshfeed.queue.core import StoreCore, StoreOptions
from meshfeed.queue.samplers import Sampler

T = TypeVar("T")
Key = Hashable


def wait_for(
    cond: threading.Condition,
    attempt: Callable[[], T | None],
    timeout: float | None,
    what: str,
    on_wait: Callable[[int], None],
) -> T:
    """Call ``attempt`` (under ``cond``) until it returns non-None; ``TimeoutError`` after
    ``timeout`` seconds. ``on_wait(+1/-1)`` brackets the time spent waiting."""
    deadline = None if timeout is None else time.monotonic() + timeout
    result = attempt()
    if result is not None:
        return result
    on_wait(1)
    try:
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"{what} timed out after {timeout}s; the store is unchanged and usable "
                    "(retry, raise the timeout, or check that producers are running)"
                )
            cond.wait(remaining)
            result = attempt()
            if result is not None:
                return result
    finally:
        on_wait(-1)


class EmbeddedBackend:
    """In-process, thread-safe; the default backend."""

    def __init__(self, options: StoreOptions, core: StoreCore | None = None) -> None:
        self.core = core if core is not None else StoreCore(options)
        self.cond = threading.Condition()

    def __getstate__(self) -> Any:
        raise TypeError(
            "an embedded SampleStore lives in one process and cannot be pickled; use "
            "SampleStore(backend='ray') to share a store with other processes"
        )

    def _consumers(self, d: int) -> None:
        self.core.waiting_consumers += d

    def _producers(self, d: int) -> None:
        self.core.waiting_producers += d

    def put(
        self,
        partition: str,
        rows: Mapping[str, list[Any]],
        ids: list[Key] | None,
        groups: list[Hashable] | None,
        timeout: float | None,
    ) -> list[Key]:
        with self.cond:
            out = self.core.try_put(partition, rows, ids, groups)  # fast path: no closure
            if out is None:
                out = wait_for(
                    self.cond,
                    lambda: self.core.try_put(partition, rows, ids, groups),
                    timeout,
                    f"put to {partition!r} (store at capacity {self.core.options.capacity})",
                    self._producers,
                )
            self.cond.notify_all()
            return out

    def get(
        self,
        task: str,
        fields: tuple[str, ...],
        batch_size: int,
        partition: str,
        sampler: Sampler,
        timeout: float | None,
        context: Mapping[str, Any],
        hold: bool = False,
    ) -> tuple[list[Key], dict[str, list[Any]]]:
        with self.cond:
            try:
                return wait_for(
                    self.cond,
                    lambda: self.core.try_get(
                        task, fields, batch_size, partition, sampler, context, hold
                    ),
                    timeout,
                    f"get of {batch_size} samples with {list(fields)} for task {task!r} "
                    f"from {partition!r}",
                    self._consumers,
                )
            finally:
                # Consumption frees capacity and cache entries; producers may be waiting.
                self.cond.notify_all()

    def _admin(self, fn: Callable[[], T]) -> T:
        with self.cond:
            try:
                return fn()
            finally:
                self.cond.notify_all()

    def reset_consumption(self, partition: str, task: str) -> None:
        self._admin(lambda: self.core.reset_consumption(partition, task))

    def release(self, partition: str, ids: list[Key]) -> None:
        self._admin(lambda: self.core.release(partition, ids))

    def peek(
        self, partition: str, ids: list[Key], fields: tuple[str, ...]
    ) -> tuple[list[Key], dict[str, list[Any]]]:
        with self.cond:
            return self.core.peek(partition, ids, fields)

    def clear(self, partition: str) -> None:
        self._admin(lambda: self.core.clear(partition))

    def delete(self, partition: str, ids: list[Key]) -> None:
        self._admin(lambda: self.core.delete(partition, ids))

    def close(self, partition: str) -> None:
        self._admin(lambda: self.core.close(partition))

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return self.core.stats()

    def dump(self, with_payload: bool) -> tuple[dict[str, Any], list[list[dict]]]:
        with self.cond:
            return checkpoint.dump(self.core, with_payload=with_payload)

    def restore(self, meta: Mapping[str, Any], payload: list[list[dict]] | None) -> None:
        def swap() -> None:
            old = self.core
            self.core = checkpoint.restore(meta, payload, current=old, options=old.options)
            # Threads blocked in put/get keep waiting on the restored state.
            self.core.waiting_consumers = old.waiting_consumers
            self.core.waiting_producers = old.waiting_producers

        self._admin(swap)

    def shutdown(self) -> None:
        pass
