"""Turning a list of dataset indices into a batch: fetch, survive bad samples, collate.

A :class:`Fetcher` is the only code that runs where the data is (the main process, a worker
process or a Ray actor). The happy path is one call per batch: ``fetch_batch(indices)`` when
the dataset offers it (already collated), else ``__getitems__`` (torch's protocol), else one
``__getitem__`` per index; then collate. Only when that raises does it fall back to fetching
item by item with ``__getitem__`` and the collate function (so ``fetch_batch(idx)`` must equal
collating ``[ds[i] for i in idx]``), so on the happy path a healthy sample is read once.

A bad sample (it raises, or returns None) is retried up to ``max_retries`` times (None is a
deterministic rejection, e.g. a filter, and is not retried), then handled by ``on_error``:
``"raise"``, ``"skip"`` (the batch is one shorter) or ``"substitute"``: index
``derive_seed(seed, epoch, position, attempt) % len(dataset)`` takes its place. The substitute
depends only on the sample's global position, so every rank, worker and resume agrees.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from meshfeed.collate import default_collate
from meshfeed.order.permutation import derive_seed
from meshfeed.rng import FetchInfo, fetching

OnError = Literal["raise", "skip", "substitute"]
_SUBSTITUTE_OP = 0x5B57
_MAX_SUBSTITUTE_ATTEMPTS = 16
MAX_REPORTED_FAILURES = 8


class SampleError(RuntimeError):
    """A sample could not be fetched and the policy says to raise."""


@dataclass(frozen=True, slots=True)
class FetchTask:
    """One batch for one data rank: dataset ``indices`` at epoch ``positions``."""

    epoch: int
    step: int
    indices: np.ndarray
    positions: np.ndarray


@dataclass(slots=True)
class FetchEvents:
    """Counts of what went wrong while making one batch (merged into the loader's stats)."""

    retries: int = 0
    substituted: int = 0
    skipped: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.retries or self.substituted or self.skipped or self.failures)


_MISSING = object()


class Fetcher:
    """Makes batches from a map-style dataset (picklable; sent once to every worker)."""

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        postprocess: Callable[..., Any] | None = None,
        on_error: OnError = "substitute",
        max_retries: int = 0,
    ) -> None:
        if on_error not in ("raise", "skip", "substitute"):
            raise ValueError(f"on_error={on_error!r} is not one of 'raise', 'skip', 'substitute'")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0 (got {max_retries=})")
        self.dataset = dataset
        self.seed = int(seed)
        self.collate_fn = collate_fn
        self.postprocess = postprocess
        self.on_error = on_error
        self.max_retries = max_retries
        self.length = len(dataset)
        self.worker_id = 0
        self.num_workers = 0

    # ------------------------------------------------------------------ public
    def __call__(self, task: FetchTask) -> tuple[Any, FetchEvents]:
        info = FetchInfo(
            seed=self.seed,
            epoch=task.epoch,
            step=task.step,
            worker_id=self.worker_id,
            num_workers=self.num_workers,
        )
        events = FetchEvents()
        with fetching(info):
            try:
                batch = self._fetch_whole(task.indices)
            except _Rejected:
                batch = self._fetch_carefully(task, events)
            except Exception:
                if self.on_error == "raise" and self.max_retries == 0:
                    raise
                batch = self._fetch_carefully(task, events)
            if self.postprocess is not None:
                batch = self.postprocess(batch, step=task.step)
        return batch, events

    # ------------------------------------------------------------------ internals
    def _collate(self, items: list[Any]) -> Any:
        return (self.collate_fn or default_collate)(items)

    def _fetch_whole(self, indices: np.ndarray) -> Any:
        ds = self.dataset
        fetch_batch = getattr(ds, "fetch_batch", None)
        if fetch_batch is not None and self.collate_fn is None:
            return fetch_batch(indices)
        getitems = getattr(ds, "__getitems__", None)
        items = (
            getitems(indices.tolist())
            if getitems is not None
            else [ds[i] for i in indices.tolist()]
        )
        if any(item is None for item in items):
            raise _Rejected()
        return self._collate(items)

    def _try(self, index: int, position: int, events: FetchEvents, attempt: int) -> Any:
        """One sample after up to ``max_retries`` retries, or _MISSING (recorded in events)."""
        error: BaseException | None = None
        item: Any = _MISSING
        for retry in range(self.max_retries + 1):
            if retry:
                events.retries += 1
            try:
                item = self.dataset[index]
            except Exception as exc:  # a bad sample: any exception the dataset raises
                error = exc
                continue
            error = None
            if item is None:
                item = _MISSING  # a deterministic rejection (a filter): retrying cannot help
            break
        if item is _MISSING and len(events.failures) < MAX_REPORTED_FAILURES:
            kind, message = (type(error).__name__, str(error)) if error else ("Rejected", "None")
            events.failures.append(
                {
                    "index": int(index),
                    "position": int(position),
                    "attempt": attempt,
                    "error": kind,
                    "message": message[:200],
                }
            )
        if error is not None and self.on_error == "raise":
            raise SampleError(
                f"sample {index} (epoch position {position}) failed after "
                f"{self.max_retries + 1} attempt(s): {type(error).__name__}: {error}; use "
                "on_error='substitute' or 'skip' to continue past bad samples\n"
                + "".join(traceback.format_exception(error))
            ) from error
        return item

    def _fetch_carefully(self, task: FetchTask, events: FetchEvents) -> Any:
        items: list[Any] = []
        for index, position in zip(task.indices.tolist(), task.positions.tolist(), strict=True):
            item = self._try(index, position, events, attempt=0)
            if item is _MISSING and self.on_error == "raise":
                raise SampleError(
                    f"sample {index} (epoch position {position}) was rejected (returned None); "
                    "use on_error='substitute' or 'skip' to replace or drop rejected samples"
                )
            attempt = 0
            while item is _MISSING and self.on_error == "substitute":
                attempt += 1
                if attempt > _MAX_SUBSTITUTE_ATTEMPTS:
                    raise SampleError(
                        f"sample {index} (epoch position {position}) and "
                        f"{_MAX_SUBSTITUTE_ATTEMPTS} substitutes all failed; the dataset is "
                        f"broken, not a few samples (first failures: {events.failures})"
                    )
                sub = (
                    derive_seed(_SUBSTITUTE_OP, self.seed, task.epoch, position, attempt)
                    % self.length
                )
                item = self._try(sub, position, events, attempt)
            if item is _MISSING:
                events.skipped += 1
                continue
            if attempt:
                events.substituted += 1
            items.append(item)
        if not items:
            raise SampleError(
                f"every sample of step {task.step} was skipped (indices {task.indices.tolist()}); "
                "use on_error='substitute' so that batches keep their size"
            )
        return self._collate(items)


class _Rejected(Exception):
    """A sample returned None inside a batched fetch."""
