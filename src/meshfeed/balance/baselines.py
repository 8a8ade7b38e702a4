"""What users do instead of :func:`schedule_documents`, scored with the same cost model and lower bound.

- **naive slicing**: each rank takes an equal-count contiguous slice of the global batch (the
  default of every DP sampler) and packs it in order;
- **token balancing**: documents, longest first, go to the rank with the fewest tokens.

Both are scored generously: a document longer than ``max_tokens`` is priced as if one rank
could hold it (they have no context parallelism), and ranks pad to the same micro-step count.

>>> from meshfeed.balance.cost import CostModel
>>> naive_slicing([4, 4, 1, 1], num_ranks=2, max_tokens=8, cost=CostModel(quadratic=1.0)).makespan
32.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshfeed.balance.cost import CostModel
from meshfeed.balance.packing import _check_budget, as_lengths, check_int

__all__ = ["BaselineResult", "naive_slicing", "token_balancing"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselineResult:
    """Per-rank time, the step time (``makespan``), micro-steps per rank and packing efficiency."""

    rank_time: np.ndarray
    makespan: float
    num_microsteps: int
    packing_efficiency: float


def naive_slicing(
    lengths: Any, *, num_ranks: int, max_tokens: int, cost: CostModel
) -> BaselineResult:
    """Equal-count contiguous slices per rank, each packed next-fit in arrival order."""
    # Same contract as schedule_documents(): 0 would divide by zero, a bool or float would pass silently.
    check_int("num_ranks", num_ranks)
    s = as_lengths(lengths)
    # array_split: the first s.size % num_ranks slices hold one document more
    sizes = [part.size for part in np.array_split(s, num_ranks)]
    ranks = np.repeat(np.arange(num_ranks), sizes)
    return _score(s, ranks, num_ranks, _check_budget(max_tokens), cost, in_order=True)


def token_balancing(
    lengths: Any, *, num_ranks: int, max_tokens: int, cost: CostModel
) -> BaselineResult:
    """Longest document first to the rank holding the fewest tokens (LPT on tokens)."""
    check_int("num_ranks", num_ranks)
    s = as_lengths(lengths)
    ranks = np.zeros(s.size, dtype=np.int64)
    tokens = np.zeros(num_ranks, dtype=np.int64)
    for i in np.lexsort((np.arange(s.size), -s)).tolist():
        r = int(np.argmin(tokens))
        ranks[i] = r
        tokens[r] += s[i]
    return _score(s, ranks, num_ranks, _check_budget(max_tokens), cost, in_order=False)


def _score(
    s: np.ndarray, ranks: np.ndarray, n_ranks: int, budget: int, cost: CostModel, *, in_order: bool
) -> BaselineResult:
    work = np.bincount(ranks, weights=cost.work(s), minlength=n_ranks)
    steps = np.zeros(n_ranks, dtype=np.int64)
    for r in range(n_ranks):
        mine = s[ranks == r]
        if not in_order:
            mine = np.sort(mine)[::-1]
        steps[r] = _next_fit(mine, budget)
    k = max(1, int(steps.max(initial=0)))
    rank_time = work + cost.per_step * k
    return BaselineResult(
        rank_time=rank_time,
        makespan=float(rank_time.max(initial=0.0)),
        num_microsteps=k,
        packing_efficiency=float(s.sum()) / (n_ranks * k * budget),
    )


def _next_fit(lengths: np.ndarray, budget: int) -> int:
    """Micro-steps used by filling one at a time in order (an over-long document gets its own)."""
    bins, room = 0, 0
    for x in lengths.tolist():
        if x > room:
            bins, room = bins + 1, budget
        room = max(0, room - x)
    return bins
