"""Weighted interleaves: which source each stream position belongs to, within +-1 of its share.

An interleave of ``K`` sources with shares ``s_i`` (positive, summing to 1) gives every stream
position ``p`` one source, so that the count ``c_i(n)`` of source ``i`` among the first ``n``
positions stays close to ``n * s_i``. :func:`make_interleave` builds one from the weights:

- **Exact period** (weights that are simple fractions: 0.3, 1/3, 2:5:1, ...). The weights are
  read as rationals with denominators up to 10**6 when that changes each share by so little that
  it cannot show within :data:`HORIZON` positions; if their common denominator ``M`` is at most
  :data:`MAX_PERIOD`, one period is built once by the Balinski-Young quota method (the one
  house-monotone apportionment that always stays within quota) and any position is then answered
  from ``p // M`` and ``p % M``. Every prefix holds between ``floor`` and ``ceil`` of ``n * s_i``.
- **Rounding tree** (any other weights, for the exact float values, no period). Sources are the
  leaves of a binary tree; a node that holds ``N`` of the first ``n`` positions gives its left
  child ``round(N * t)`` of them (``t`` = the left child's share of the node, an exact fraction of
  Python integers), the right child the rest. Counts are monotone by construction, any prefix is
  O(K) integer arithmetic, a position's source is found by walking the tree once. The deviation
  ``|c_i(n) - n s_i|`` of a leaf is at most ``1/2 * (1 + sum over its ancestors A below the root
  of s_i / s_A)``, for every ``n`` (no drift, ever): below 1 for any weights with up to three
  sources, and for more sources whenever the best tree found keeps it below 1 (checked when the
  interleave is built; :attr:`Interleave.max_deviation` reports it).
- **Earliest deadline** (the rare rest: four or more sources whose best tree cannot prove the
  bound). Tijdeman's solution of the chairman assignment problem: with ``D = 1 - 1/(2K - 2)``,
  the ``j``-th draw of source ``i`` may take position ``t`` (1-based) once ``j - D <= t s_i`` and
  must by ``t <= (j - 1 + D) / s_i``; each position goes to the released source with the earliest
  deadline (lowest index on ties). Tijdeman proved ``|c_i(n) - n s_i| <= D < 1`` for every ``n``
  (no drift, ever), in exact integer arithmetic here. It is sequential: a count at ``n`` costs a
  walk from the nearest known point (a cursor, marks every :data:`MARK_EVERY` positions, and
  points seeded by :meth:`Interleave.seed` from a checkpoint), about 1 us per position (benchmarks/bench_mixture.py).

Floats are read exactly (``Fraction(0.1)``), so tiny weights (1e-7 beside 1) keep their share, a
mixture of only tiny weights cannot divide by zero, and huge integer weights are normalised as
integers (no ``OverflowError``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from meshfeed.order.distinct import distinct_inverse
from meshfeed.order.rational import (
    HORIZON,
    MAX_PERIOD,
    Interleave,
    _best_tree,
    _leaf_bounds,
    _Period,
    _RoundingTree,
    _simple_rationals,
    _to_fraction,
    interleave_period,
)

__all__ = [
    "HORIZON",
    "MARK_EVERY",
    "MAX_PERIOD",
    "Interleave",
    "interleave_period",
    "make_interleave",
]

#: The earliest-deadline interleave remembers its counts every this many positions.
MARK_EVERY = 1 << 16
#: At most this many marks are kept (then every second one is dropped) and this many seeds.
_MAX_MARKS = 1024
_MAX_SEEDS = 64
#: Carried counts this close to a known point are checked exactly (a walk); farther ones only
#: against the deviation bound, since a walk from the start would cost O(position).
_VERIFY_WALK = 1 << 18


def make_interleave(weights: Sequence[int | float]) -> Interleave:
    """The interleave for non-negative, finite weights, not all zero (see the module doc)."""
    whole = _whole_period(weights)
    if whole is not None:
        return whole
    fracs = [_to_fraction(w) for w in weights]
    total = sum(fracs, Fraction(0))
    exact = [f / total for f in fracs]
    simple = _simple_rationals(fracs, exact)
    if simple is not None:
        period = math.lcm(*(s.denominator for s in simple))
        return _Period([int(s * period) for s in simple])
    members = [i for i, s in enumerate(exact) if s > 0]
    if len(members) == 1:
        return _RoundingTree(exact, members[0], Fraction(0))
    tree = _best_tree(exact, members)
    bound = max(_leaf_bounds(tree, exact).values())
    if bound < 1:
        return _RoundingTree(exact, tree, bound)
    return _Deadline(exact)


def _whole_period(weights: Sequence[int | float]) -> Interleave | None:
    """Whole-number weights (10,000 equal ones, #32) straight to their period, skipping the
    O(sources) Fraction work: exactly the period the rational path finds (shares ``w / T``
    reduce to the period ``T / gcd`` with ``w / gcd`` draws of each)."""
    if not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in weights):
        return None
    ints = [int(w) for w in weights]
    g = math.gcd(*ints)
    if g == 0:
        return None  # all zero: the general path names the error
    counts = [w // g for w in ints]
    if sum(counts) > MAX_PERIOD:
        return None
    return _Period(counts)


class _Deadline(Interleave):
    """Earliest-deadline-first over unit jobs (Tijdeman); see the module docstring.

    Shares are exact: ``s_i = m_i / M`` in Python integers, every comparison cross-multiplied.
    With ``E = 2K - 2`` (``D = (E - 1) / E``), at 1-based position ``t`` source ``i`` with count
    ``c_i`` is released when ``(E c_i + 1) M <= t E m_i`` and its deadline is
    ``(E c_i + E - 1) / (E m_i)``. (A deadline of ``(j + D) / s_i`` instead breaks the bound.)
    """

    def __init__(self, shares: list[Fraction]) -> None:
        self.kind = "deadline"
        self.shares = shares
        self.members = [i for i, s in enumerate(shares) if s > 0]
        k = len(self.members)
        self.E = max(2 * k - 2, 1)
        self.D = Fraction(self.E - 1, self.E)
        self.max_deviation = float(self.D)
        self.M = math.lcm(*(shares[i].denominator for i in self.members))
        self.m = [int(shares[i] * self.M) for i in self.members]
        zero = (0,) * len(shares)
        self._cursor: tuple[int, tuple[int, ...]] = (0, zero)
        self._marks: dict[int, tuple[int, ...]] = {0: zero}
        self._seeds: dict[int, tuple[int, ...]] = {}

    # -------------------------------------------------------------- known points
    def _start(self, n: int) -> tuple[int, tuple[int, ...]]:
        """The latest known ``(position, counts)`` at or before ``n``."""
        best = (0, self._marks[0])
        for pos, c in (self._cursor, *self._seeds.items(), *self._marks.items()):
            if best[0] < pos <= n:
                best = (pos, c)
        return best

    def _remember(self, pos: int, counts: tuple[int, ...]) -> None:
        self._marks[pos] = counts
        if len(self._marks) > _MAX_MARKS:  # keep every second mark: spacing doubles
            keep = sorted(self._marks)[::2]
            self._marks = {p: self._marks[p] for p in keep}

    def check_bound(self, n: int, counts: Sequence[int]) -> str | None:
        """Why ``counts`` break the deviation bound at ``n`` (None: they keep it)."""
        c = [int(x) for x in counts]
        if len(c) != len(self.shares) or sum(c) != n or min(c, default=0) < 0:
            return f"they must be {len(self.shares)} non-negative counts summing to {n}"
        for ci, s in zip(c, self.shares, strict=True):
            if abs(ci - n * s) > self.D:
                return f"a count is more than {float(self.D):.4f} away from {n} x its share"
        return None

    def check_counts(self, n: int, counts: Sequence[int]) -> str | None:
        c = [int(x) for x in counts]
        why = self.check_bound(n, c)
        if why is not None:
            return why
        if n - self._start(n)[0] <= _VERIFY_WALK:  # cheap enough: check exactly
            return super().check_counts(n, c)
        return None

    def seed(self, n: int, counts: Sequence[int]) -> None:
        self._seeds[int(n)] = tuple(int(x) for x in counts)
        while len(self._seeds) > _MAX_SEEDS:
            del self._seeds[next(iter(self._seeds))]

    # -------------------------------------------------------------- the walk
    def _walk(self, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source and rank at each of the sorted, distinct positions ``want``."""
        src = np.empty(want.size, dtype=np.int64)
        rank = np.empty(want.size, dtype=np.int64)
        if want.size == 0:
            return src, rank
        end = int(want[-1]) + 1
        pos, full = self._start(int(want[0]))
        members, m, E, M = self.members, self.m, self.E, self.M
        c, em, slack, key = self._walk_state(pos, full)
        span = range(len(m))
        # The wanted positions from ``pos`` on, then -1: never equal to a position walked.
        w = int(np.searchsorted(want, pos))
        targets = [*want[w:].tolist(), -1]
        t = 0
        EM = E * M
        for p in range(pos, end):
            best = -1
            for i in span:
                slack[i] += em[i]
                if slack[i] >= 0 and (best < 0 or key[i] * m[best] < key[best] * m[i]):
                    best = i
            if best < 0:  # impossible from true counts (Tijdeman): the start was wrong
                raise ValueError(self._wrong_start(pos, p))
            if p == targets[t]:
                src[w + t], rank[w + t] = members[best], c[best]
                t += 1
            slack[best] -= EM
            key[best] += E
            c[best] += 1
            if (p + 1) % MARK_EVERY == 0 and p + 1 not in self._marks:
                self._remember(p + 1, self._full(c))
        self._finish_walk(pos, end, c)
        return src, rank

    def _walk_state(
        self, pos: int, full: tuple[int, ...]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Per member at position ``pos`` with counts ``full``: its count, ``E m_i``, its
        slack (>= 0 <=> released at the next position) and its key (key / m = deadline,
        times E)."""
        E, M = self.E, self.M
        c = [full[i] for i in self.members]
        em = [E * mi for mi in self.m]
        slack = [pos * emi - (E * ci + 1) * M for emi, ci in zip(em, c, strict=True)]
        key = [E * ci + E - 1 for ci in c]
        return c, em, slack, key

    def _finish_walk(self, start: int, end: int, c: list[int]) -> None:
        """Check the counts at ``end`` keep the bound (else the walk started from wrong
        counts) and move the cursor there."""
        full = self._full(c)
        if self.check_bound(end, full) is not None:
            raise ValueError(self._wrong_start(start, end))
        self._cursor = (end, full)

    def _wrong_start(self, start: int, at: int) -> str:
        return (
            f"the earliest-deadline interleave walked from counts at position {start} that are "
            f"not its own and broke its bound at position {at}; a checkpoint carried wrong "
            "per-source counts: resume from another checkpoint"
        )

    def _full(self, c: list[int]) -> tuple[int, ...]:
        out = [0] * len(self.shares)
        for i, ci in zip(self.members, c, strict=True):
            out[i] = ci
        return tuple(out)

    def counts(self, n: int) -> np.ndarray:
        n = int(n)
        pos, full = self._start(n)
        if pos < n:
            self._walk(np.array([n - 1], dtype=np.int64))
            pos, full = self._cursor
        return np.asarray(full, dtype=np.int64)

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = np.asarray(positions, dtype=np.int64)
        want, inverse = distinct_inverse(p)
        src, rank = self._walk(want)
        return src[inverse].reshape(p.shape), rank[inverse].reshape(p.shape)
