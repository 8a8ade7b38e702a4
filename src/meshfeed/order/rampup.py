"""Batch-size ramp-up: Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES``, exact.

The global batch starts at ``start`` samples and grows by ``increment`` every
``samples / ((G - start) / increment)`` consumed samples until it reaches the loader's global
batch ``G``; after ``samples`` consumed samples it is ``G``. The size of each step is a pure
function of the samples consumed before it, computed with Megatron's own float formula
(``RampupBatchsizeNumMicroBatchesCalculator.update``) so a trainer that asks Megatron for the
number of micro-batches gets the size the loader served, step for step.

Consumed samples count across epochs: the positions each epoch walked (a last batch dropped by
``drop_last`` is not consumed, a padded one counts its real samples), so the state stays an
epoch and a position and the schedule never depends on the number of data ranks.

Every global batch must divide into ``micro_batch_size`` x data ranks (Megatron's rule), or it
cannot be cut into equal per-rank batches. Every size the schedule can take is checked when the
loader is built (Megatron asserts at the first step that reaches one; a ramp whose steps outgrow
its increments may skip a size, but where epochs end moves that). Where one does not divide, the
loader refuses by name unless asked for one of two exact alternatives: ``round_down=True`` (Megatron's
``--decrease-batch-size-if-needed``: each batch is rounded down to a multiple, and the rounded
size is what is consumed) or ``uneven=True`` (the batch is served whole, ranks' shares differ by
at most one sample: steps stay equal on every rank, but a trainer that averages per-rank mean
losses then weights samples unequally; most trainers cannot accept that).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from meshfeed.order.batches import BatchPlan, Step
from meshfeed.protocols import Order

__all__ = ["BatchRampup", "PlanOptions", "RampupPlan", "as_rampup", "make_plan"]


def _positive(name: str, value: object, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(
            f"BatchRampup {name} must be an int >= {low} (got {name}={value!r}); "
            "see Megatron's --rampup-batch-size START INCREMENT SAMPLES"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchRampup:
    """A batch-size ramp (module docstring); ``DataLoader(..., rampup=BatchRampup(...))``.

    ``start``, ``increment`` and ``samples`` are Megatron's three numbers; the final global
    batch is the loader's (``batch_size`` x data ranks). ``micro_batch_size`` is Megatron's
    ``--micro-batch-size``: every global batch must be a multiple of it times the data ranks.
    """

    start: int
    increment: int
    samples: int
    micro_batch_size: int = 1
    round_down: bool = False
    uneven: bool = False

    def __post_init__(self) -> None:
        _positive("start", self.start)
        _positive("increment", self.increment)
        _positive("samples", self.samples)
        _positive("micro_batch_size", self.micro_batch_size)
        for name in ("round_down", "uneven"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BatchRampup {name} must be True or False")
        if self.uneven and self.micro_batch_size > 1:
            raise ValueError(
                f"BatchRampup uneven=True gives per-rank batches differing by one sample, which "
                f"do not split into micro-batches (got micro_batch_size={self.micro_batch_size}); "
                "use round_down=True, or micro_batch_size=1"
            )
        if self.round_down and self.uneven:
            raise ValueError(
                "BatchRampup round_down=True and uneven=True are two answers to one question "
                "(a global batch the data ranks do not divide); pass one of them"
            )

    def facts(self) -> dict[str, int]:
        """The ramp as JSON ints (a checkpoint's ``rampup`` field, the ranks' agreement)."""
        return {
            "start": self.start,
            "increment": self.increment,
            "samples": self.samples,
            "micro_batch_size": self.micro_batch_size,
            "round_down": int(self.round_down),
            "uneven": int(self.uneven),
        }


def as_rampup(value: object) -> BatchRampup | None:
    """``value`` as a :class:`BatchRampup`: one, None, or Megatron's triple
    ``(start, increment, samples)``; anything else is refused by name."""
    if value is None or isinstance(value, BatchRampup):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 3:
        start, increment, samples = value
        return BatchRampup(start=start, increment=increment, samples=samples)
    raise ValueError(
        f"rampup must be None, a BatchRampup or (start, increment, samples) as Megatron's "
        f"--rampup-batch-size (got {value!r}); e.g. rampup=(32, 32, 1_000_000)"
    )


class _Sizes:
    """The running global batch as a function of consumed samples (Megatron's formula)."""

    def __init__(self, rampup: BatchRampup, global_batch_size: int, data_world_size: int):
        r, G, dp = rampup, global_batch_size, data_world_size
        self.rampup, self.G, self.dp = r, G, dp
        self.multiple = r.micro_batch_size * dp
        if r.start > G or (G - r.start) % r.increment:
            raise ValueError(
                f"the ramp must climb from start to the global batch in whole increments (got "
                f"start={r.start}, increment={r.increment}, global batch {G} = batch_size x "
                f"{dp} data ranks); use a start <= {G} with {G} - start a multiple of increment"
            )
        self.num_increments = (G - r.start) // r.increment
        # Megatron divides in floats; the same division gives the same step at every boundary.
        self.per_increment = r.samples / self.num_increments if self.num_increments else 0.0
        self._check_divides()

    def raw(self, consumed: int) -> int:
        """Megatron's ``current_global_batch_size`` after ``consumed`` samples."""
        r = self.rampup
        if consumed > r.samples or not self.num_increments:
            return self.G
        return r.start + int(consumed / self.per_increment) * r.increment

    def size(self, consumed: int) -> int:
        """The running global batch after ``consumed`` samples (rounded with round_down)."""
        raw = self.raw(consumed)
        return raw - raw % self.multiple if self.rampup.round_down else raw

    def sizes(self) -> list[int]:
        """Every running global batch the ramp can take, smallest first."""
        r = self.rampup
        raws = [r.start + j * r.increment for j in range(self.num_increments + 1)]
        return sorted({x - x % self.multiple if r.round_down else x for x in raws})

    def next_change(self, consumed: int) -> int | None:
        """The first consumed count after ``consumed`` with another raw size (None: never)."""
        r = self.rampup
        if consumed > r.samples or not self.num_increments:
            return None
        j = int(consumed / self.per_increment) + 1
        guess = max(consumed + 1, -(-j * r.samples // self.num_increments))
        # The exact boundary is within a sample or two of the float one: walk to it.
        while guess - 1 > consumed and self.raw(guess - 1) != self.raw(consumed):
            guess -= 1
        while guess <= r.samples and self.raw(guess) == self.raw(consumed):
            guess += 1
        return guess

    def _check_divides(self) -> None:
        r, m, dp = self.rampup, self.multiple, self.dp
        if r.uneven:
            if r.start < dp:
                raise ValueError(
                    f"rampup start={r.start} is below the {dp} data ranks: a rank would get an "
                    f"empty batch; use start >= {dp}"
                )
            return
        if r.round_down:
            if r.start < m:
                raise ValueError(
                    f"rampup start={r.start} rounds down to 0 with micro_batch_size="
                    f"{r.micro_batch_size} x {dp} data ranks = {m}; use start >= {m}"
                )
            return
        bad = [x for x in self.sizes() if x % m]
        if bad:
            raise ValueError(
                f"global batch {bad[0]} of the ramp (start={r.start}, increment={r.increment}, "
                f"global batch {self.G}) does not divide into micro_batch_size="
                f"{r.micro_batch_size} x {dp} data ranks = {m}, so ranks would get unequal "
                f"batches; use start, increment and batch_size*data ranks that are multiples of "
                f"{m}, or round_down=True (Megatron's --decrease-batch-size-if-needed), or "
                "uneven=True (equal steps, per-rank batches differing by one sample)"
            )


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
    ) -> None:
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
        self.sizes = _Sizes(rampup, self.global_batch_size, self.data_world_size)
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

    def step_at(self, epoch: int, position: int) -> Step | None:
        length = self.order.epoch_length(epoch)
        size = self.sizes.size(self.base(epoch) + position)
        end = min(position + size, length)
        if end - position < size:
            end = position + self._last_len(max(0, end - position))
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
            was = _Sizes(self.rampup, self.global_batch_size, data_world_size)
            check_same_sizes(was, self.sizes)

    def with_ranks(self, data_world_size: int) -> RampupPlan:
        """This plan over ``data_world_size`` data ranks: refused where the ramp does not divide,
        or where round_down would round the sizes otherwise (the consumed counts would move)."""
        plan = RampupPlan(
            self.order,
            rampup=self.rampup,
            global_batch_size=self.global_batch_size,
            drop_last=self.drop_last,
            pad_last=self.pad_last,
            data_world_size=data_world_size,
        )
        check_same_sizes(self.sizes, plan.sizes)
        return plan


def check_same_sizes(was: _Sizes, now: _Sizes) -> None:
    """Refuse moving a rounded ramp to data ranks that round it otherwise: the samples consumed
    so far were counted with the sizes rounded on the ranks the run had."""
    if was.sizes() != now.sizes():
        raise ValueError(
            f"rampup round_down=True rounds the ramp's global batches to multiples of "
            f"{was.multiple} on the run's {was.dp} data ranks but of {now.multiple} on {now.dp} "
            f"(sizes {was.sizes()[:6]} vs {now.sizes()[:6]}), so the samples consumed so far "
            f"would be counted otherwise; keep {was.dp} data ranks, or use start and increment "
            "that are multiples of micro_batch_size x both data-rank counts"
        )


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
    G, drop, pad = options.batch_size * data_world_size, options.drop_last, options.pad_last
    if options.rampup is None:
        return BatchPlan(
            order,
            global_batch_size=G,
            drop_last=drop,
            pad_last=pad,
            data_world_size=data_world_size,
        )
    return RampupPlan(
        order,
        rampup=options.rampup,
        global_batch_size=G,
        drop_last=drop,
        pad_last=pad,
        data_world_size=data_world_size,
    )
