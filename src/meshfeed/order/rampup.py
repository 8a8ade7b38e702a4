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
its increments may skip a size, but where epochs end moves that). A resize checks only the sizes
still ahead of the samples consumed (those behind were served): past the ramp, any data ranks
the final global batch divides, as Megatron accepts once ``consumed > samples``. Where one does
not divide,
the loader refuses by name unless asked for one of two exact alternatives: ``round_down=True``
(Megatron's ``--decrease-batch-size-if-needed``: each batch is rounded down to a multiple, and
the rounded size is what is consumed) or ``uneven=True`` (the batch is served whole, ranks'
shares differ by at most one sample: steps stay equal on every rank, but a trainer that averages
per-rank mean losses then weights samples unequally; most trainers cannot accept that).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["MAX_RAMP_SAMPLES", "BatchRampup", "RampSizes", "as_rampup", "check_same_sizes"]

#: The longest ramp (``samples``): Megatron's float formula is exact on consumed counts up to
#: 2**53 (every count a float), and no run consumes that many samples.
MAX_RAMP_SAMPLES = 2**53


def _positive(name: str, value: object, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"BatchRampup {name} must be an int >= {low} (got {name}={value!r} of type "
            f"{type(value).__name__}); see Megatron's --rampup-batch-size START INCREMENT SAMPLES"
        )
    if value < low:
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
        for name in ("start", "increment", "samples", "micro_batch_size"):
            _positive(name, getattr(self, name))
        if self.samples > MAX_RAMP_SAMPLES:
            raise ValueError(
                f"BatchRampup samples must be at most 2**53 = {MAX_RAMP_SAMPLES} (got "
                f"samples={self.samples}); Megatron's float formula counts consumed samples "
                "exactly only up to there; pass the samples over which the batch really ramps"
            )
        for name in ("round_down", "uneven"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"BatchRampup {name} must be True or False (got {name}="
                    f"{getattr(self, name)!r}); a string such as 'False' is truthy, pass a bool"
                )
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
        return {**asdict(self), "round_down": int(self.round_down), "uneven": int(self.uneven)}


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


class RampSizes:
    """The running global batch as a function of consumed samples (Megatron's formula)."""

    def __init__(
        self,
        rampup: BatchRampup,
        global_batch_size: int,
        data_world_size: int,
        *,
        check_from: int | None = 0,
    ) -> None:
        """``check_from``: refuse a size still ahead after that many consumed samples that the
        data ranks do not divide (0: every size, a fresh run); None: no check (the sizes of
        another run's ranks, compared only)."""
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
        if check_from is not None:
            self.check_divides(check_from)

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
        return self.ahead(0)

    def ahead(self, consumed: int) -> list[int]:
        """Every running global batch the ramp can still take after ``consumed`` samples,
        smallest first (the sizes are non-decreasing in the samples consumed)."""
        r = self.rampup
        first = self._increments(consumed)
        raws = [r.start + j * r.increment for j in range(first, self.num_increments + 1)]
        return sorted({x - x % self.multiple if r.round_down else x for x in raws})

    def _increments(self, consumed: int) -> int:
        """How many increments the raw size has taken after ``consumed`` samples."""
        if consumed > self.rampup.samples or not self.num_increments:
            return self.num_increments
        return min(int(consumed / self.per_increment), self.num_increments)

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

    def check_divides(self, consumed: int = 0) -> None:
        """Refuse a running global batch still ahead after ``consumed`` samples (0: any) that
        cannot be cut into equal per-rank batches on these data ranks (module docstring)."""
        r, m, dp = self.rampup, self.multiple, self.dp
        low = r.start + self._increments(consumed) * r.increment  # the smallest raw size ahead
        what, fix = f"rampup start={r.start}", f"use start >= {m if r.round_down else dp}"
        if consumed:  # a resize: the sizes behind were served
            what = f"the ramp's global batch {low} (still ahead after {consumed} consumed samples)"
            fix = f"keep at most {low // r.micro_batch_size} data ranks until the ramp is over"
        if r.uneven:
            if low < dp:
                raise ValueError(
                    f"{what} is below the {dp} data ranks: a rank would get an empty batch; {fix}"
                )
            return
        if r.round_down:
            if low < m:
                raise ValueError(
                    f"{what} rounds down to 0 with micro_batch_size="
                    f"{r.micro_batch_size} x {dp} data ranks = {m}; {fix}"
                )
            return
        ahead = self.ahead(consumed)
        bad = [x for x in ahead if x % m]
        if bad and consumed:
            whole = math.gcd(*ahead) // r.micro_batch_size  # the run's ranks divided them all
            raise ValueError(
                f"global batch {bad[0]} of the ramp (start={r.start}, increment={r.increment}, "
                f"samples={r.samples}, global batch {self.G}), still ahead after {consumed} "
                f"consumed samples, does not divide into micro_batch_size={r.micro_batch_size} "
                f"x {dp} data ranks = {m}, so ranks would get unequal batches; resize to a "
                f"data-parallel size dividing {whole} (every size still ahead), or once the ramp "
                f"is over (after {r.samples} consumed samples: then any size dividing "
                f"{self.G // r.micro_batch_size})"
            )
        if bad:
            raise ValueError(
                f"global batch {bad[0]} of the ramp (start={r.start}, increment={r.increment}, "
                f"global batch {self.G}) does not divide into micro_batch_size="
                f"{r.micro_batch_size} x {dp} data ranks = {m}, so ranks would get unequal "
                f"batches; use start, increment and batch_size*data ranks that are multiples of "
                f"{m}, or round_down=True (Megatron's --decrease-batch-size-if-needed), or "
                "uneven=True (equal steps, per-rank batches differing by one sample). To resume "
                f"a checkpoint taken past these sizes on {dp} data ranks, build the loader on "
                "data ranks the whole ramp divides (the same world, the rest on another mesh "
                f"axis), load_state_dict, then resize(mesh) onto the {dp}: a resize checks only "
                "the sizes still ahead"
            )


def check_same_sizes(was: RampSizes, now: RampSizes) -> None:
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
