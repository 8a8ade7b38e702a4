"""The machinery behind :func:`meshfeed.balance.schedule_documents`: degree tables, placement, LPT, packing.

Private: :mod:`meshfeed.balance.schedule` chooses among candidate schedules built here. A schedule
is built in three passes so candidates stay cheap: :func:`place_split` puts the documents
split over several ranks on blocks (arrays only), :meth:`Candidate.assign_unsplit` gives the
rest to ranks by LPT, and :meth:`Candidate.pack` packs micro-steps for the winner only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

from meshfeed.balance.packing import _bfd
from meshfeed.balance.zigzag import padded_length

Group = tuple[int, ...]
MicroStep = tuple[tuple[int, Group], ...]


class DegreeTable:
    """The smallest allowed CP degree of every document that fits memory, and padded lengths."""

    def __init__(self, s: np.ndarray, sizes: np.ndarray, aligned: bool, tp: int, budget: int):
        self.s, self.sizes, self.aligned, self.tp, self.budget = s, sizes, aligned, tp, budget
        # A rank holds at least s / c tokens, so no degree below ceil(s / budget) fits; padding
        # can push a document over, so step up until it fits (a few rounds at most).
        idx = np.searchsorted(sizes, -(-s // budget))
        while True:
            rows = np.flatnonzero(idx < sizes.size)
            over = rows[~self._fits(rows, idx[rows])]
            if over.size == 0:
                break
            idx[over] += 1
        self.ok = idx < sizes.size
        self.min_idx = np.minimum(idx, sizes.size - 1)

    def padded(self, idx: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        s = self.s if rows is None else self.s[rows]
        return padded_length(s, self.sizes[idx], self.tp)

    def _fits(self, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return self.padded(idx, rows) // self.sizes[idx] <= self.budget

    def degrees(self, work: np.ndarray, target: float) -> np.ndarray:
        """Index of the smallest degree that fits memory and brings work/c under ``target``."""
        if not np.isfinite(target) or target <= 0:
            return self.min_idx
        need = np.ceil(work / target)
        idx = np.minimum(np.searchsorted(self.sizes, need), self.sizes.size - 1)
        idx = np.maximum(self.min_idx, idx)
        # Tiny budgets: padding can make a wider split overflow; keep the memory choice.
        return np.where(self._fits(np.arange(idx.size), idx), idx, self.min_idx)


@dataclass(slots=True)
class Candidate:
    c: np.ndarray
    padded: np.ndarray
    work: np.ndarray
    cp_start: np.ndarray
    microstep: np.ndarray
    count: np.ndarray  # micro-steps per rank taken by split documents (and alignment)
    mine: list[list[int]]
    clock: np.ndarray
    makespan: float
    packed: bool = False
    steps: list[list[list[int]]] = field(default_factory=list)

    def _unsplit_load(self, budget: int, ps: float) -> tuple[np.ndarray, np.ndarray]:
        small = np.flatnonzero(self.c == 1)
        return small, self.work[small] + ps * self.padded[small] / budget

    def estimate(self, budget: int, ps: float) -> float:
        """Makespan if the unsplit work were poured like water onto the least busy ranks."""
        _, eff = self._unsplit_load(budget, ps)
        level = np.sort(self.clock)
        # Water level L solves sum(max(0, L - clock)) = total unsplit work.
        fill = np.arange(1, level.size + 1) * level - np.cumsum(level)
        j = int(np.searchsorted(fill, float(eff.sum()), side="right"))
        water = (float(eff.sum()) + level[:j].sum()) / j
        # No rank can start the heaviest unsplit document before the earliest one is free.
        heaviest = float(eff.max(initial=0.0)) + float(level[0])
        return max(float(level[-1]), water, heaviest)

    def assign_unsplit(self, budget: int, ps: float) -> None:
        """LPT: the heaviest unsplit document goes to the rank that frees up first."""
        small, eff = self._unsplit_load(budget, ps)
        order = np.lexsort((small, -eff))
        heap = [(float(t), r) for r, t in enumerate(self.clock)]
        heapq.heapify(heap)
        for i, e in zip(small[order].tolist(), eff[order].tolist(), strict=True):
            t, r = heap[0]
            self.mine[r].append(i)
            heapq.heapreplace(heap, (t + e, r))
        for r, docs in enumerate(self.mine):
            if docs:
                self.clock[r] += float(self.work[docs].sum())
        self.makespan = float(self.clock.max(initial=0.0))

    def pack(self, budget: int, ps: float, min_microsteps: int) -> None:
        """Pack each rank's unsplit documents into micro-steps; equalise micro-step counts."""
        if self.packed:
            return
        self.packed = True
        clock = self.clock
        steps: list[list[list[int]]] = [[[] for _ in range(k)] for k in self.count.tolist()]
        for i in np.flatnonzero(self.c > 1).tolist():
            r0, k = int(self.cp_start[i]), int(self.microstep[i])
            for r in range(r0, r0 + int(self.c[i])):
                steps[r][k].append(i)
        for r, docs in enumerate(self.mine):
            if not docs:
                continue
            ids = np.asarray(docs, dtype=np.int64)
            bins = _bfd(self.padded[ids], ids, budget)
            base = len(steps[r])
            for j, b in enumerate(bins):
                b.sort()
                self.microstep[b] = base + j
                steps[r].append(b)
            self.cp_start[ids] = r
            clock[r] += ps * len(bins)
        # Equal micro-step counts: pad with empty micro-steps, which still cost per_step.
        k_total = max(min_microsteps, max((len(st) for st in steps), default=0))
        for r, st in enumerate(steps):
            clock[r] += ps * (k_total - len(st))
            st.extend([] for _ in range(k_total - len(st)))
        self.steps = steps
        self.makespan = float(clock.max(initial=0.0))

    def microsteps(self) -> tuple[tuple[MicroStep, ...], ...]:
        groups = {
            int(i): tuple(range(int(self.cp_start[i]), int(self.cp_start[i] + self.c[i])))
            for i in np.flatnonzero(self.c > 1)
        }
        return tuple(
            tuple(tuple((i, groups.get(i, (r,))) for i in step) for step in steps)
            for r, steps in enumerate(self.steps)
        )


def place_split(
    work: np.ndarray,
    c: np.ndarray,
    padded: np.ndarray,
    n_ranks: int,
    ps: float,
    aligned: bool,
    budget: int,
) -> Candidate:
    """Place every split document on the block of ranks that finishes it soonest.

    A document either opens a new micro-step on a block (its ranks wait for each other) or
    joins the last micro-step of a block with exactly its CP group, if the tokens fit and it
    finishes no later: long documents on wide groups hold few tokens per rank, so several
    share one micro-step instead of each paying a micro-step of their own.
    """
    n = work.size
    clock = np.zeros(n_ranks)
    count = np.zeros(n_ranks, dtype=np.int64)
    rank_ids = np.arange(n_ranks)
    # The CP group (first rank, size) of each rank's last micro-step, and its tokens per rank.
    last_start = np.full(n_ranks, -1, dtype=np.int64)
    last_size = np.zeros(n_ranks, dtype=np.int64)
    last_tokens = np.zeros(n_ranks, dtype=np.int64)
    cp_start = np.zeros(n, dtype=np.int64)
    microstep = np.zeros(n, dtype=np.int64)
    dur = work / c
    big = np.flatnonzero(c > 1)
    for i in big[np.lexsort((big, -dur[big]))].tolist():
        ci = int(c[i])
        # A rank behind on micro-steps pads with empty ones (ps each) to align the index.
        key = clock - count * ps
        if aligned:
            span = (n_ranks // ci) * ci
            kmax = key[:span].reshape(-1, ci).max(axis=1)
            cmax = count[:span].reshape(-1, ci).max(axis=1)
            busy = clock[:span].reshape(-1, ci).sum(axis=1)
            starts = np.arange(0, span, ci)
        else:
            kmax = _sliding_max(key, ci)
            cmax = _sliding_max(count, ci)
            csum = np.concatenate([[0.0], np.cumsum(clock)])
            busy = csum[ci:] - csum[:-ci]
            starts = np.arange(n_ranks - ci + 1)
        begin = kmax + ps * cmax
        idle = ci * begin - busy  # prefer the block that wastes least waiting
        b = int(np.lexsort((idle, begin))[0])
        finish = float(begin[b]) + float(dur[i]) + ps
        tokens = int(padded[i]) // ci
        join = -1
        # Blocks of exactly this group whose last micro-step has room: a head h is still
        # intact when all ci ranks it wrote still hold (h, ci) (vectorised; O(ranks) per doc).
        heads = np.flatnonzero(
            (last_size == ci) & (last_start == rank_ids) & (last_tokens + tokens <= budget)
        )
        if heads.size:
            same = last_size == ci
            held = np.bincount(last_start[same], minlength=n_ranks)
            heads = heads[held[heads] == ci]
            joined = clock[heads] + dur[i]
            fits = np.flatnonzero(joined <= finish)
            if fits.size:
                best = joined[fits].min()
                last = fits[joined[fits] == best][-1]  # ties: the last block, as before
                finish, join = float(joined[last]), int(heads[last])
        if join >= 0:
            clock[join : join + ci] = finish
            last_tokens[join] += tokens
            cp_start[i], microstep[i] = join, int(count[join]) - 1
            continue
        r0, k = int(starts[b]), int(cmax[b])
        clock[r0 : r0 + ci] = finish
        count[r0 : r0 + ci] = k + 1
        last_start[r0 : r0 + ci], last_size[r0 : r0 + ci] = r0, ci
        last_tokens[r0] = tokens
        cp_start[i], microstep[i] = r0, k
    return Candidate(
        c=c.astype(np.int64),
        padded=padded.astype(np.int64),
        work=work,
        cp_start=cp_start,
        microstep=microstep,
        count=count,
        mine=[[] for _ in range(n_ranks)],
        clock=clock,
        makespan=float(clock.max(initial=0.0)),
    )


def _sliding_max(x: np.ndarray, width: int) -> np.ndarray:
    """``max(x[i : i + width])`` for every start ``i``, in O(n log width) (doubling).

    ``m`` holds maxima over runs of ``span`` elements; doubling ``span`` up to the largest power
    of two <= width, two overlapping runs cover any window. Exact (max does not round), so it
    equals the naive windows while a few wide CP groups on many ranks stay cheap.
    """
    m, span = x, 1
    while span * 2 <= width:
        m = np.maximum(m[:-span], m[span:])
        span *= 2
    return np.maximum(m[: x.size - width + 1], m[width - span :])


def _windows(x: np.ndarray, width: int) -> np.ndarray:
    """Read-only view of every run of ``width`` consecutive elements (no copy, no checks)."""
    step = x.strides[0]
    return as_strided(x, shape=(x.size - width + 1, width), strides=(step, step), writeable=False)
