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
    # Over a bytearray (a copy: a few hundred int64s): writable arrays, as in-process, where a
    # fetch_batch gets an ordinary array; over the bytes themselves they would be read-only.
    return FetchTask(
        epoch,
        step,
        np.frombuffer(bytearray(indices), dtype=np.int64),
        np.frombuffer(bytearray(positions), dtype=np.int64),
    )


@dataclass(slots=True)
class FetchEvents:
    """Counts of what went wrong while making one batch (merged into the loader's stats),
    and the seconds the fetcher spent reading (``fetch_s``) and collating (``collate_s``) it
    (the ``fetch`` and ``collate`` phases of ``stats()["delivery"]``). True when something
    went wrong."""

    retries: int = 0
    substituted: int = 0
    skipped: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    fetch_s: float = 0.0
    collate_s: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.retries or self.substituted or self.skipped or self.failures)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Sent back with every batch a worker makes, nearly always with nothing wrong: a plain
        # reduce pickles and unpickles in about two thirds of the dataclass's default time.
        if not self:
            return _timed, (self.fetch_s, self.collate_s)
        counts = (self.retries, self.substituted, self.skipped, self.failures)
        return FetchEvents, (*counts, self.fetch_s, self.collate_s)


def _timed(fetch_s: float, collate_s: float) -> FetchEvents:
    return FetchEvents(fetch_s=fetch_s, collate_s=collate_s)
