"""Packing of documents into bins of at most ``max_tokens`` tokens: best fit decreasing or first fit.

Packing is pure per window: the bins are a function of the window's lengths only, with no
state carried from one window to the next, so resuming a run needs nothing from here.
:func:`pack` packs one window; :func:`pack_windows` packs consecutive windows of a long list
(what :class:`~meshfeed.balance.PackedSamples` plans an epoch with).

>>> pack([5, 3, 4, 2], max_tokens=8)
[[0, 1], [2, 3]]
>>> packing_efficiency([5, 3, 4, 2], [[0, 1], [2, 3]], max_tokens=8)
0.875
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["PACKING_METHODS", "pack", "pack_windows", "packing_efficiency"]

#: ``"best_fit"``: best fit decreasing (longest first, into the fullest bin it fits);
#: ``"first_fit"``: in the given order, into the first open bin it fits (Grain's first fit).
PACKING_METHODS: tuple[str, ...] = ("best_fit", "first_fit")

#: The largest per-rank budget accepted (2**40 tokens): far above any memory, far below int64.
MAX_TOKENS_LIMIT = 2**40


def _check_budget(max_tokens: int) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
        raise TypeError(f"max_tokens must be an int (got {max_tokens!r})")
    if max_tokens < 1:
        raise ValueError(
            f"max_tokens must be positive (got {max_tokens=}); pass the per-rank budget"
        )
    if max_tokens > MAX_TOKENS_LIMIT:
        raise ValueError(
            f"max_tokens must be at most 2**40 tokens per rank and micro-step (got "
            f"{max_tokens=}); no accelerator holds more, and token counts beyond it overflow "
            "the int64 arithmetic of the schedule; pass the real per-rank budget"
        )
    return int(max_tokens)


def check_int(name: str, value: Any, *, low: int = 1, fix: str = "") -> None:
    """ValueError unless ``value`` is an int (not a bool, nor a float) of at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        kind = "a positive int" if low == 1 else f"an int >= {low}"
        raise ValueError(f"{name} must be {kind} (got {name}={value!r}){fix}")


def as_lengths(lengths: Any, name: str = "lengths") -> np.ndarray:
    """Validate document lengths into a 1-D int64 array (non-negative integers)."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must be 1-D (got shape {arr.shape}); pass one length per document"
        )
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    integral = np.issubdtype(arr.dtype, np.integer) or (
        np.issubdtype(arr.dtype, np.floating) and bool(np.all(arr == np.floor(arr)))
    )
    if not integral:
        raise TypeError(f"{name} must be integers (got dtype {arr.dtype})")
    arr = arr.astype(np.int64)
    if arr.min() < 0:
        raise ValueError(f"{name} must be >= 0 (got min {int(arr.min())}); lengths count tokens")
    return arr


def pack(lengths: Any, *, max_tokens: int, method: str = "best_fit") -> list[list[int]]:
    """Pack documents into bins of at most ``max_tokens`` tokens (see :data:`PACKING_METHODS`).

    Returns bins as lists of document indices, each list ascending. Best fit visits documents
    longest first (ties by index) and puts each in the fullest bin it fits in; first fit visits
    them in order and puts each in the first bin it fits in. Both are deterministic. Cost:
    O(n log n) plus a sorted-list insert per document (best fit), O(n x bins) in numpy (first fit).
    Raises ValueError if a document is longer than ``max_tokens`` (it needs context parallelism).
    """
    budget = _check_budget(max_tokens)
    arr = as_lengths(lengths)
    fit = _first_fit if check_method(method) == "first_fit" else _bfd
    return [sorted(b) for b in fit(arr, np.arange(arr.size), budget)]


def check_method(method: str) -> str:
    """``method`` if it is one of :data:`PACKING_METHODS`, else ValueError naming them."""
    if method not in PACKING_METHODS:
        raise ValueError(
            f"method={method!r} is not a packing method; use one of "
            f"{', '.join(map(repr, PACKING_METHODS))}"
        )
    return method


def pack_windows(
    weights: Any,
    *,
    budget: float,
    window: int,
    method: str = "best_fit",
    bounds: Any = None,
    carry: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack consecutive windows of ``window`` items into bins of total weight at most ``budget``.

    Item ``i`` is in window ``i // window`` (or, given ``bounds``, ascending item offsets from
    0 to ``len(weights)``, window ``k`` holds items ``bounds[k]:bounds[k + 1]``). Without
    ``carry`` no bin spans two windows, so the bins of a window are a pure function of that
    window's weights; with ``carry`` the emptiest bin of each window but the last is packed again
    with the next window (so only the last window leaves a partly filled bin behind), and the
    bins are a pure function of the weights up to their window. Weights may be token counts or
    any additive cost (floats). Returns CSR arrays ``(row_ptr, members)``: bin ``b`` holds items
    ``members[row_ptr[b]:row_ptr[b + 1]]`` (ascending), bins in window order, then in the
    order the method opened them.

    >>> pack_windows([5, 3, 4, 2, 7], budget=8, window=4)[0].tolist()
    [0, 2, 4, 5]
    """
    floats = np.issubdtype(np.asarray(weights).dtype, np.floating)
    w = np.asarray(weights, dtype=np.float64 if floats else np.int64)
    if w.ndim != 1 or (w.size and (w.min() < 0 or not np.all(np.isfinite(w)))):
        raise ValueError(f"weights must be a 1-D array of finite numbers >= 0 (got {w!r:.80})")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be a positive int of items (got {window=!r})")
    if not (np.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a positive number (got {budget=!r})")
    fit = _first_fit if check_method(method) == "first_fit" else _bfd
    edges = _window_edges(w.size, int(window), bounds)
    sizes: list[int] = []
    members: list[int] = []
    held = np.zeros(0, np.int64)
    last = len(edges) - 2
    for k, (lo, hi) in enumerate(itertools.pairwise(edges)):
        ids = np.concatenate([held, np.arange(lo, hi, dtype=np.int64)])
        bins = fit(w[ids], ids, budget)
        held = np.zeros(0, np.int64)
        if carry and k < last and bins:
            emptiest = min(range(len(bins)), key=lambda j: (float(w[bins[j]].sum()), j))
            held = np.asarray(sorted(bins.pop(emptiest)), dtype=np.int64)
        for b in bins:
            b.sort()
            sizes.append(len(b))
            members.extend(b)
    row_ptr = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=row_ptr[1:])
    return row_ptr, np.asarray(members, dtype=np.int64)


def _window_edges(n: int, window: int, bounds: Any) -> list[int]:
    if bounds is None:
        return [*range(0, n, window), n] if n else [0]
    edges = np.asarray(bounds, dtype=np.int64)
    if edges.ndim != 1 or edges.size < 1 or edges[0] != 0 or edges[-1] != n:
        raise ValueError(f"bounds must run from 0 to {n} items (got {edges.tolist()[:8]})")
    if np.any(np.diff(edges) < 0):
        raise ValueError("bounds must be ascending item offsets")
    return [int(e) for e in edges]


def _too_long(lengths: np.ndarray, ids: np.ndarray, budget: float) -> None:
    if lengths.size and lengths.max() > budget:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"document {int(ids[i])} has {lengths[i]} tokens > max_tokens={budget}; "
            "split it with context parallelism (balance.schedule_documents) or raise max_tokens"
        )


def _first_fit(lengths: np.ndarray, ids: np.ndarray, budget: float) -> list[list[int]]:
    """First fit of ``ids`` in their order into bins; bins in creation order."""
    _too_long(lengths, ids, budget)
    bins: list[list[int]] = []
    free = np.empty(lengths.size, dtype=np.float64)
    for s, i in zip(lengths.tolist(), ids.tolist(), strict=True):
        n = len(bins)
        k = int(np.argmax(free[:n] >= s)) if n else 0
        if n == 0 or free[k] < s:
            k = n
            bins.append([])
            free[k] = budget
        bins[k].append(i)
        free[k] -= s
    return bins


def _bfd(lengths: np.ndarray, ids: np.ndarray, budget: float) -> list[list[int]]:
    """BFD of ``ids`` (with token counts ``lengths``) into bins; bins in creation order."""
    _too_long(lengths, ids, budget)
    order = np.lexsort((ids, -lengths))
    bins: list[list[int]] = []
    # Sorted (remaining capacity, bin index) pairs; bisect finds the tightest bin that fits.
    free: list[tuple[int, int]] = []
    for s, i in zip(lengths[order].tolist(), ids[order].tolist(), strict=True):
        k = bisect.bisect_left(free, (s, -1))
        if k == len(free):
            bins.append([i])
            bisect.insort(free, (budget - s, len(bins) - 1))
        else:
            rem, b = free.pop(k)
            bins[b].append(i)
            bisect.insort(free, (rem - s, b))
    return bins


def packing_efficiency(lengths: Any, bins: Sequence[Sequence[int]], *, max_tokens: int) -> float:
    """Real tokens over capacity (``len(bins) * max_tokens``); 1.0 for no bins."""
    budget = _check_budget(max_tokens)
    arr = as_lengths(lengths)
    if not bins:
        return 1.0
    used = sum(int(arr[list(b)].sum()) for b in bins if len(b))
    return used / (len(bins) * budget)
