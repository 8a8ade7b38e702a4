"""The arithmetic interleaves (see :mod:`meshfeed.order.interleave`, which picks one): the
exact period of simple-fraction weights and the rounding tree of any other weights, and the
:class:`Interleave` that every interleave is.

Both answer any position or prefix count directly, with no walk: the period from ``p // M`` and
``p % M`` over one table built by the quota method (:func:`interleave_period`), the tree by
O(K) exact integer arithmetic.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

__all__ = ["HORIZON", "MAX_PERIOD", "Interleave", "interleave_period"]

#: Largest period table built for the exact-period interleave.
MAX_PERIOD = 1 << 16
#: Prefix length up to which a rational reading of float weights must be indistinguishable.
HORIZON = 1 << 40
#: Above this many sources the period table is built with heaps (the plain loop is O(M K)).
_HEAP_SOURCES = 16
#: Above this many sources the tree search is skipped (it costs about 3**K).
_MAX_TREE_SEARCH = 8
#: float64 is trusted for ``N * t + 1/2`` only when the fraction is this far from an integer.
_FLOAT_MARGIN = 1e-3


def interleave_period(quotas: list[int]) -> np.ndarray:
    """One period of the quota-method interleave: the source of each of ``sum(quotas)`` slots.

    At slot ``n`` (1-based) the seat goes, among sources still under their upper quota
    (``n * q_s > c_s * M``), to the one with the largest ``q_s / (c_s + 1)`` (lowest index on
    ties). Every prefix then holds between ``floor`` and ``ceil`` of ``n * q_s / M`` of source s.
    """
    if len(quotas) > _HEAP_SOURCES:
        return _interleave_period_heap(quotas)
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


def _interleave_period_heap(quotas: list[int]) -> np.ndarray:
    """:func:`interleave_period` in O(M log K) instead of O(M K): for many sources (a mixture
    of 10,000 corpora took a minute, #32). The same table: a source is waiting until its
    upper quota lets it in (it stays in until it is chosen), and the sources let in are a heap
    on ``(-q_s / (c_s + 1), s)``. The float is exact enough: ``q_s`` and ``c_s + 1`` are at
    most ``M <= MAX_PERIOD = 2**16``, so distinct ratios differ by far more than an ulp and
    equal ones round alike."""
    M = sum(quotas)
    if min(quotas) == max(quotas):  # equal weights: every source once per round, in order
        return np.tile(np.arange(len(quotas), dtype=np.int32), quotas[0])
    out = np.empty(M, dtype=np.int32)
    counts = [0] * len(quotas)
    waiting = [(1, s) for s, q in enumerate(quotas) if q]  # (first slot it may take, source)
    ready: list[tuple[float, int]] = []
    for n in range(1, M + 1):
        while waiting and waiting[0][0] <= n:
            s = heapq.heappop(waiting)[1]
            heapq.heappush(ready, (-quotas[s] / (counts[s] + 1), s))
        s = heapq.heappop(ready)[1]
        out[n - 1] = s
        counts[s] += 1
        # it may take slot n' once n' * q > c * M
        heapq.heappush(waiting, (counts[s] * M // quotas[s] + 1, s))
    return out


class Interleave:
    """Position -> source for fixed shares (see :mod:`meshfeed.order.interleave`); built by
    :func:`~meshfeed.order.interleave.make_interleave`.

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
    def __init__(self, quotas: list[int]) -> None:
        self.kind = "period"
        self.quotas = np.asarray(quotas, dtype=np.int64)
        self.period = int(self.quotas.sum())
        self.shares = [Fraction(q, self.period) for q in quotas]
        self.max_deviation = float(1 - Fraction(1, self.period))  # the quota method's bound
        self.src = interleave_period(quotas)
        # each slot's rank among its source's slots, from one stable sort (a pass per source
        # was O(K * M): 10,000 sources took 60 ms, #32); source s has quotas[s] slots
        firsts = np.zeros(len(quotas), dtype=np.int64)
        np.cumsum(self.quotas[:-1], out=firsts[1:])
        self.rank = np.empty(self.period, dtype=np.int64)
        self.rank[np.argsort(self.src, kind="stable")] = np.arange(
            self.period, dtype=np.int64
        ) - np.repeat(firsts, self.quotas)

    def counts(self, n: int) -> np.ndarray:
        full, rest = divmod(int(n), self.period)
        return full * self.quotas + np.bincount(self.src[:rest], minlength=len(self.quotas))

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
        total = _subtotal(node, shares)
        for child in node[:2]:
            walk(child, [*ancestors, total])

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


def _simple_rationals(weights: list[Fraction], exact: list[Fraction]) -> list[Fraction] | None:
    """The weights as small-denominator shares if that is invisible within ``HORIZON`` (beside
    the weights' ``exact`` shares)."""
    approx = [w.limit_denominator(10**6) for w in weights]
    approx_total = sum(approx, Fraction(0))
    if approx_total == 0:
        return None
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
