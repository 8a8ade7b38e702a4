"""Curriculum: metrics + schedules -> a difficulty-gated order and a batch post-processing hook.

``Curriculum(metrics=[CurriculumMetric(index=..., schedule=..., difficulty_type=...)],
transforms=[SeqlenTruncate(schedule=...)])`` is what ``meshfeed.DataLoader(curriculum=...)``
takes. At global step ``t`` a sample is eligible when, for every metric, its value is
``<= schedule.difficulty(t)`` (``"value"``) or it lies within the lowest
``schedule.difficulty(t)`` percent of that metric (``"percentile"``). Several metrics intersect.

Because every schedule is non-decreasing, each sample has an *entry step*, the first step at
which it is eligible under all metrics at once: the maximum over metrics of the per-metric entry
step, each found by one ``searchsorted`` of the sample's value into the schedule's thresholds.
Sorting samples by entry step once (O(N log N), O(N) for a single metric, whose index is already
sorted) turns the pool at any step into a prefix, so a difficulty change costs one
``searchsorted`` instead of DeepSpeed's O(N) set intersection and difference; see
:class:`~meshfeed.curriculum.order.GatedOrder` for how batches are drawn from it.

The curriculum step of a batch is ``first_step`` plus its global batch number ``epoch *
steps_per_epoch + position // G``, so it is the step of the batch the training loop received,
never a count of prefetched batches. ``first_step=1`` is DeepSpeed's ``DeepSpeedDataSampler``,
which increments its step before it samples (batch ``n`` gets the difficulty of step ``n + 1``);
:func:`~meshfeed.curriculum.from_deepspeed_config` sets it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from meshfeed.curriculum.index import MetricIndex, is_content_fingerprint, stable_fingerprint
from meshfeed.curriculum.order import GatedOrder
from meshfeed.curriculum.schedule import MAX_STEP, Schedule, _is_int, check_schedule
from meshfeed.curriculum.transforms import ReportedDifficulty, SeqlenReshape, SeqlenTruncate

__all__ = ["Curriculum", "CurriculumIndexWarning", "CurriculumMetric"]


class CurriculumIndexWarning(UserWarning):
    """A metric index's content fingerprint differs from the dataset it orders
    (:meth:`Curriculum.check_dataset`)."""


Transform = SeqlenTruncate | SeqlenReshape | ReportedDifficulty
_NEVER = np.iinfo(np.int64).max
#: Schedules that saturate before this step are evaluated at every step; longer ones only where
#: the samples' entry steps are searched, so their cost does not grow with the step count.
DENSE_STEPS = 2**20


def _plain(x: Any) -> int | float:
    return int(x) if isinstance(x, (int, np.integer)) else float(x)


def _stable_order(entry: np.ndarray, horizon: int) -> np.ndarray:
    """``argsort(entry, kind="stable")`` for entry steps ``<= horizon`` or ``_NEVER``: a radix
    sort over 16-bit keys where the steps fit (O(N)), else a merge sort (O(N log N))."""
    if horizon + 1 < np.iinfo(np.uint16).max:
        entry = np.minimum(entry, horizon + 1).astype(np.uint16)  # _NEVER last, as before
    return np.argsort(entry, kind="stable").astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class CurriculumMetric:
    """One gating metric: its index, its pacing schedule and how the difficulty is read.

    With ``difficulty_type="percentile"`` the pool at difficulty ``p`` is the lowest
    ``floor(p * N / 100)`` samples; with ``percentile_max`` set (DeepSpeed's rule, which
    :func:`~meshfeed.curriculum.from_deepspeed_config` uses with the metric's
    ``max_difficulty``) it is ``(N // percentile_max) * p`` samples, and all ``N`` at
    ``p >= percentile_max``.
    """

    index: MetricIndex
    schedule: Schedule
    difficulty_type: Literal["value", "percentile"] = "value"
    percentile_max: int | None = None

    def __post_init__(self) -> None:
        if self.difficulty_type not in ("value", "percentile"):
            raise ValueError(
                f"difficulty_type must be 'value' or 'percentile' (got {self.difficulty_type!r})"
            )
        pm = self.percentile_max
        if pm is not None and (not _is_int(pm) or pm < 1):
            raise ValueError(
                f"percentile_max must be a positive int or None (got {pm!r}); DeepSpeed uses "
                "the metric's max_difficulty, usually 100"
            )
        if pm is not None and self.difficulty_type != "percentile":
            raise ValueError(
                f"percentile_max={pm!r} with difficulty_type={self.difficulty_type!r} would be "
                "ignored: it scales percentile difficulties only; pass "
                'difficulty_type="percentile" or drop percentile_max'
            )
        if pm is not None:
            object.__setattr__(self, "percentile_max", int(pm))  # a numpy int as an int
        check_schedule(self.schedule)
        if not isinstance(self.index, MetricIndex):
            raise TypeError(
                f"index must be a MetricIndex (got {type(self.index).__name__}); load one with "
                "MetricIndex.load(path) or build it with analyze(...)"
            )

    @property
    def name(self) -> str:
        return self.index.name

    def _horizon(self) -> int:
        """The saturation step, capped at ``MAX_STEP`` (no run reaches a later step)."""
        horizon = self.schedule.saturation_step
        if horizon is None:
            raise ValueError(
                f"metric {self.name!r}: its schedule has no saturation step; pass "
                "custom(fn, total_curriculum_step=...) so eligibility can be precomputed"
            )
        return min(int(horizon), MAX_STEP)

    def thresholds(self) -> np.ndarray:
        """The schedule on steps ``0 .. saturation_step`` (constant afterwards).

        One value per step: :meth:`entry_steps` uses it only for schedules shorter than
        ``DENSE_STEPS``.
        """
        steps = np.arange(self._horizon() + 1, dtype=np.int64)
        thr = np.asarray(self.schedule.difficulties(steps))
        self._check_never_decreases(steps, thr, every_step=True)
        return thr

    def _check_never_decreases(
        self, steps: np.ndarray, thr: np.ndarray, *, every_step: bool
    ) -> None:
        """Refuse a schedule whose values ``thr`` at ``steps`` (increasing; ``every_step``:
        all steps from 0) go down anywhere: the eligible pool can only grow."""
        if not np.any(np.diff(thr) < 0):
            return
        bad = int(np.flatnonzero(np.diff(thr) < 0)[0])
        where = (
            f"at step {steps[bad + 1]}"
            if every_step
            else f"between steps {steps[bad]} and {steps[bad + 1]}"
        )
        raise ValueError(
            f"metric {self.name!r}: the schedule decreases {where} ({thr[bad]} -> "
            f"{thr[bad + 1]}); the eligible pool can only grow"
        )

    def percentile_counts(self, percent: np.ndarray) -> np.ndarray:
        """How many of the lowest samples the pool holds at each percentile difficulty."""
        pm = self.percentile_max
        if pm is None:
            return self.index.percentile_count(percent)
        n = len(self.index)
        p = np.floor(np.asarray(percent, dtype=np.float64)).astype(np.int64)
        return np.where(p >= pm, n, (n // pm) * np.clip(p, 0, pm)).astype(np.int64)

    def entry_steps(self, *, in_sorted_order: bool) -> np.ndarray:
        """Per sample, the first step at which this metric admits it (``_NEVER`` if never).

        Indexed by dataset index, or along ``index.order`` when ``in_sorted_order``. A schedule
        shorter than ``DENSE_STEPS`` is evaluated at every step; a longer one only at the steps
        a bisection per distinct sample value probes (O(values x log steps), whatever the
        number of steps), and checked to never decrease at the entry steps found.
        """
        horizon = self._horizon()
        self.index.check_unchanged()
        n = len(self.index)
        if horizon < DENSE_STEPS:
            # Along index.order the entry step never decreases: samples [c[t-1], c[t]) enter
            # at step t, where c[t] is how many the schedule admits at t. O(N) to write out.
            thr = self.thresholds()
            if self.difficulty_type == "value":
                admitted = np.searchsorted(self.index.sorted_values(), thr, side="right")
            else:
                admitted = np.clip(self.percentile_counts(thr), 0, n)
            bounds = np.concatenate([[0], admitted, [n]]).astype(np.int64)
            entry = np.repeat(np.arange(horizon + 2, dtype=np.int64), np.diff(bounds))
        else:
            if self.difficulty_type == "value":
                keys = self.index.sorted_values()
            else:
                keys = np.arange(n, dtype=np.int64)  # the rank along index.order
            targets, inverse = np.unique(keys, return_inverse=True)
            entry = self._bisect_entry(targets, horizon)[inverse.reshape(-1)].astype(np.int64)
        entry[entry > horizon] = _NEVER
        if in_sorted_order:
            return entry
        out = np.empty(n, dtype=np.int64)
        out[np.asarray(self.index.order)] = entry
        return out

    def _admits(self, steps: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """Whether the schedule at ``steps[i]`` admits ``targets[i]`` (a value or a rank)."""
        at, inverse = np.unique(steps, return_inverse=True)  # each step evaluated once
        thr = np.asarray(self.schedule.difficulties(at))
        if self.difficulty_type == "value":
            return np.asarray(thr[inverse.reshape(-1)] >= targets)
        return np.asarray(self.percentile_counts(thr)[inverse.reshape(-1)] > targets)

    def _bisect_entry(self, targets: np.ndarray, horizon: int) -> np.ndarray:
        """Per target, the first step in ``0 .. horizon`` that admits it (``horizon + 1``: none).

        Exactly what searching :meth:`thresholds` gives, for a schedule that never decreases.
        """
        lo = np.zeros(targets.size, dtype=np.int64)
        hi = np.full(targets.size, horizon + 1, dtype=np.int64)  # the answer lies in [lo, hi]
        todo = np.flatnonzero(lo < hi)
        while todo.size:
            mid = lo[todo] + (hi[todo] - lo[todo]) // 2  # no int64 overflow near 2**63
            ok = self._admits(mid, targets[todo])
            hi[todo[ok]] = mid[ok]
            lo[todo[~ok]] = mid[~ok] + 1
            todo = todo[lo[todo] < hi[todo]]
        found = np.unique(np.append(lo[lo <= horizon], [0, horizon]))
        thr = np.asarray(self.schedule.difficulties(found))
        self._check_never_decreases(found, thr, every_step=False)
        return lo


class BatchTransforms:
    """Applies transform-only metrics (seqlen truncation / reshape) for a batch's step.

    Called as ``hook(batch, epoch=e, step=s)`` (the :class:`~meshfeed.protocols.PostProcess`
    contract the loader's fetcher follows) with ``s`` the batch's global step within epoch
    ``e``; the curriculum step keeps growing across epochs: ``e * steps_per_epoch + s``.
    """

    __slots__ = ("first_step", "steps_per_epoch", "transforms")

    def __init__(self, transforms: tuple[Transform, ...], *, first_step: int = 0) -> None:
        self.transforms = transforms
        self.first_step = first_step
        self.steps_per_epoch: int | None = None

    def __call__(self, batch: Any, *, epoch: int, step: int) -> Any:
        if not self.transforms:
            return batch
        if epoch:
            if self.steps_per_epoch is None:
                raise ValueError(
                    f"postprocess() at {epoch=} needs the steps per epoch, known once "
                    "make_order() has run; build the DataLoader with this curriculum first"
                )
            step = epoch * self.steps_per_epoch + step
        step += self.first_step
        for t in self.transforms:
            batch = t(batch, t.schedule.difficulty(step))
        return batch


class Curriculum:
    """Difficulty-gated sampling plus transform-only metrics, for ``DataLoader(curriculum=)``.

    ``samples_per_epoch`` (default: the dataset length rounded down to whole global batches)
    is what the loader treats as one epoch; the curriculum and the sampling rounds run on across
    epochs. :meth:`make_order` checks every index against the dataset length, and
    :meth:`check_dataset` against the dataset's content (the loader calls it).
    """

    def __init__(
        self,
        metrics: Sequence[CurriculumMetric] = (),
        *,
        transforms: Sequence[Transform] = (),
        samples_per_epoch: int | None = None,
        first_step: int = 0,
    ) -> None:
        if not _is_int(first_step) or first_step < 0:
            raise ValueError(
                f"first_step must be an int >= 0 (got {first_step=!r}); 0 gives batch n the "
                "difficulty of step n, 1 that of step n + 1 (DeepSpeed's sampler)"
            )
        self.first_step = int(first_step)
        self.metrics = tuple(metrics)
        self.transforms = tuple(transforms)
        for m in self.metrics:
            if not isinstance(m, CurriculumMetric):
                raise TypeError(
                    f"metrics must be CurriculumMetric objects (got {type(m).__name__}); wrap "
                    "an index as CurriculumMetric(index=..., schedule=...)"
                )
        for t in self.transforms:
            if not isinstance(t, (SeqlenTruncate, SeqlenReshape, ReportedDifficulty)):
                raise TypeError(
                    f"transforms must be SeqlenTruncate, SeqlenReshape or ReportedDifficulty "
                    f"(got {type(t).__name__}); e.g. SeqlenTruncate(schedule=...)"
                )
        names = [m.name for m in self.metrics] + [t.name for t in self.transforms]
        if len(set(names)) != len(names):
            raise ValueError(f"curriculum metric names must be unique (got {names})")
        if samples_per_epoch is not None and (
            not _is_int(samples_per_epoch) or samples_per_epoch < 1
        ):
            raise ValueError(
                f"samples_per_epoch must be a positive int or None (got {samples_per_epoch=!r}); "
                "give a multiple of the global batch size, or None for the dataset length "
                "rounded down to whole global batches"
            )
        self.samples_per_epoch = None if samples_per_epoch is None else int(samples_per_epoch)
        self._post = BatchTransforms(self.transforms, first_step=self.first_step)

    def __repr__(self) -> str:
        names = [m.name for m in self.metrics] + [t.name for t in self.transforms]
        return f"Curriculum({names})"

    def difficulties(self, step: int) -> dict[str, int | float]:
        """Every metric's and transform's difficulty at global ``step``."""
        out = {m.name: _plain(m.schedule.difficulty(step)) for m in self.metrics}
        out.update({t.name: _plain(t.schedule.difficulty(step)) for t in self.transforms})
        return out

    def check_dataset(self, dataset: Any) -> None:
        """Warn (:class:`CurriculumIndexWarning`, once per loader build) when a metric index
        may have been built for another dataset of its length: the index's content fingerprint
        (``meshfeed analyze`` and :func:`~meshfeed.curriculum.content_fingerprint` make one)
        differs from the dataset's. A warning, not an error: a dataset that transforms the one
        the index was built for (a tokenizing wrapper) has the same samples in other items.

        Reads 16 sampled items twice (:func:`~meshfeed.curriculum.index.stable_fingerprint`),
        once for every index. Nothing is checked for an index with another fingerprint (one
        given to ``MetricIndex.from_values`` by hand), for a dataset of another length
        (:meth:`pool` refuses it), or where the dataset's fingerprint is no stable fact of its
        content (an item fails to read, is an object hashed by its repr, or reads differently
        a second time). A ``LazyDataset`` matches when it or its source does.
        """
        n = len(dataset)
        checked = [
            m
            for m in self.metrics
            if is_content_fingerprint(m.index.fingerprint) and m.index.fingerprint["length"] == n
        ]
        if not checked:
            return
        from meshfeed.sources.lazy import LazyDataset

        candidates = [dataset]
        if isinstance(dataset, LazyDataset):
            candidates.append(dataset.source)
        found: list[dict[str, Any]] = []
        for m in checked:
            expected = dict(m.index.fingerprint)
            while len(found) < len(candidates) and expected not in found:
                got = stable_fingerprint(candidates[len(found)])
                if got is None:
                    return  # no stable content to compare: the length check alone
                found.append(got)
            if expected not in found:
                warnings.warn(
                    f"metric index {m.name!r} was built for another dataset of {n} samples "
                    f"(index fingerprint {expected['hash']}, this dataset "
                    f"{found[0]['hash']}): unless this dataset transforms that one sample for "
                    "sample, the curriculum orders it by another dataset's metric. Rebuild the "
                    "index for this dataset (`meshfeed analyze`, or content_fingerprint(dataset) "
                    "for MetricIndex.from_values), or load the index that matches it",
                    CurriculumIndexWarning,
                    stacklevel=2,
                )
                return

    def pool(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Eligible samples of an ``n``-sample dataset in entry order, and their entry steps."""
        for m in self.metrics:
            if len(m.index) != n:
                raise ValueError(
                    f"metric index {m.name!r} has {len(m.index)} samples but the dataset has "
                    f"{n}; rerun `meshfeed analyze` on this dataset"
                )
        if not self.metrics:
            return np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        if len(self.metrics) == 1:
            only = self.metrics[0]
            entry = only.entry_steps(in_sorted_order=True)  # non-decreasing along index.order
            order = np.asarray(only.index.order, dtype=np.int64)
        else:
            entry = self.metrics[0].entry_steps(in_sorted_order=False)
            for m in self.metrics[1:]:
                np.maximum(entry, m.entry_steps(in_sorted_order=False), out=entry)
            order = _stable_order(entry, max(m._horizon() for m in self.metrics))
            entry = entry[order]
        keep = int(np.searchsorted(entry, _NEVER, side="left"))
        first = self.first_step
        if keep == 0 or entry[0] > first:
            at0 = self.difficulties(first)
            raise ValueError(
                f"no sample is eligible at step {first} (difficulties {at0}); lower the "
                "schedules' min_difficulty to at least the smallest metric value (see the index "
                "percentiles)"
            )
        return order[:keep], entry[:keep]

    def make_order(self, *, dataset_length: int, global_batch_size: int, seed: int) -> GatedOrder:
        """The order the loader walks (called once per loader; O(N) or O(N log N))."""
        per_epoch = self.bind(
            global_batch_size=global_batch_size,
            samples_per_epoch=self.samples_per_epoch
            or max(1, dataset_length // max(global_batch_size, 1)) * global_batch_size,
        )
        pool_order, entry = self.pool(int(dataset_length))
        return self.gate(
            pool_order,
            entry,
            global_batch_size=global_batch_size,
            seed=seed,
            samples_per_epoch=per_epoch,
        )

    def bind(self, *, global_batch_size: int, samples_per_epoch: int) -> int:
        """Fix the loader's epoch (whole global batches) for the post-processing hook."""
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be positive (got {global_batch_size=})")
        if samples_per_epoch % global_batch_size:
            raise ValueError(
                f"samples_per_epoch must be a multiple of the global batch size (got "
                f"{samples_per_epoch=}, {global_batch_size=}) so curriculum steps are whole "
                "batches"
            )
        self._post.steps_per_epoch = samples_per_epoch // global_batch_size
        return samples_per_epoch

    def gate(
        self,
        pool_order: np.ndarray,
        entry_steps: np.ndarray,
        *,
        global_batch_size: int,
        seed: int,
        samples_per_epoch: int,
        batch_start: Callable[[int], int] | None = None,
    ) -> GatedOrder:
        """A :class:`GatedOrder` over ``pool_order`` with this curriculum's step rule."""
        return GatedOrder(
            pool_order=pool_order,
            entry_steps=entry_steps,
            global_batch_size=global_batch_size,
            samples_per_epoch=samples_per_epoch,
            seed=seed,
            difficulties=self.difficulties,
            first_step=self.first_step,
            batch_start=batch_start,
        )

    @property
    def steps_per_epoch(self) -> int | None:
        """Global batches per loader epoch, known once :meth:`make_order` has run."""
        return self._post.steps_per_epoch

    @property
    def postprocess(self) -> BatchTransforms:
        """The loader's hook: ``postprocess(batch, epoch=..., step=...)`` applies the transforms.

        A small object holding only the transforms, so shipping it to worker processes does
        not copy the metric indexes.
        """
        return self._post
