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

import functools
import itertools
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

__all__ = [
    "HORIZON",
    "MARK_EVERY",
    "MAX_PERIOD",
    "Interleave",
    "interleave_period",
    "make_interleave",
]

#: Largest period table built for the exact-period interleave.
MAX_PERIOD = 1 << 16
#: Prefix length up to which a rational reading of float weights must be indistinguishable.
HORIZON = 1 << 40
#: Above this many sources the tree search is skipped (it costs about 3**K).
_MAX_TREE_SEARCH = 8
#: float64 is trusted for ``N * t + 1/2`` only when the fraction is this far from an integer.
_FLOAT_MARGIN = 1e-3
#: The earliest-deadline interleave remembers its counts every this many positions.
MARK_EVERY = 1 << 16
#: At most this many marks are kept (then every second one is dropped) and this many seeds.
_MAX_MARKS = 1024
_MAX_SEEDS = 64
#: Carried counts this close to a known point are checked exactly (a walk); farther ones only
#: against the deviation bound, since a walk from the start would cost O(position).
_VERIFY_WALK = 1 << 18


def interleave_period(quotas: list[int]) -> np.ndarray:
    """One period of the quota-method interleave: the source of each of ``sum(quotas)`` slots.

    At slot ``n`` (1-based) the seat goes, among sources still under their upper quota
    (``n * q_s > c_s * M``), to the one with the largest ``q_s / (c_s + 1)`` (lowest index on
    ties). Every prefix then holds between ``floor`` and ``ceil`` of ``n * q_s / M`` of source s.
    """
    M, K = sum(quotas), len(quotas)
    out = np.empty(M, dtype=np.int32)
    counts = [0] * K
    for n in range(1, M + 1):
        best = -1
        for s in range(K):
            q = quotas[s]
            if (
                q
                and n * q > counts[s] * M
                and (best < 0 or q * (counts[best] + 1) > quotas[best] * (counts[s] + 1))
            ):
                best = s
        out[n - 1] = best
        counts[best] += 1
    return out


class Interleave:
    """Position -> source for fixed shares (see the module docstring); built by
    :func:`make_interleave`.

    ``counts(n)``: per-source counts among the first ``n`` positions. ``draws(p)``: for each
    position, its source and how many earlier positions belong to that source.
    """

    kind: str
    shares: list[Fraction]
    max_deviation: float

    def counts(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def check_counts(self, n: int, counts: Sequence[int]) -> str | None:
        """Why ``counts`` cannot be this interleave's counts at ``n`` (None: they can be)."""
        mine = self.counts(n).tolist()
        return None if list(counts) == mine else f"expected {mine}"

    def seed(self, n: int, counts: Sequence[int]) -> None:
        """Remember checked counts at ``n`` (from a checkpoint); arithmetic interleaves ignore it."""


class _Period(Interleave):
    def __init__(self, quotas: list[int], *, kind: str, max_deviation: float) -> None:
        self.kind = kind
        self.quotas = np.asarray(quotas, dtype=np.int64)
        self.period = int(self.quotas.sum())
        self.shares = [Fraction(q, self.period) for q in quotas]
        self.max_deviation = max_deviation
        self.src = interleave_period(quotas)
        self.rank = np.zeros(self.period, dtype=np.int64)
        self.slots: list[np.ndarray] = []
        for s in range(len(quotas)):
            where = np.flatnonzero(self.src == s)
            self.rank[where] = np.arange(len(where))
            self.slots.append(where)

    def counts(self, n: int) -> np.ndarray:
        full, rest = divmod(int(n), self.period)
        return full * self.quotas + np.array(
            [np.searchsorted(sl, rest) for sl in self.slots], dtype=np.int64
        )

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        full, rest = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        src = self.src[rest].astype(np.int64)
        return src, full * self.quotas[src] + self.rank[rest]


def _round_share(n: np.ndarray, t: Fraction) -> np.ndarray:
    """``floor(n * t + 1/2)`` elementwise, exact for any int64 ``n`` >= 0 and fraction ``t``."""
    num, den = t.numerator, t.denominator
    if n.size == 0:
        return n.copy()
    top = int(n.max())
    if 2 * top * num + den < (1 << 62):  # fits int64: exact integer arithmetic
        return (2 * n * num + den) // (2 * den)
    if top < (1 << 45):  # float64 is accurate to ~2**-8 here; recheck values near a boundary
        x = n.astype(np.float64) * (num / den) + 0.5
        out = np.floor(x).astype(np.int64)
        near = np.flatnonzero(np.abs(x - np.round(x)) < _FLOAT_MARGIN)
        for i in near.tolist():
            out[i] = (2 * int(n[i]) * num + den) // (2 * den)
        return out
    return np.array([(2 * int(v) * num + den) // (2 * den) for v in n.tolist()], dtype=np.int64)


# A tree is a leaf (source number) or (left, right, share of left within the node).
_Tree = int | tuple["_Tree", "_Tree", Fraction]


class _RoundingTree(Interleave):
    def __init__(self, shares: list[Fraction], tree: _Tree, bound: Fraction) -> None:
        self.kind = "tree"
        self.shares = shares
        self.tree = tree
        self.max_deviation = float(bound)

    def counts(self, n: int) -> np.ndarray:
        out = np.zeros(len(self.shares), dtype=np.int64)
        stack: list[tuple[_Tree, int]] = [(self.tree, int(n))]
        while stack:
            node, total = stack.pop()
            if isinstance(node, int):
                out[node] = total
                continue
            left, right, t = node
            k = (2 * total * t.numerator + t.denominator) // (2 * t.denominator)
            stack += [(left, k), (right, total - k)]
        return out

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = np.asarray(positions, dtype=np.int64).ravel()
        src = np.empty(p.shape, dtype=np.int64)
        rank = np.empty(p.shape, dtype=np.int64)
        # (node, where, count of the node before each position): position p is the
        # before-th item of the node; it goes left when the left count grows at it.
        stack: list[tuple[_Tree, np.ndarray, np.ndarray]] = [(self.tree, np.arange(p.size), p)]
        while stack:
            node, where, before = stack.pop()
            if isinstance(node, int):
                src[where], rank[where] = node, before
                continue
            left, right, t = node
            k0, k1 = _round_share(before, t), _round_share(before + 1, t)
            go_left = k1 > k0
            stack.append((left, where[go_left], k0[go_left]))
            stack.append((right, where[~go_left], (before - k0)[~go_left]))
        shape = np.shape(positions)
        return src.reshape(shape), rank.reshape(shape)


def _leaf_bounds(tree: _Tree, shares: Sequence[Fraction]) -> dict[int, Fraction]:
    """Per leaf, ``1/2 * (1 + sum of s_leaf / s_A over ancestors A below the root)``."""
    out: dict[int, Fraction] = {}

    def walk(node: _Tree, ancestors: list[Fraction]) -> None:
        if isinstance(node, int):
            out[node] = Fraction(1, 2) * (1 + sum((shares[node] / a for a in ancestors[1:]), 0))
            return
        left, right, _ = node
        total = _subtotal(node, shares)
        walk(left, [*ancestors, total])
        walk(right, [*ancestors, total])

    walk(tree, [])
    return out


def _subtotal(node: _Tree, shares: Sequence[Fraction]) -> Fraction:
    if isinstance(node, int):
        return shares[node]
    return _subtotal(node[0], shares) + _subtotal(node[1], shares)


def _best_tree(shares: list[Fraction], members: list[int]) -> _Tree:
    """A tree over ``members`` with a small deviation bound (exhaustive search up to 8 leaves).

    The search runs on floats and is only a heuristic: the bound of the tree it returns is
    computed exactly by :func:`_leaf_bounds`, and that is what is checked.
    """
    if len(members) > _MAX_TREE_SEARCH:
        return _greedy_tree(shares, members)

    def splits(subset: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        first, rest = subset[0], subset[1:]
        out = []
        for r in range(len(rest)):
            for pick in itertools.combinations(rest, r):
                out.append(((first, *pick), tuple(i for i in rest if i not in pick)))
        return out

    @functools.cache
    def solve(subset: tuple[int, ...]) -> tuple[_Tree, tuple[tuple[int, float], ...]]:
        # Per leaf: sum of s_leaf / s_A over the ancestors A within this subtree (its root too).
        if len(subset) == 1:
            return subset[0], ((subset[0], 0.0),)
        total = sum((shares[i] for i in subset), Fraction(0))
        best: tuple[float, _Tree, tuple[tuple[int, float], ...]] | None = None
        for left, right in splits(subset):
            (tl, cl), (tr, cr) = solve(left), solve(right)
            costs = tuple((i, c + float(shares[i] / total)) for i, c in (*cl, *cr))
            worst = max(c for _, c in costs)
            if best is None or worst < best[0]:
                best = (worst, _node(tl, tr, shares), costs)
        assert best is not None  # two or more leaves have at least one split
        return best[1], best[2]

    top: tuple[float, _Tree] | None = None
    for left, right in splits(tuple(members)):
        (tl, cl), (tr, cr) = solve(left), solve(right)
        worst = max(c for _, c in (*cl, *cr))
        if top is None or worst < top[0]:
            top = (worst, _node(tl, tr, shares))
    assert top is not None
    return top[1]


def _node(left: _Tree, right: _Tree, shares: Sequence[Fraction]) -> _Tree:
    share_left = _subtotal(left, shares)
    return (left, right, share_left / (share_left + _subtotal(right, shares)))


def _greedy_tree(shares: list[Fraction], members: list[int]) -> _Tree:
    if len(members) == 1:
        return members[0]
    ordered = sorted(members, key=lambda i: (-shares[i], i))
    left: list[int] = []
    right: list[int] = []
    sl = sr = Fraction(0)
    for i in ordered:
        if sl <= sr:
            left.append(i)
            sl += shares[i]
        else:
            right.append(i)
            sr += shares[i]
    return _node(_greedy_tree(shares, left), _greedy_tree(shares, right), shares)


def _simple_rationals(weights: list[Fraction]) -> list[Fraction] | None:
    """The weights as small-denominator shares if that is invisible within ``HORIZON``."""
    total = sum(weights, Fraction(0))
    exact = [w / total for w in weights]
    approx = [w.limit_denominator(10**6) for w in weights]
    if sum(approx, Fraction(0)) == 0:
        return None
    approx_total = sum(approx, Fraction(0))
    shares = [a / approx_total for a in approx]
    period = math.lcm(*(s.denominator for s in shares))
    if period > MAX_PERIOD:
        return None
    # The quota method stays within (n*s - 1 + 1/M, n*s + 1 - 1/M); the rational reading may
    # move n*s by at most HORIZON * |error| < 1/M, so the float shares hold within 1 too.
    if any(HORIZON * abs(s - e) * period >= 1 for s, e in zip(shares, exact, strict=True)):
        return None
    return shares


def _to_fraction(w: int | float) -> Fraction:
    return Fraction(w) if isinstance(w, int) else Fraction(float(w))


def make_interleave(weights: Sequence[int | float]) -> Interleave:
    """The interleave for non-negative, finite weights, not all zero (see the module doc)."""
    fracs = [_to_fraction(w) for w in weights]
    total = sum(fracs, Fraction(0))
    exact = [f / total for f in fracs]
    simple = _simple_rationals(fracs)
    if simple is not None:
        period = math.lcm(*(s.denominator for s in simple))
        return _Period(
            [int(s * period) for s in simple],
            kind="period",
            max_deviation=float(1 - Fraction(1, period)),
        )
    members = [i for i, s in enumerate(exact) if s > 0]
    if len(members) == 1:
        return _RoundingTree(exact, members[0], Fraction(0))
    tree = _best_tree(exact, members)
    bound = max(_leaf_bounds(tree, exact).values())
    if bound < 1:
        return _RoundingTree(exact, tree, bound)
    return _Deadline(exact)


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
        for pos, c in (self._cursor, *self._seeds.items()):
            if best[0] < pos <= n:
                best = (pos, c)
        mark = max(p for p in self._marks if p <= n)
        return (mark, self._marks[mark]) if mark > best[0] else best

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
            mine = self.counts(n).tolist()
            if c != mine:
                return f"expected {mine}"
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
            if (p + 1) % MARK_EVERY == 0:
                self._mark(p + 1, c)
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

    def _mark(self, pos: int, c: list[int]) -> None:
        """Remember the counts at ``pos`` unless known already."""
        if pos not in self._marks:
            self._remember(pos, self._full(c))

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
        want, inverse = np.unique(p.ravel(), return_inverse=True)
        src, rank = self._walk(want)
        return src[inverse].reshape(p.shape), rank[inverse].reshape(p.shape)
