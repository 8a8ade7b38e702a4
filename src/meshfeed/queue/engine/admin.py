"""The store's admin operations and statistics: the part of :class:`StoreCore` that never
plans or consumes a batch (replan, reset, clear, delete, close, ``stats``).

A mixin of :class:`~meshfeed.queue.engine.core.StoreCore` (it reads and changes the core's records
through the same private helpers), kept apart so the core's module holds the data path.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from meshfeed.queue.engine.eviction import remove
from meshfeed.queue.engine.leases import Leases
from meshfeed.queue.engine.plans import drop, passed, replan
from meshfeed.queue.engine.records import Partition

if TYPE_CHECKING:
    from meshfeed.queue.engine.wakeups import Waiters

__all__ = ["StoreAdmin"]

Key = Hashable


class StoreAdmin:
    """Admin calls of the core; see the module docstring. The core sets these attributes
    and implements the helpers below."""

    partitions: dict[str, Partition]
    held: int
    produced: int
    consumed_total: dict[str, int]
    redelivered: int
    lease_expired: int
    leases: Leases

    if TYPE_CHECKING:  # StoreCore's

        def _partition(self, name: str) -> Partition: ...
        def _evict(self, part: Partition, keys: list[Key]) -> None: ...
        def _dropped(self, n: int, part: Partition | None = None) -> None: ...
        def expire_leases(self, now: float) -> int: ...

    def replan(
        self, partition: str, task: str, start: int, sampler: Any, parts: int, unit: int
    ) -> None:
        """Move ``task``'s plans to a new data-parallel layout from batch ``start`` on
        (:func:`~meshfeed.queue.engine.plans.replan`)."""
        part = self.partitions.get(partition)
        if part is not None:
            self._evict(part, replan(part, task, start, sampler, parts, unit))

    def passed(self, partition: str, task: str, sampler: Any, upto: int) -> None:
        """``sampler``'s reader returned every batch of ``task`` below ``upto``."""
        part = self.partitions.get(partition)
        share = sampler.share({"batch_index": upto})
        if part is not None and share is not None:
            self._evict(part, passed(part, task, share))

    def reset_consumption(self, partition: str, task: str) -> None:
        part = self._partition(partition)
        self._evict(part, drop(part, [c for c in part.cache if c[0] == task]))
        for prefix in [a for a in part.asked if a[0] == task]:
            del part.asked[prefix]
            part.progress.pop(prefix, None)
        part.pending[task] = dict.fromkeys(part.samples)
        part.consumed[task] = set()

    def clear(self, partition: str) -> None:
        part = self.partitions.pop(partition, None)
        if part is not None:
            self._dropped(len(part.samples))
        for lease in self.leases:  # their samples are gone with the partition
            if lease.partition == partition:
                self.leases.pop(lease.id)

    def delete(self, partition: str, ids: list[Key]) -> None:
        part = self._partition(partition)
        missing = [k for k in ids if k not in part.samples]
        if missing:
            raise ValueError(
                f"partition {partition!r} holds no samples {missing[:10]}; delete ids that "
                "exist (a sample dropped after all tasks consumed it is already gone)"
            )
        self._dropped(remove(part, list(dict.fromkeys(ids))), part)

    def close(self, partition: str) -> None:
        part = self._partition(partition)
        part.closed = True
        if not part.samples:  # drained before it was closed: free its emptied tables
            part.shrink()

    def stats(self, waiters: Waiters | None = None) -> dict[str, Any]:
        """The store's counts (``SampleStore.stats``); ``waiters``: the backend's blocked calls."""
        if self.leases:
            self.expire_leases(time.monotonic())
        parts = {}
        held_bytes = remote = 0
        counts: dict[str, dict[str, int]] = {"stale": {}, "filtered": {}}
        for name, part in self.partitions.items():
            held_bytes += sum(s.nbytes for s in part.samples.values())
            remote += sum(s.remote for s in part.samples.values())
            parts[name] = part.stats()
            if part.book is not None:
                parts[name].update(part.book.stats())
                for key, total in counts.items():
                    for task, n in parts[name][key].items():
                        total[task] = total.get(task, 0) + n
        return {
            "produced": self.produced,
            "held": self.held,
            "consumed": dict(self.consumed_total),
            "waiting_consumers": 0 if waiters is None else waiters.count("consumer"),
            "waiting_producers": 0 if waiters is None else waiters.count("producer"),
            "bytes_held": held_bytes,
            "bytes_in_object_store": remote,
            "cache_entries": sum(p["cache_entries"] for p in parts.values()),
            "redelivered": self.redelivered,
            "lease_expired": self.lease_expired,
            "leases": len(self.leases),
            "stale": counts["stale"],
            "filtered": counts["filtered"],
            "partitions": parts,
        }
