"""The in-process reading service; the :class:`Service` contract lives in meshfeed.protocols."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from meshfeed.protocols import Fetch, GlobalService, Service
from meshfeed.tasks import FetchEvents, FetchTask

__all__ = ["GlobalService", "InProcessService", "Service"]


class InProcessService:
    """Makes every batch in the calling thread, when it is asked for (no prefetch)."""

    #: The most tasks a ``map`` holds taken and not yet yielded: the one being made.
    in_flight = 1

    def __init__(self) -> None:
        self._fetcher: Fetch | None = None

    def start(self, fetcher: Fetch) -> None:
        self._fetcher = fetcher

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        fetcher = self._fetcher
        if fetcher is None:
            raise RuntimeError("InProcessService.map() before start(); call start(fetcher) first")
        for task in tasks:
            yield fetcher(task)

    def shutdown(self) -> None:
        self._fetcher = None
