"""Turning a list of dataset indices into a batch: fetch, survive bad samples, collate.

A :class:`Fetcher` is the only code that runs where the data is (the main process, a worker
process or a Ray actor). The happy path is one call per batch: ``fetch_batch(indices)`` when
the dataset offers it (already collated), else ``__getitems__`` (torch's protocol), else one
``__getitem__`` per index; then collate.

Each sample is read once. ``__getitems__`` may report a bad item in place, without failing the
batch: ``None`` is a rejection (e.g. a filter) and a :class:`Failed` wrapping the exception is
a failure; only those items are re-read (failures only: with ``__getitem__``, up to
``max_retries`` times) or replaced, the healthy items of the batch are kept. Only when the
whole batch call raises does the fetcher fall back to reading item by item with
``__getitem__`` (so ``fetch_batch(idx)`` must equal collating ``[ds[i] for i in idx]``), which
reads the items before the failure a second time; datasets that can fail per item should
report in place instead. A ``fetch_batch`` that raised when every sample then read fine is
logged once per fetcher (a bug in it would send every batch down that slow path); one that
returns None, or a batch (or a mapping's value) whose leading dimension is not the number of
indices, is refused by name.

A bad sample (it raises, or returns None) is retried up to ``max_retries`` times (None is a
deterministic rejection and is not retried), then handled by ``on_error``: ``"raise"`` (a
:class:`SampleError` naming the index and position), ``"skip"`` (the batch is one shorter) or
``"substitute"``: index ``derive_seed(op, seed, epoch, position, attempt) % len(dataset)``
takes its place, or, for a dataset that groups its indices (a
:class:`~meshfeed.sources.Mixture`, also under a :class:`~meshfeed.sources.LazyDataset`:
``substitute_span(index)``), that draw in the span of the bad sample's group, so a mixture's
weights hold through substitutes and filters (after 16 such substitutes failed too, a source
damaged throughout, any index). The substitute depends only on the sample's
index and global position, so every rank, worker and resume agrees. It is not gated by a
curriculum (the worker does not hold the eligible pool).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from meshfeed.collate import collate_into_slot
from meshfeed.errors import NEVER_SUBSTITUTED
from meshfeed.options import OnError, check_max_retries
from meshfeed.order.permutation import derive_seed
from meshfeed.protocols import BatchSource, ItemsSource, PostProcess
from meshfeed.rng import fetching
from meshfeed.runtime.failures import error_text
from meshfeed.tasks import FetchEvents, FetchTask

logger = logging.getLogger("meshfeed")

_SUBSTITUTE_OP = 0x5B57
# A filter that rejects a fraction f of the items fails all k substitutes with probability f**k
# per rejected sample: at k=16 and f=0.5 that is one crash per ~130k samples; at 64, never.
_MAX_SUBSTITUTE_ATTEMPTS = 64
#: Substitutes drawn from the bad sample's group (a mixture's source) before any index: a source
#: whose samples all fail (a damaged or tiny one) still lets the run go on, as before groups.
_IN_SPAN_ATTEMPTS = 16
MAX_REPORTED_FAILURES = 8
_ARRAYS = (torch.Tensor, np.ndarray)


class SampleError(RuntimeError):
    """A sample could not be fetched and the policy says to raise."""


_MISSING = object()  # a sample that is rejected or failed for good
_UNREAD = object()  # a sample the batch call did not deliver: read it with __getitem__


@dataclass(frozen=True, slots=True)
class Failed:
    """What ``__getitems__`` puts in place of an item that raised, to keep the rest of the batch.

    The fetcher treats it exactly like ``__getitem__`` raising ``error`` (retry, then policy),
    without re-reading the healthy items of the batch.
    """

    error: BaseException


class Fetcher:
    """Makes batches from a map-style dataset (picklable; sent once to every worker)."""

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        postprocess: PostProcess | None = None,
        on_error: OnError = "substitute",
        max_retries: int = 0,
    ) -> None:
        if on_error not in ("raise", "skip", "substitute"):
            raise ValueError(f"on_error={on_error!r} is not one of 'raise', 'skip', 'substitute'")
        check_max_retries(max_retries)
        self.dataset = dataset
        self.seed = int(seed)
        self.collate_fn = collate_fn
        self.postprocess = postprocess
        self.on_error = on_error
        self.max_retries = max_retries
        self.length = len(dataset)
        span = getattr(dataset, "substitute_span", None)
        self._span: Callable[[int], tuple[int, int]] | None = span if callable(span) else None
        # Decided once: the per-batch path does no attribute probing.
        self.mode: Literal["fetch_batch", "getitems", "getitem"] = (
            "fetch_batch"
            if collate_fn is None and isinstance(dataset, BatchSource)
            else "getitems"
            if isinstance(dataset, ItemsSource)
            else "getitem"
        )
        self.worker_id = 0
        self.num_workers = 0
        self._warned_fallback = False  # a fetch_batch that raised on healthy samples, logged

    # ------------------------------------------------------------------ public
    def __call__(self, task: FetchTask) -> tuple[Any, FetchEvents]:
        # fetch_info()'s fields: made into a FetchInfo only where the dataset asks for it
        info = (self.seed, task.epoch, task.step, self.worker_id, self.num_workers)
        events = FetchEvents()
        start = time.perf_counter()
        with fetching(info):
            batch = self._fetch(task, events)
            if self.postprocess is not None:
                batch = self.postprocess(batch, epoch=task.epoch, step=task.step)
        # Reading and transforming the samples; a fetch_batch dataset collates as it reads.
        events.fetch_s = time.perf_counter() - start - events.collate_s
        return batch, events

    # ------------------------------------------------------------------ internals
    def _collate(self, items: list[Any], events: FetchEvents) -> Any:
        start = time.perf_counter()
        batch = collate_into_slot(items) if self.collate_fn is None else self.collate_fn(items)
        events.collate_s += time.perf_counter() - start
        return batch

    def _fetch(self, task: FetchTask, events: FetchEvents) -> Any:
        """The collated batch of ``task``, read the way the dataset supports best; any bad
        sample sends the batch through :meth:`_repair`."""
        if self.mode == "fetch_batch":
            return self._fetch_batch(task, events)
        if self.mode == "getitem":
            return self._fetch_getitem(task, events)
        return self._fetch_getitems(task, events)

    def _fetch_batch(self, task: FetchTask, events: FetchEvents) -> Any:
        """One ``fetch_batch`` call; if it raises, every sample is read again one by one.

        ``fetch_batch`` gets an array of its own (a copy: a few hundred int64s), writable in
        every process: editing it in place changes neither the loader's indices nor those the
        one-by-one reading uses."""
        try:
            batch = self.dataset.fetch_batch(task.indices.copy())
        except NEVER_SUBSTITUTED:
            raise
        except Exception as exc:
            batch = self._repair(task, [_UNREAD] * len(task.indices), events)
            if not events and not self._warned_fallback:  # every sample read fine
                self._warned_fallback = True
                logger.warning(
                    "%s.fetch_batch raised %s: %s; the batch's %d samples were then read one by "
                    "one through __getitem__, and all of them read fine. A bug in fetch_batch "
                    "makes every batch take this slow path (this warning is logged once per "
                    "fetcher: the loader's, or each worker process's)",
                    type(self.dataset).__name__,
                    type(exc).__name__,
                    error_text(exc),
                    len(task.indices),
                    exc_info=exc,
                )
            return batch
        # One row per index, checked where it is cheap to see (once per batch, not per
        # sample): the leading dimension of a tensor or array; of a mapping, at least one value
        # with a row per index where it has sized values (a varlen layout, such as
        # TokenDocuments' tokens [sum of lengths] + lengths [B] + cu_seqlens [B + 1], carries
        # the rest in other shapes). Exact types first: isinstance against torch.Tensor costs
        # more than the check. A list value counts only where it holds one leaf per row
        # (collating sequences gives a list of fields, one per position, not one per row).
        n = len(task.indices)
        kind = type(batch)
        values: Any = ()
        if kind is dict:
            values = batch.values()
        elif kind is torch.Tensor or kind is np.ndarray or isinstance(batch, _ARRAYS):
            try:
                rows = batch.shape[0]
            except IndexError:  # 0-d
                rows = -1
            if rows != n:
                raise self._rows_error(batch, n)
            return batch
        elif batch is None:
            raise self._rows_error(batch, n)
        elif isinstance(batch, Mapping):
            values = batch.values()
        first = None  # the first sized value, named where none has a row per index
        for value in values:
            kind = type(value)
            if kind is torch.Tensor or kind is np.ndarray:
                if value.ndim == 0:  # a value of the whole batch (e.g. a count)
                    continue
                rows = value.shape[0]
            elif kind is list and value and not isinstance(value[0], (*_ARRAYS, list, tuple)):
                rows = len(value)
            else:
                continue
            if rows == n:
                return batch
            if first is None:
                first = value
        if first is not None:
            key = next(k for k, v in batch.items() if v is first)
            raise self._rows_error(first, n, key)
        return batch

    def _rows_error(self, value: Any, n: int, key: Any = None) -> ValueError:
        """A ``fetch_batch`` result (or its ``key``) without one row per index."""
        name = f"{type(self.dataset).__name__}.fetch_batch"
        if value is None:
            return ValueError(
                f"{name} returned None for {n} indices (a missing return?); return the batch: "
                "what collating [dataset[i] for i in indices] gives"
            )
        shape = (
            f"of shape {tuple(value.shape)}"
            if hasattr(value, "shape")
            else f"as a list of {len(value)} items"
        )
        what = f"{key!r} {shape}" if key is not None else f"a batch {shape}"
        return ValueError(
            f"{name} returned {what} for {n} indices; return one row per index (leading "
            "dimension len(indices)), as collating [dataset[i] for i in indices] gives"
        )

    def _fetch_getitem(self, task: FetchTask, events: FetchEvents) -> Any:
        """``dataset[i]`` for each index, in order, until one raises."""
        indices = task.indices.tolist()
        ds = self.dataset
        items: list[Any] = []
        append = items.append
        try:
            for i in indices:
                append(ds[i])
        except NEVER_SUBSTITUTED:
            raise
        except Exception as exc:
            # Keep what was read; the failed item is attempt one; the rest is still unread.
            rest = [_UNREAD] * (len(indices) - len(items) - 1)
            return self._repair(task, [*items, Failed(exc), *rest], events)
        for item in items:  # a plain loop: cheaper per batch than any() over a generator
            if item is None:
                return self._repair(task, items, events)
        return self._collate(items, events)

    def _fetch_getitems(self, task: FetchTask, events: FetchEvents) -> Any:
        """One ``__getitems__`` call, which may mark single items None or Failed."""
        ds = self.dataset
        indices = task.indices.tolist()
        try:
            items = list(ds.__getitems__(indices))
        except NEVER_SUBSTITUTED:
            raise
        except Exception:
            return self._repair(task, [_UNREAD] * len(indices), events)
        if len(items) != len(indices):
            raise ValueError(
                f"{type(ds).__name__}.__getitems__ returned {len(items)} items for "
                f"{len(indices)} indices; return exactly one item (or None / Failed) per index"
            )
        if any(item is None or isinstance(item, Failed) for item in items):
            for item in items:
                if isinstance(item, Failed) and isinstance(item.error, NEVER_SUBSTITUTED):
                    raise item.error
            return self._repair(task, items, events)
        return self._collate(items, events)

    def _read(self, index: int) -> Any:
        """``dataset[index]``, or :class:`Failed` for any exception a bad sample raises."""
        try:
            return self.dataset[index]
        except NEVER_SUBSTITUTED:
            raise
        except Exception as exc:  # a bad sample: any exception the dataset raises
            return Failed(exc)

    def _try(
        self, index: int, position: int, events: FetchEvents, attempt: int, first: Any = _UNREAD
    ) -> Any:
        """One sample after up to ``max_retries`` retries, or _MISSING (recorded in events).

        ``first`` is the outcome a batch call already delivered (an item, None or Failed);
        it counts as the first attempt, so a healthy item is never read twice.
        """
        error: BaseException | None = None
        item: Any = _MISSING
        for retry in range(self.max_retries + 1):
            if retry:
                events.retries += 1
            outcome = first if retry == 0 and first is not _UNREAD else self._read(index)
            if isinstance(outcome, Failed):
                if isinstance(outcome.error, NEVER_SUBSTITUTED):
                    raise outcome.error
                error = outcome.error
                continue
            error = None
            if outcome is not None:
                item = outcome
            break  # an item, or a deterministic rejection (None) that retrying cannot change
        if item is _MISSING:
            self._missing(index, position, events, attempt, error)
        return item

    def _missing(
        self,
        index: int,
        position: int,
        events: FetchEvents,
        attempt: int,
        error: BaseException | None,
    ) -> None:
        """Record a sample that stayed missing (up to ``MAX_REPORTED_FAILURES``), and raise
        :class:`SampleError` when ``on_error="raise"``; ``error`` None means rejected (None)."""
        text = "None" if error is None else error_text(error)
        if len(events.failures) < MAX_REPORTED_FAILURES:
            kind = "Rejected" if error is None else type(error).__name__
            events.failures.append(
                {
                    "index": int(index),
                    "position": int(position),
                    "attempt": attempt,
                    "error": kind,
                    "message": text[:200],
                }
            )
        if self.on_error != "raise":
            return
        if error is None:
            raise SampleError(
                f"sample {index} (epoch position {position}) was rejected (returned None); "
                "use on_error='substitute' or 'skip' to replace or drop rejected samples"
            )
        raise SampleError(
            f"sample {index} (epoch position {position}) failed after "
            f"{self.max_retries + 1} attempt(s): {type(error).__name__}: {text}; use "
            "on_error='substitute' or 'skip' to continue past bad samples\n"
            + "".join(traceback.format_exception(error))
        ) from error

    def substitute_index(self, epoch: int, position: int, attempt: int, index: int = -1) -> int:
        """The index that replaces sample ``index`` at ``position`` on its ``attempt``-th
        substitution: in its group's span where the dataset has groups, for the first
        attempts (module docstring)."""
        draw = derive_seed(_SUBSTITUTE_OP, self.seed, epoch, position, attempt)
        if self._span is None or index < 0 or attempt > _IN_SPAN_ATTEMPTS:
            return draw % self.length
        lo, n = self._span(index)
        return lo + draw % n

    def _repair(self, task: FetchTask, delivered: list[Any], events: FetchEvents) -> Any:
        items: list[Any] = []
        for index, position, first in zip(
            task.indices.tolist(), task.positions.tolist(), delivered, strict=True
        ):
            item = self._try(index, position, events, 0, first)
            attempt = 0
            while item is _MISSING and self.on_error == "substitute":
                attempt += 1
                if attempt > _MAX_SUBSTITUTE_ATTEMPTS:
                    raise SampleError(
                        f"sample {index} (epoch position {position}) and "
                        f"{_MAX_SUBSTITUTE_ATTEMPTS} substitutes all failed; the dataset is "
                        f"broken, not a few samples (first failures: {events.failures})"
                    )
                sub = self.substitute_index(task.epoch, position, attempt, index)
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
        return self._collate(items, events)
