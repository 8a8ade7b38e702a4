"""What travels between the loader, its services and the fetcher: one batch's task and what
went wrong making it. Plain data, picklable to worker processes and Ray actors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FetchEvents", "FetchTask"]


@dataclass(frozen=True, slots=True)
class FetchTask:
    """One batch for one data rank: dataset ``indices`` at epoch ``positions``."""

    epoch: int
    step: int
    indices: np.ndarray
    positions: np.ndarray

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Sent to a worker for every batch: raw int64 bytes pickle several times faster than
        # two numpy arrays.
        return _task, (
            self.epoch,
            self.step,
            np.ascontiguousarray(self.indices, dtype=np.int64).tobytes(),
            np.ascontiguousarray(self.positions, dtype=np.int64).tobytes(),
        )


def _task(epoch: int, step: int, indices: bytes, positions: bytes) -> FetchTask:
    return FetchTask(
        epoch,
        step,
        np.frombuffer(indices, dtype=np.int64),
        np.frombuffer(positions, dtype=np.int64),
    )


@dataclass(slots=True)
class FetchEvents:
    """Counts of what went wrong while making one batch (merged into the loader's stats)."""

    retries: int = 0
    substituted: int = 0
    skipped: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.retries or self.substituted or self.skipped or self.failures)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Sent back with every batch a worker makes, nearly always empty: a plain reduce
        # pickles and unpickles in about two thirds of the dataclass's default time.
        if not self:
            return FetchEvents, ()
        return FetchEvents, (self.retries, self.substituted, self.skipped, self.failures)
