"""The contract of a reading service: where batches are made."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from meshfeed.fetch import Fetcher, FetchEvents, FetchTask


@runtime_checkable
class Service(Protocol):
    """Runs a :class:`Fetcher` on a stream of tasks and yields results in task order.

    ``map`` may run ahead (prefetch) but must yield exactly one result per task, in order;
    a new ``map`` call discards whatever an abandoned earlier one left in flight.
    ``shutdown`` is idempotent.
    """

    def start(self, fetcher: Fetcher) -> None: ...

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]: ...

    def shutdown(self) -> None: ...


class InProcessService:
    """Makes every batch in the calling thread, when it is asked for (no prefetch)."""

    def __init__(self) -> None:
        self._fetcher: Fetcher | None = None

    def start(self, fetcher: Fetcher) -> None:
        self._fetcher = fetcher

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        fetcher = self._fetcher
        if fetcher is None:
            raise RuntimeError("InProcessService.map() before start(); call start(fetcher) first")
        for task in tasks:
            yield fetcher(task)

    def shutdown(self) -> None:
        self._fetcher = None
