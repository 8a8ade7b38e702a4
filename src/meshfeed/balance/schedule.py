"""schedule_documents(): place variable-length documents on data x context-parallel ranks.

A pure numpy function: the same lengths give the same :class:`Placement` on every rank, so ranks
that all-gathered the lengths agree without talking again. Each document gets a CP degree
``c`` (chosen for memory *and* balance) and a block of ``c`` consecutive ranks; every rank gets
a list of micro-steps of at most ``max_tokens`` tokens, all ranks the same number.

The schedule, in one paragraph: documents too long or too expensive for one rank are placed
first, longest per-rank time first, each on the block of ranks that can finish it soonest (the
block's ranks wait for each other: that barrier is counted), sharing a micro-step with earlier
documents of the same CP group when their tokens fit. The other documents go, heaviest
first, to the rank that finishes earliest (LPT, with a heap), and each rank packs its documents
into micro-steps best fit decreasing. The CP degree is chosen by trying a few thresholds
("split a document whose cost exceeds theta x the mean rank load") and keeping the schedule
with the smallest makespan, preferring less context parallelism on ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshfeed.balance._candidates import Candidate, DegreeTable, Group, MicroStep, place_split
from meshfeed.balance.cost import CostModel
from meshfeed.balance.packing import _check_budget, as_lengths, check_int
from meshfeed.balance.zigzag import pad_unit

__all__ = ["DEFAULT_COST", "Placement", "schedule_documents"]

#: A 7B-class transformer (hidden 4096, 32 layers, 32 heads), training FLOPs.
DEFAULT_COST = CostModel.from_transformer(hidden_size=4096, num_layers=32, num_heads=32)

#: The largest balanced group: the schedule costs O(documents x ranks) on every rank per batch.
MAX_RANKS = 8192
#: The largest ``num_ranks * min_microsteps``: the placement lists every (rank, micro-step).
MAX_CELLS = 2**20

#: Split thresholds tried, as multiples of the mean rank load; inf = split for memory only.
_THETAS = (np.inf, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """The schedule of one global batch. Rank indices are positions in the balanced group.

    ``microsteps[r][k]`` is the tuple of ``(document id, cp group)`` rank ``r`` runs at micro-step
    ``k``; a cp group is the tuple of ranks that run the document together (``(r,)`` when it is
    not split), and every rank of a group holds the document at the same ``k``. A micro-step
    holds either split documents of one CP group or any number of unsplit ones. Per-document arrays give
    the same facts vectorised: ``cp_size``, ``cp_start`` (first rank of the group), ``microstep``
    and ``padded`` (length after padding to the zigzag multiple).
    """

    num_ranks: int
    max_tokens: int
    tp: int
    lengths: np.ndarray = field(repr=False)
    cp_size: np.ndarray = field(repr=False)
    cp_start: np.ndarray = field(repr=False)
    microstep: np.ndarray = field(repr=False)
    padded: np.ndarray = field(repr=False)
    microsteps: tuple[tuple[MicroStep, ...], ...] = field(repr=False)
    rank_time: np.ndarray = field(repr=False)
    makespan: float
    lower_bound: float

    @property
    def num_microsteps(self) -> int:
        """Micro-steps per rank (the same on every rank, empty ones included)."""
        return len(self.microsteps[0]) if self.microsteps else 0

    @property
    def imbalance(self) -> float:
        """``makespan / lower_bound - 1``: 0 means provably optimal (0 for an empty placement)."""
        return self.makespan / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    @property
    def packing_efficiency(self) -> float:
        """Real tokens over capacity (``num_ranks * num_microsteps * max_tokens``)."""
        capacity = self.num_ranks * self.num_microsteps * self.max_tokens
        return float(self.lengths.sum()) / capacity if capacity else 1.0

    def cp_group(self, doc: int) -> Group:
        """The ranks that run document ``doc``."""
        start = int(self.cp_start[doc])
        return tuple(range(start, start + int(self.cp_size[doc])))

    def tokens(self) -> np.ndarray:
        """Tokens (after padding) per rank and micro-step, shape ``(num_ranks, num_microsteps)``."""
        out = np.zeros((self.num_ranks, self.num_microsteps), dtype=np.int64)
        per_rank = self.padded // np.maximum(self.cp_size, 1)
        for j in range(int(self.cp_size.max(initial=1))):
            sel = self.cp_size > j
            np.add.at(out, (self.cp_start[sel] + j, self.microstep[sel]), per_rank[sel])
        return out


def schedule_documents(
    lengths: Any,
    *,
    num_ranks: int,
    max_tokens: int,
    cost: CostModel = DEFAULT_COST,
    cp_sizes: str | Sequence[int] = "any",
    tp: int = 1,
    min_microsteps: int = 1,
) -> Placement:
    """Schedule documents of the given lengths over ``num_ranks`` ranks (see the module doc).

    ``cp_sizes``: ``"any"`` (every degree 1..num_ranks, blocks anywhere), ``"pow2_aligned"``
    (powers of two on blocks aligned to their size, for Megatron / Transformer Engine), or an
    explicit sequence of allowed degrees including 1. ``tp`` > 1 pads split documents to a
    multiple of ``2*c*tp`` (sequence parallelism). Every rank gets at least ``min_microsteps``.
    Raises ValueError when a document cannot fit even on the largest allowed group, and up
    front for ``num_ranks > MAX_RANKS`` (8192), ``num_ranks * min_microsteps > 2**20`` or
    ``max_tokens > 2**40``: sizes whose schedule would take seconds per batch or overflow.
    Cost: 7-27 ms of CPU for 4,096 documents on 64 ranks (benchmarks/bench_balance.py).
    """
    budget = _check_budget(max_tokens)
    _check_sizes(num_ranks, tp, min_microsteps)
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a CostModel (got {type(cost).__name__})")
    n_ranks, tp = int(num_ranks), int(tp)
    s = as_lengths(lengths)
    work = cost.work(s)
    ps = float(cost.per_step)

    tables = [DegreeTable(s, sz, al, tp, budget) for sz, al in _candidate_sizes(cp_sizes, n_ranks)]
    largest = int(tables[0].sizes[-1])  # the first table allows every degree the caller does
    _check_documents_fit(tables[0], s, largest, budget, tp)

    k_min = max(int(min_microsteps), -(-int(s.sum()) // (n_ranks * budget)))
    mean_load = float(work.sum()) / n_ranks
    single = float(work.max(initial=0.0)) / largest + ps if s.size else 0.0
    lower = max(mean_load + ps * k_min, single)

    problem = _Problem(
        work=work, mean_load=mean_load, lower=lower, n_ranks=n_ranks, ps=ps, budget=budget
    )
    ranked = _ranked_candidates(tables, problem)
    best = _best_candidate(ranked, budget, ps, int(min_microsteps))
    return Placement(
        num_ranks=n_ranks,
        max_tokens=budget,
        tp=tp,
        lengths=s,
        cp_size=best.c,
        cp_start=best.cp_start,
        microstep=best.microstep,
        padded=best.padded,
        microsteps=best.microsteps(),
        rank_time=best.clock,
        makespan=best.makespan,
        lower_bound=lower,
    )


def _check_sizes(num_ranks: Any, tp: Any, min_microsteps: Any) -> None:
    check_int("num_ranks", num_ranks)
    if num_ranks > MAX_RANKS:
        raise ValueError(
            f"num_ranks must be at most {MAX_RANKS} (got {num_ranks=}): every rank schedules "
            "every global batch, at a cost that grows with documents x ranks (seconds beyond "
            "this size); balance within each DP x CP group of a replica or pipeline stage "
            "(one BalancedBatches per group) instead of over the whole job"
        )
    check_int("tp", tp, fix="; use 1 without sequence parallelism")
    check_int("min_microsteps", min_microsteps, low=0)
    if int(num_ranks) * int(min_microsteps) > MAX_CELLS:
        raise ValueError(
            f"num_ranks x min_microsteps must be at most 2**20 (got {num_ranks=}, "
            f"{min_microsteps=}): a placement lists every micro-step of every rank and is "
            "rebuilt on every rank for every global batch, so one this large is not a useful "
            "schedule; use fewer, larger micro-steps (raise max_tokens) or a smaller group"
        )


def _check_documents_fit(
    table: DegreeTable, s: np.ndarray, largest: int, budget: int, tp: int
) -> None:
    """Raise for the first document that does not fit on the largest allowed group."""
    bad = ~table.ok
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"document {i} has {int(s[i])} tokens, more than {largest} ranks x "
            f"max_tokens={budget} can hold (after padding to a multiple of "
            f"{pad_unit(largest, tp)}); raise max_tokens, add ranks, or truncate the document"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Problem:
    """What every candidate of one schedule is measured against: the documents' ``work``,
    its mean per rank, the ``lower`` bound on the makespan, the ranks, the per-step cost
    ``ps`` and the token ``budget`` per micro-step."""

    work: np.ndarray
    mean_load: float
    lower: float
    n_ranks: int
    ps: float
    budget: int

    def reached(self, estimate: float) -> bool:
        """Whether ``estimate`` is at the lower bound (no better candidate can exist)."""
        return estimate <= self.lower * (1 + 1e-3)


def _ranked_candidates(
    tables: list[DegreeTable], problem: _Problem
) -> list[tuple[float, int, Candidate]]:
    """Candidates ranked by a cheap estimate (split documents placed, the rest poured in as
    water), best first; stops early once one reaches the lower bound."""
    ranked: list[tuple[float, int, Candidate]] = []
    for table in tables:
        if not table.ok.all():
            continue
        _add_table_candidates(table, ranked, problem)
        if ranked and problem.reached(min(r[0] for r in ranked)):
            break
    ranked.sort(key=lambda r: (r[0], r[1]))
    return ranked


def _add_table_candidates(
    table: DegreeTable, ranked: list[tuple[float, int, Candidate]], p: _Problem
) -> None:
    """Append the table's distinct candidates (one per split threshold) to ``ranked``."""
    seen: list[np.ndarray] = []
    for theta in _THETAS:
        idx = table.degrees(p.work, theta * p.mean_load)
        if any(np.array_equal(idx, prev) for prev in seen):
            continue
        seen.append(idx)
        c, padded = table.sizes[idx], table.padded(idx)
        sched = place_split(p.work, c, padded, p.n_ranks, p.ps, table.aligned, p.budget)
        ranked.append((sched.estimate(p.budget, p.ps), len(ranked), sched))
        if p.reached(ranked[-1][0]):
            break


def _best_candidate(
    ranked: list[tuple[float, int, Candidate]], budget: int, ps: float, min_microsteps: int
) -> Candidate:
    """Of the best two ranked candidates, the one with the shorter full schedule, packed.

    Only the best two get the full LPT, and only the winner is packed (unless per_step makes
    packing part of the makespan)."""
    exact = ps > 0
    best: Candidate | None = None
    for _, _, sched in ranked[:2]:
        sched.assign_unsplit(budget, ps)
        if exact:
            sched.pack(budget, ps, min_microsteps)
        # Prefer the earlier (less split) candidate unless the later one is clearly better.
        if best is None or sched.makespan < best.makespan * (1 - 1e-3):
            best = sched
    assert best is not None  # the first table always fits (checked above)
    if not exact:
        best.pack(budget, ps, min_microsteps)
    return best


def _candidate_sizes(cp_sizes: str | Sequence[int], n: int) -> list[tuple[np.ndarray, bool]]:
    """Allowed degree sets to try, widest first; ``True`` marks blocks aligned to their size."""
    if isinstance(cp_sizes, str):
        if cp_sizes == "any":
            # Degrees that divide n, on aligned blocks, tile the ranks without gaps: often the
            # best schedule when a few documents dominate, so they are tried as well.
            divisors = np.asarray([d for d in range(1, n + 1) if n % d == 0], dtype=np.int64)
            return [(np.arange(1, n + 1, dtype=np.int64), False), (divisors, True)]
        if cp_sizes == "pow2_aligned":
            return [(1 << np.arange(n.bit_length(), dtype=np.int64), True)]
        raise ValueError(
            f"cp_sizes={cp_sizes!r} is not a policy; use 'any', 'pow2_aligned' or a list of degrees"
        )
    if any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in cp_sizes):
        raise TypeError(
            f"cp_sizes={list(cp_sizes)!r} must hold int CP degrees; e.g. cp_sizes=[1, 2, 4]"
        )
    sizes = sorted({int(c) for c in cp_sizes})
    if not sizes or sizes[0] != 1 or sizes[-1] > n:
        raise ValueError(
            f"cp_sizes={list(cp_sizes)!r} must include 1 and stay <= num_ranks={n}; "
            "e.g. cp_sizes=[1, 2, 4]"
        )
    return [(np.asarray(sizes, dtype=np.int64), False)]
