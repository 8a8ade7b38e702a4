"""The distributed reading service: ranks agree on the plan before the first batch.

The agreement check itself is :func:`meshfeed.dist.check_agreement` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from meshfeed.dist import DEFAULT_TIMEOUT, check_agreement
from meshfeed.protocols import Fetch
from meshfeed.services.base import Service
from meshfeed.tasks import FetchEvents, FetchTask

__all__ = ["DistributedService", "check_agreement"]


class DistributedService:
    """Wraps another service; checks once that all ranks agree, then delegates.

    The agreement waits at most ``timeout`` seconds for the other ranks (the loader passes its
    own ``timeout``): a rank that never reaches its first batch is an error, not a hang.
    """

    def __init__(
        self,
        inner: Service,
        *,
        agreement: Mapping[str, int],
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.inner = inner
        self.agreement = dict(agreement)
        self.group = group
        self.timeout = timeout
        self._checked = False

    def start(self, fetcher: Fetch) -> None:
        if not self._checked:
            check_agreement(self.agreement, self.timeout, group=self.group)
            self._checked = True
        self.inner.start(fetcher)

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        return self.inner.map(tasks)

    def shutdown(self) -> None:
        self.inner.shutdown()
