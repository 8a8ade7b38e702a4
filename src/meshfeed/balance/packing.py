"""Best-fit-decreasing packing of documents into micro-steps of at most ``max_tokens`` tokens.

Packing is pure per window: the micro-steps are a function of the window's lengths only, with
no state carried from one window to the next, so resuming a run needs nothing from here.

>>> pack([5, 3, 4, 2], max_tokens=8)
[[0, 1], [2, 3]]
>>> packing_efficiency([5, 3, 4, 2], [[0, 1], [2, 3]], max_tokens=8)
0.875
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["pack", "packing_efficiency"]

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


def pack(lengths: Any, *, max_tokens: int) -> list[list[int]]:
    """Pack documents into bins of at most ``max_tokens`` tokens, best fit decreasing.

    Returns bins as lists of document indices, each list ascending. Documents are visited
    longest first (ties by index) and each goes to the fullest bin it fits in, so the result
    is deterministic. Cost: O(n log n) plus a sorted-list insert per document.
    Raises ValueError if a document is longer than ``max_tokens`` (it needs context parallelism).
    """
    budget = _check_budget(max_tokens)
    arr = as_lengths(lengths)
    return [sorted(b) for b in _bfd(arr, np.arange(arr.size), budget)]


def _bfd(lengths: np.ndarray, ids: np.ndarray, budget: int) -> list[list[int]]:
    """BFD of ``ids`` (with token counts ``lengths``) into bins; bins in creation order."""
    if lengths.size and int(lengths.max()) > budget:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"document {int(ids[i])} has {int(lengths[i])} tokens > max_tokens={budget}; "
            "split it with context parallelism (balance.schedule_documents) or raise max_tokens"
        )
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
