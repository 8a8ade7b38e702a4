"""Pacing schedules: the training step -> difficulty threshold, with DeepSpeed's definitions.

``fixed_root(min_difficulty, max_difficulty, total_curriculum_step, difficulty_step,
root_degree)`` is the ``fixed_root`` of DeepSpeed's ``CurriculumScheduler`` as of DeepSpeed
0.19.8, the reference: ``d = floor((t/T)**(1/r) * (max - min) + min)`` (an integer, also for
float bounds), then ``d -= d % difficulty_step``, then raised to ``ceil(min / step) * step``
(the first multiple of the step at or above ``min``) and capped at ``max``. ``t/T`` is not
clamped, so with rounding ``max`` itself is reached a little after ``T``. ``fixed_linear`` is
root degree 1; ``fixed_discrete`` is a step table; ``custom`` wraps a function.

The one deliberate difference: the result is never below ``min_difficulty``. DeepSpeed before
0.19.8 let the rounding fall below it (``min=1, difficulty_step=8`` gave 0 at step 0, an empty
pool); 0.19.8 raises it to the aligned minimum as meshfeed does, and meshfeed adds a last
``max(d, min)`` so float rounding of ``ceil(min / step) * step`` cannot undercut ``min`` either.
Because DeepSpeed floors to an integer first, float difficulties between two integers do not
move (``fixed_linear(0.0, 1.0, 3, 0.1)`` is 0.0 until step 3, as in DeepSpeed); scale a [0, 1]
metric to integers (e.g. per mille) to pace it finely.

Every schedule is vectorised (:meth:`Schedule.difficulties`); the scalar :meth:`difficulty` is
the same code on a one-element array, so the two can never disagree. ``saturation_step`` is the
first step from which the difficulty never changes (``None`` when unknown): the curriculum order
evaluates schedules only up to it. Bounds are limited to ``|x| <= 2**52`` so the float
arithmetic DeepSpeed uses is exact on them; steps (``total_curriculum_step``, ``max_step``) to
``MAX_STEP`` (2**62), which no run reaches.

>>> fixed_linear(min_difficulty=8, max_difficulty=64, total_curriculum_step=7,
...              difficulty_step=8).difficulty(3)
32
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["Schedule", "custom", "fixed_discrete", "fixed_linear", "fixed_root"]

Number = int | float
_LIMIT = 2**52
#: The last step a schedule is followed to: a run reaches it only after 2**62 global batches,
#: and steps up to it stay clear of int64 overflow.
MAX_STEP = 2**62


@runtime_checkable
class Schedule(Protocol):
    """Maps a global training step to a difficulty; non-decreasing in the step."""

    @property
    def saturation_step(self) -> int | None: ...

    def difficulty(self, step: int) -> Number: ...

    def difficulties(self, steps: np.ndarray) -> np.ndarray: ...


def check_schedule(schedule: object) -> None:
    """Refuse what is not a :class:`Schedule` (a bare function, a number), naming what to
    pass: a curriculum metric's, a seqlen transform's or a reported difficulty's."""
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"schedule must be a Schedule (got {type(schedule).__name__}); build one "
            "with meshfeed.curriculum's fixed_linear, fixed_root, fixed_discrete or custom "
            "(e.g. custom(fn, total_curriculum_step=...) for a function of the step)"
        )


def _check_steps(steps: np.ndarray) -> np.ndarray:
    steps = np.asarray(steps)
    if steps.dtype.kind not in "iu":
        raise TypeError(f"steps must be integers (got dtype {steps.dtype})")
    if steps.size and steps.min() < 0:
        raise ValueError(f"steps must be >= 0 (got min {steps.min()})")
    return steps.astype(np.int64)


def _scalar(values: np.ndarray) -> Number:
    v = values[0]
    return int(v) if values.dtype.kind in "iu" else float(v)


def _is_int(*xs: object) -> bool:
    """Every one of ``xs`` is an int or a numpy integer, not a bool."""
    return all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in xs)


def _is_number_type(kind: type) -> bool:
    """``kind`` is a real number type (int, float or a numpy one), not bool."""
    return issubclass(kind, (int, float, np.integer, np.floating)) and not issubclass(kind, bool)


def _is_number(x: object) -> bool:
    """``x`` is a real number (an int, a float or a numpy one), not a bool."""
    return _is_number_type(type(x))


def _check_number(name: str, value: object, *, hint: str) -> None:
    """Refuse a ``value`` of ``name`` that is not a finite number: NaN compares false, so a NaN
    threshold would gate every sample, or none, without a word."""
    if not _is_number(value):
        raise TypeError(
            f"{name} must be an int or a float (got {value!r} of type {type(value).__name__}); "
            f"{hint}"
        )
    if not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a finite number (got {name}={value!r}); {hint}")


def _check_difficulty(name: str, value: object) -> None:
    """Refuse a difficulty ``value`` that is not a finite number (see :func:`_check_number`)."""
    _check_number(
        name, value, hint="give the threshold as a number (the metric's largest value admits all)"
    )


def _check_step_limit(name: str, step: int, limit: int = MAX_STEP) -> None:
    if step > limit:
        bound = "at most MAX_STEP = 2**62" if limit == MAX_STEP else "below MAX_STEP = 2**62"
        raise ValueError(
            f"{name} must be {bound} (got {name}={step}); no run reaches a later step, pass "
            "the step at which the schedule really saturates"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedRoot:
    """DeepSpeed's ``fixed_root`` (``fixed_linear`` when ``root_degree == 1``); see module doc."""

    min_difficulty: Number
    max_difficulty: Number
    total_curriculum_step: int
    difficulty_step: Number = 1
    root_degree: Number = 1

    def __post_init__(self) -> None:
        for name in ("min_difficulty", "max_difficulty", "difficulty_step"):
            _check_difficulty(name, getattr(self, name))
        _check_number("root_degree", self.root_degree, hint="1 is fixed_linear, 2 a square root")
        if not self.min_difficulty <= self.max_difficulty:
            raise ValueError(
                f"min_difficulty must be <= max_difficulty (got {self.min_difficulty=}, "
                f"{self.max_difficulty=}); swap them"
            )
        if not _is_int(self.total_curriculum_step) or self.total_curriculum_step < 1:
            raise ValueError(
                f"total_curriculum_step must be a positive int (got "
                f"{self.total_curriculum_step=}); it is the step at which max_difficulty is reached"
            )
        _check_step_limit("total_curriculum_step", self.total_curriculum_step)
        if not self.difficulty_step > 0:
            raise ValueError(
                f"difficulty_step must be positive (got {self.difficulty_step=}); use 1 for "
                "no rounding (DeepSpeed suggests 8 for sequence lengths on tensor cores)"
            )
        if not self.root_degree > 0:
            raise ValueError(f"root_degree must be positive (got {self.root_degree=})")
        for name in ("min_difficulty", "max_difficulty", "difficulty_step"):
            value = getattr(self, name)
            if not abs(value) <= _LIMIT:
                raise ValueError(
                    f"{name} must lie within +-2**52 (got {name}={value!r}); the schedule's "
                    "float arithmetic (DeepSpeed's) is exact only there, rescale the metric"
                )

    @property
    def integral(self) -> bool:
        return _is_int(self.min_difficulty, self.max_difficulty, self.difficulty_step)

    @property
    def saturation_step(self) -> int:
        """The first step at which ``max_difficulty`` is reached (found by bisection).

        With rounding this can lie after ``total_curriculum_step``: like DeepSpeed, ``t / T``
        is not clamped, so past ``T`` the rounded value keeps growing until it is capped; the
        search stops at ``MAX_STEP``, which no run reaches.
        """
        hi = self.max_difficulty
        upper = max(1, int(self.total_curriculum_step))
        while self.difficulty(upper) < hi:
            if upper >= MAX_STEP:
                return MAX_STEP
            upper = min(2 * upper, MAX_STEP)
        lower = 0  # invariant: difficulty(upper) == hi; the answer lies in [lower, upper]
        while lower < upper:
            mid = (lower + upper) // 2
            if self.difficulty(mid) >= hi:
                upper = mid
            else:
                lower = mid + 1
        return upper

    def difficulties(self, steps: np.ndarray) -> np.ndarray:
        t = _check_steps(steps)
        lo, hi, q = self.min_difficulty, self.max_difficulty, self.difficulty_step
        frac = (t / self.total_curriculum_step) ** (1.0 / self.root_degree)
        # DeepSpeed 0.19.8: d = floor(x); d -= d % q; d = max(d, ceil(min / q) * q);
        # d = min(d, max). The cap comes first here only so that huge t stays finite; the
        # result is the same because every later step keeps d <= max.
        d = np.minimum(np.floor(frac * (hi - lo) + lo), float(hi) + abs(q))
        d = d - np.mod(d, q)
        d = np.minimum(np.maximum(d, -(-lo // q) * q), hi)
        d = np.maximum(d, lo)  # never below min_difficulty (see the module docstring)
        return d.astype(np.int64) if self.integral else d.astype(np.float64)

    def difficulty(self, step: int) -> Number:
        return _scalar(self.difficulties(np.array([step])))


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedDiscrete:
    """DeepSpeed's ``fixed_discrete``: ``levels[i]`` up to ``max_step[i]``, then the last.

    ``len(levels) == len(max_step) + 1``; step ``t`` gets ``levels[i]`` for the first ``i``
    with ``t <= max_step[i]`` and ``levels[-1]`` after ``max_step[-1]``. (DeepSpeed calls
    ``levels`` "difficulty"; :func:`fixed_discrete` takes that name.)
    """

    levels: tuple[Number, ...]
    max_step: tuple[int, ...]

    def __post_init__(self) -> None:
        d, m = self.levels, self.max_step
        if len(d) != len(m) + 1 or not m:
            raise ValueError(
                f"fixed_discrete needs len(difficulty) == len(max_step) + 1 >= 2 (got "
                f"difficulty={list(d)}, max_step={list(m)}); the last difficulty holds after "
                "max_step[-1]"
            )
        for i, level in enumerate(d):
            _check_difficulty(f"difficulty[{i}]", level)
        if not _is_int(*m):
            raise TypeError(
                f"max_step must be ints (got {list(m)}); give the last step of each difficulty"
            )
        if any(b <= a for a, b in itertools.pairwise(m)) or m[0] < 0:
            raise ValueError(f"max_step must be non-negative and increasing (got {list(m)})")
        _check_step_limit("max_step[-1]", m[-1], MAX_STEP - 1)
        if any(b < a for a, b in itertools.pairwise(d)):
            raise ValueError(
                f"difficulty must be non-decreasing (got {list(d)}); the eligible pool only grows"
            )

    @property
    def saturation_step(self) -> int:
        return int(self.max_step[-1]) + 1

    def difficulties(self, steps: np.ndarray) -> np.ndarray:
        t = _check_steps(steps)
        table = np.asarray(self.levels)
        return table[np.searchsorted(np.asarray(self.max_step), t, side="left")]

    def difficulty(self, step: int) -> Number:
        return _scalar(self.difficulties(np.array([step])))


@dataclass(frozen=True, kw_only=True, slots=True)
class Custom:
    """A user function ``fn(step) -> difficulty``; it must be non-decreasing in the step.

    ``total_curriculum_step`` (the step after which ``fn`` no longer changes) is needed when the
    curriculum order precomputes when samples become eligible; without it ``fn`` is called on
    every step asked for.
    """

    fn: Callable[[int], Number] = field(repr=False)
    total_curriculum_step: int | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"custom(fn) needs a callable step -> difficulty (got {self.fn!r})")
        t = self.total_curriculum_step
        if t is not None and (not _is_int(t) or t < 0):
            raise ValueError(f"total_curriculum_step must be a non-negative int (got {t=})")
        if t is not None:
            _check_step_limit("total_curriculum_step", t)

    @property
    def saturation_step(self) -> int | None:
        return self.total_curriculum_step

    def difficulties(self, steps: np.ndarray) -> np.ndarray:
        t = _check_steps(steps)
        if self.total_curriculum_step is not None:
            t = np.minimum(t, self.total_curriculum_step)
        flat = t.ravel()
        values = [self.fn(int(s)) for s in flat]
        # refused where it is produced: a NaN threshold would gate silently, None fail later
        numbers = all(_is_number_type(kind) for kind in set(map(type, values)))
        out = np.asarray(values) if numbers else np.empty(0)
        if not numbers or (out.dtype.kind == "f" and not np.isfinite(out).all()):
            at = next(i for i, v in enumerate(values) if not _is_number(v) or not np.isfinite(v))
            error = ValueError if _is_number(values[at]) else TypeError
            raise error(
                f"custom schedule: fn({int(flat[at])}) returned {values[at]!r}, not a finite "
                "number; return the difficulty threshold at that step as an int or a float"
            )
        return out.reshape(t.shape)

    def difficulty(self, step: int) -> Number:
        return _scalar(self.difficulties(np.array([step])))


def fixed_root(
    min_difficulty: Number,
    max_difficulty: Number,
    total_curriculum_step: int,
    difficulty_step: Number = 1,
    root_degree: Number = 2,
) -> FixedRoot:
    """DeepSpeed's ``fixed_root`` pacing (see the module docstring for the formula)."""
    return FixedRoot(
        min_difficulty=min_difficulty,
        max_difficulty=max_difficulty,
        total_curriculum_step=total_curriculum_step,
        difficulty_step=difficulty_step,
        root_degree=root_degree,
    )


def fixed_linear(
    min_difficulty: Number,
    max_difficulty: Number,
    total_curriculum_step: int,
    difficulty_step: Number = 1,
) -> FixedRoot:
    """DeepSpeed's ``fixed_linear`` pacing: ``fixed_root`` with ``root_degree=1``."""
    return fixed_root(min_difficulty, max_difficulty, total_curriculum_step, difficulty_step, 1)


def fixed_discrete(*, difficulty: Sequence[Number], max_step: Sequence[int]) -> FixedDiscrete:
    """DeepSpeed's ``fixed_discrete`` pacing: ``difficulty[i]`` while ``step <= max_step[i]``."""
    steps = tuple(int(m) if _is_int(m) else m for m in max_step)  # numpy ints as ints
    return FixedDiscrete(levels=tuple(difficulty), max_step=steps)


def custom(fn: Callable[[int], Number], *, total_curriculum_step: int | None = None) -> Custom:
    """A schedule from any non-decreasing function ``step -> difficulty``."""
    return Custom(fn=fn, total_curriculum_step=total_curriculum_step)
