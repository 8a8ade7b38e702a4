"""Backend: what :class:`SampleStore` needs from where the store lives.

Two implementations: :class:`~meshfeed.queue.backends.embedded.EmbeddedBackend` (this process, one
lock) and :class:`~meshfeed.queue.backends.ray.RayBackend` (a Ray actor; the client side is
picklable). Both wrap one :class:`~meshfeed.queue.engine.core.StoreCore`; arguments arrive validated
(``SampleStore`` checks them once), so a backend only moves them and waits.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Protocol

from meshfeed.queue.engine.core import Taken
from meshfeed.queue.request import GetRequest, PutRequest

__all__ = ["Backend", "Got", "Peeked", "try_get"]

Key = Hashable
#: A get's result: the ids, one column per field (as the core gathered them), the lease the
#: batch is handed out under (``None``: consumed at once), and the parts of the shared plan
#: the batch is one part of (``None`` without a shared plan; see ``StoreCore.try_get``).
#: The last item: the samples' policy versions (``None`` in a partition without versions).
Got = tuple[list[Key], dict[str, Any], str | None, list[list[Key]] | None, list[int | None] | None]


#: A peek's result: the ids, their columns, their policy versions (``None``: no versions).
Peeked = tuple[list[Key], dict[str, Any], list[int | None] | None]


def try_get(backend: Any, request: GetRequest, alive: Any = None) -> Taken | None:
    """One attempt of a get on ``backend.core`` (``alive``: the caller's liveness probe); one
    that waits after dropping samples (stale or filtered) freed room: producers are woken."""
    core = backend.core
    taken, dropped = core.taken, core.dropped
    got = core.try_get(request, alive=alive)
    if got is None and (core.taken != taken or core.dropped != dropped):
        backend.waiters.wake_producers()
    return got


class Backend(Protocol):
    """The store's operations; blocking ones wait without polling and honour ``timeout``."""

    @property
    def name(self) -> str | None:
        """The Ray actor's registered name, else ``None``."""
        ...

    def put(self, request: PutRequest) -> list[Key]: ...

    def get(self, request: GetRequest) -> Got: ...

    def ack(self, lease_id: str) -> None: ...

    def drop_consumer(self, consumer: Hashable) -> int: ...

    def new_token(self) -> Hashable: ...

    def cancel(self, token: Hashable) -> None: ...

    def release(self, partition: str, ids: list[Key]) -> None: ...

    def peek(self, partition: str, ids: list[Key], fields: tuple[str, ...]) -> Peeked: ...

    def reset_consumption(self, partition: str, task: str) -> None: ...

    def replan(
        self, partition: str, task: str, start: int, sampler: Any, parts: int, unit: int
    ) -> None: ...

    def passed(self, partition: str, task: str, sampler: Any, upto: int) -> None: ...

    def clear(self, partition: str) -> None: ...

    def delete(self, partition: str, ids: list[Key]) -> None: ...

    def close(self, partition: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def dump(self, with_payload: bool) -> tuple[dict[str, Any], list[list[dict]]]: ...

    def restore(self, meta: Mapping[str, Any], payload: list[list[dict]] | None) -> None: ...

    def shutdown(self) -> None: ...
