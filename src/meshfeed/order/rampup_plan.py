"""The plan of a loader with a batch-size ramp: :class:`RampupPlan`, and :func:`make_plan`.

A :class:`~meshfeed.order.batches.BatchPlan` whose global batch follows a
:class:`~meshfeed.order.rampup.BatchRampup` (see :mod:`meshfeed.order.rampup` for the schedule):
the step at a position is cut from the size the samples consumed before it give, and each data
rank takes its contiguous slice of it, as without a ramp.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from meshfeed.order.batches import BatchPlan, Step
from meshfeed.order.rampup import BatchRampup, RampSizes, check_same_sizes
from meshfeed.protocols import Order

__all__ = ["PlanOptions", "RampupPlan", "check_ahead", "make_plan", "resized"]


class RampupPlan(BatchPlan):
    """A :class:`BatchPlan` whose global batch follows a :class:`BatchRampup`.

    Step sizes are a pure function of the samples consumed before them (module docstring);
    the walk over an epoch takes one segment per ramp increment, so counting steps or the
    samples an epoch consumed costs O(increments), never O(steps); a step's index too, unless
    it follows the step asked for before (a walk), which is O(1). The samples consumed before
    an epoch are summed once over the epochs before it, then cached.
    """

    def __init__(
        self,
        order: Order,
        *,
        rampup: BatchRampup,
        global_batch_size: int,
        drop_last: bool = True,
        pad_last: bool = True,
        data_world_size: int = 1,
        check_from: int = 0,
    ) -> None:
        """``check_from``: the samples consumed where this plan starts to serve; the ramp's
        sizes from there on must divide among the data ranks (0: all of them, a fresh run)."""
        super().__init__(
            order,
            global_batch_size=global_batch_size,
            drop_last=drop_last,
            pad_last=pad_last,
            data_world_size=data_world_size,
        )
        if not self.drop_last and not self.pad_last:
            raise ValueError(
                "rampup with drop_last=False, pad_last=False: the truncated last batch depends "
                "on the number of data ranks and the ramp counts consumed samples, so later "
                "batch sizes would too; use drop_last=True or pad_last=True"
            )
        self.rampup = rampup
        self.sizes = RampSizes(
            rampup, self.global_batch_size, self.data_world_size, check_from=check_from
        )
        #: The sizes from this many consumed samples on divide among the data ranks.
        self.checked_from = check_from
        self._bases: dict[int, int] = {0: 0}
        self._next: tuple[int, int, int] | None = None  # (epoch, position, index) of a walk

    def base(self, epoch: int) -> int:
        """Samples consumed before ``epoch``."""
        if epoch in self._bases:
            return self._bases[epoch]
        known = max(e for e in self._bases if e <= epoch)
        consumed = self._bases[known]
        for e in range(known, epoch):
            consumed += self.consumed(e)
            self._bases[e + 1] = consumed
        return consumed

    def _runs(self, epoch: int, position: int) -> Iterator[tuple[int, int, int]]:
        """``(position, size, count)``: runs of full batches from ``position`` to the last."""
        length, base = self.order.epoch_length(epoch), self.base(epoch)
        p = position
        while True:
            size = self.sizes.size(base + p)
            change = self.sizes.next_change(base + p)
            count = (length - p) // size
            if change is not None:
                count = min(count, -(-(change - base - p) // size))
            if count == 0:
                return
            yield p, size, count
            p += count * size

    def _tail(self, epoch: int, position: int) -> tuple[int, int]:
        """Full steps from ``position`` and the position where the short rest begins."""
        steps, p = 0, position
        for start, size, count in self._runs(epoch, position):
            steps, p = steps + count, start + size * count
        return steps, p

    def consumed(self, epoch: int) -> int:
        """Samples ``epoch`` consumes: its full batches and what its last batch serves."""
        _, p = self._tail(epoch, 0)
        return p + self._last_len(self.order.epoch_length(epoch) - p)

    def unserved(self, epochs: int) -> int:
        """As :meth:`BatchPlan.unserved`; each epoch's dropped rest has its own size here."""
        return sum(self.order.epoch_length(e) for e in range(epochs)) - self.base(epochs)

    def step_at(self, epoch: int, position: int) -> Step | None:
        end = self._step_end(epoch, position, self.sizes.size(self.base(epoch) + position))
        if end <= position:
            return None
        # A walk asks for the step after the last one: its index is the next, no recount.
        known = self._next
        if known is not None and known[:2] == (epoch, position):
            index = known[2]
        else:
            index = self._steps_before(epoch, position)
        self._next = (epoch, end, index + 1)
        return Step(epoch, position, end, index)

    def _steps_before(self, epoch: int, position: int) -> int:
        """How many steps of ``epoch`` end at or before ``position`` (a step boundary)."""
        steps = 0
        for start, size, count in self._runs(epoch, 0):
            if start + size * count > position:
                return steps + (position - start) // size
            steps += count
        return steps

    def steps(self, epoch: int, position: int = 0) -> int:
        full, p = self._tail(epoch, position)
        return full + (1 if self._last_len(self.order.epoch_length(epoch) - p) > 0 else 0)

    def rank_block(
        self, step: Step, data_rank: int, data_world_size: int, max_steps: int
    ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """As :meth:`BatchPlan.rank_block`: ``max_steps`` steps' positions, one order call."""
        starts: list[int] = []
        slices: list[np.ndarray] = []
        current: Step | None = step
        while current is not None and len(starts) < max_steps:
            starts.append(current.start)
            slices.append(self.rank_positions(current, data_rank, data_world_size))
            current = self.step_at(current.epoch, current.end)
        flat = self.order.indices(step.epoch, np.concatenate(slices))
        parts = np.split(flat, np.cumsum([len(s) for s in slices])[:-1])
        return dict(zip(starts, zip(slices, parts, strict=True), strict=True))

    def facts(self) -> dict[str, int]:
        """The ramp, as ``rampup_*`` ints of a loader's state and of the ranks' agreement."""
        return {f"rampup_{key}": value for key, value in self.rampup.facts().items()}

    def check_resume_from(self, data_world_size: int) -> None:
        """Refuse a checkpoint of ``data_world_size`` ranks whose rounding differs from ours."""
        if data_world_size != self.data_world_size:
            # Its sizes only, compared: a run resized past the ramp may not divide its start.
            was = RampSizes(self.rampup, self.global_batch_size, data_world_size, check_from=None)
            check_same_sizes(was, self.sizes)

    def with_ranks(self, data_world_size: int, *, consumed: int = 0) -> RampupPlan:
        """This plan over ``data_world_size`` data ranks from ``consumed`` samples on: refused
        where a size of the ramp still ahead does not divide among them (0: any size), or where
        round_down would round the sizes otherwise (the consumed counts would move)."""
        plan = RampupPlan(
            self.order,
            rampup=self.rampup,
            check_from=consumed,
            **self._options(data_world_size),
        )
        check_same_sizes(self.sizes, plan.sizes)
        return plan


def check_ahead(plan: BatchPlan, epoch: int, position: int) -> None:
    """Refuse to move ``plan``'s loader to ``epoch`` / ``position`` (a checkpoint, an earlier
    epoch) where a ramp size ahead does not divide among its data ranks: a plan resized past
    the ramp was checked only from where it was resized (:func:`resized`)."""
    if isinstance(plan, RampupPlan) and plan.checked_from:
        consumed = plan.base(epoch) + position
        if consumed < plan.checked_from:
            plan.sizes.check_divides(consumed)
            plan.checked_from = consumed


def resized(plan: BatchPlan, data_world_size: int, epoch: int, position: int) -> BatchPlan:
    """``plan`` over ``data_world_size`` data ranks for a loader continuing at ``epoch`` /
    ``position`` (a live resize): a ramp's sizes are checked from there on, the ones behind
    were served (past the ramp, any data ranks the global batch divides)."""
    if isinstance(plan, RampupPlan):
        return plan.with_ranks(data_world_size, consumed=plan.base(epoch) + position)
    return plan.with_ranks(data_world_size)


class PlanOptions(Protocol):
    """What :func:`make_plan` reads of a loader's options (a :class:`~meshfeed.LoaderOptions`)."""

    @property
    def batch_size(self) -> int: ...
    @property
    def drop_last(self) -> bool: ...
    @property
    def pad_last(self) -> bool: ...
    @property
    def rampup(self) -> BatchRampup | None: ...


def make_plan(order: Order, options: PlanOptions, *, data_world_size: int) -> BatchPlan:
    """The loader's plan: a :class:`BatchPlan` of ``batch_size`` x ``data_world_size``, or a
    :class:`RampupPlan` ramping up to it when ``options.rampup`` is given."""
    kwargs: dict[str, Any] = {
        "global_batch_size": options.batch_size * data_world_size,
        "drop_last": options.drop_last,
        "pad_last": options.pad_last,
        "data_world_size": data_world_size,
    }
    if options.rampup is None:
        return BatchPlan(order, **kwargs)
    return RampupPlan(order, rampup=options.rampup, **kwargs)
