"""Leases: samples a ``get`` handed out stay owed until the consumer acknowledges them.

With ``lease_timeout`` set (a :class:`~meshfeed.queue.engine.records.StoreOptions` option), each plain
``get`` (not a shared plan of a rank-aware sampler: those are re-readable by batch index
already) records a :class:`Lease` of the samples it returned. The samples count as consumed
from the start (``stats()["consumed"]`` is exact for consumers that live) but the store keeps
them, against capacity, until the lease ends:

- **acknowledged**: ``store.ack(batch)`` / ``store.ack(lease_id)``, or implicitly by the next
  ``get`` of the same ``consumer=`` id for the same task and partition (a consumer with one
  batch in flight per task; a loader that prefetches acknowledges explicitly): the samples are
  consumed for good;
- **expired** (``lease_timeout`` seconds after the hand-out) or **dropped** (the consumer is
  known dead: ``store.drop_consumer(c)``, or the Ray actor found the caller's process gone):
  the samples return to ready for the task, in production order, and are delivered again,
  counted in ``stats()["lease_expired"]``.

So delivery is exactly-once for consumers that acknowledge in time and at-least-once for those
that die. This module is the bookkeeping only (no clock of its own: the caller passes ``now``).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Lease", "Leases"]

Key = Hashable


@dataclass(eq=False, slots=True)
class Lease:
    """Samples ``ids`` of ``partition`` handed to ``consumer`` for ``task`` until ``deadline``
    (a ``time.monotonic()`` of the process holding the store); ``id``: the lease's id.
    ``alive``: an optional probe of the consumer's process (the Ray backend keeps an object
    the caller owns)."""

    id: str
    partition: str
    task: str
    ids: list[Key]
    consumer: Hashable | None
    deadline: float
    alive: Any = None


class Leases:
    """The outstanding leases of one store, by id, by consumer and by deadline."""

    def __init__(self) -> None:
        self.by_id: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, str]] = []  # a heap; ended leases are skipped lazily

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self.by_id

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self.by_id.values()))

    def add(self, lease: Lease) -> None:
        if lease.id in self.by_id:
            raise ValueError(
                f"lease id {lease.id!r} is already outstanding; lease ids are unique per get"
            )
        self.by_id[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))

    def pop(self, lease_id: str) -> Lease | None:
        return self.by_id.pop(lease_id, None)

    def of_consumer(
        self, consumer: Hashable, task: str | None = None, partition: str | None = None
    ) -> list[Lease]:
        return [
            lease
            for lease in self.by_id.values()
            if lease.consumer == consumer
            and (task is None or lease.task == task)
            and (partition is None or lease.partition == partition)
        ]

    def expired(self, now: float) -> list[Lease]:
        """Remove and return the leases whose deadline passed."""
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self.by_id.pop(lease_id, None)
            if lease is not None:
                out.append(lease)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of an outstanding lease (``None``: no lease)."""
        heap = self._deadlines
        while heap and heap[0][1] not in self.by_id:
            heapq.heappop(heap)
        return heap[0][0] if heap else None
