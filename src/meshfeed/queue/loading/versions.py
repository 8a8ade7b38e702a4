"""A :class:`~meshfeed.queue.StoreLoader`'s policy version: what it passes to the store.

The store applies staleness (:mod:`meshfeed.queue.engine.versions`); the loader only carries the
trainer's current ``version`` (``loader.set_version(step)``, starting at 0) and its
``max_staleness`` into every request, and reports them with the store's counts in
``stats()``. The bound holds when a batch is requested: with ``prefetch=k`` a batch may be
requested up to ``k - 1`` steps before it is returned, so a loader that prefetches and bumps
its version every step trains on samples up to ``max_staleness + k - 1`` versions old; use
``prefetch=1`` for the exact bound at training time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshfeed.queue.engine.versions import check_version

__all__ = ["LoaderVersion", "check_store", "one_epoch"]


class LoaderVersion:
    """The trainer's version and the staleness it accepts (``None``: unversioned loader)."""

    __slots__ = ("max_staleness", "version")

    def __init__(self, max_staleness: Any) -> None:
        self.max_staleness = check_version(max_staleness, "max_staleness")
        self.version: int | None = None if self.max_staleness is None else 0

    def set(self, version: Any) -> None:
        """The trainer's weights are now at ``version`` (never lower than before)."""
        if version is None or check_version(version) is None:
            raise ValueError("set_version takes the trainer's policy version, an int >= 0")
        if self.version is not None and version < self.version:
            raise ValueError(
                f"set_version({version}) after set_version({self.version}): a trainer's "
                "version never goes backwards (pass the current optimizer step)"
            )
        self.version = version

    @staticmethod
    def check_restore(version: Any) -> int | None:
        """The version a loader state names (``None``: a state without one), refused by name
        before anything changes."""
        return check_version(version, "the state's policy_version")

    def restore(self, version: Any) -> None:
        """Take the version a loader state names (``None``: a state without one; checked
        first, so a refused one leaves this version as it was)."""
        version = self.check_restore(version)
        if version is not None:
            self.version = version  # a resumed loader may be at any version the state names

    def request(self) -> dict[str, int | None]:
        """The keywords of the next ``SampleStore.get``."""
        return {"version": self.version, "max_staleness": self.max_staleness}

    def stats(self, store: Mapping[str, Any], task: str, partition: str) -> dict[str, Any]:
        """What ``StoreLoader.stats()["versions"]`` says."""
        part = store["partitions"].get(partition, {})
        return {
            "version": self.version,
            "max_staleness": self.max_staleness,
            "stale": store.get("stale", {}).get(task, 0),
            "filtered": store.get("filtered", {}).get(task, 0),
            "held_versions": part.get("held_versions", {}),
        }


def check_store(store: Any) -> None:
    from meshfeed.queue.store import SampleStore

    if not isinstance(store, SampleStore):
        raise TypeError(
            f"store must be a SampleStore (got {type(store).__name__}); build the store "
            "with meshfeed.queue.SampleStore and pass it first"
        )


def one_epoch(got: str, use: str) -> str:
    return (
        f"a StoreLoader reads one stream, which is one epoch (got {got}); {use}, and for "
        "another pass put the samples to a new partition and build a new StoreLoader (or "
        "reset_consumption() on the store)"
    )
