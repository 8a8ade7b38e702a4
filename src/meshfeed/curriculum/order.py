"""The difficulty-gated order: a growing pool walked so every eligible sample comes before a repeat.

Input: the pool order ``pool_order`` (dataset indices) and, for each, the first global step at
which it is eligible, ``entry_steps`` (non-decreasing). The pool at step ``t`` is therefore the
prefix ``pool_order[:P(t)]`` with ``P(t) = searchsorted(entry_steps, t, "right")``: O(log N)
per difficulty change, whatever the number of metrics.

The global positions ``g = epoch * samples_per_epoch + position`` are cut into *rounds*. A round
starts with the pool of its first step and walks a fresh :class:`Permutation` of it; when it is
done, the samples that joined meanwhile are walked next (a *catch-up* segment, again
permuted), until no eligible sample is left unused: only then does the next round start. So
a sample is repeated only after every sample eligible at that moment has been used since its
last use. Consecutive rounds over an unchanged pool are stored as one segment with a repeat
count, and the last segment (the final pool) repeats forever, so the segment table holds at most
about two rows per distinct pool size. It depends on ``(pool sizes, global batch size)`` only,
so it is built once; every position is then a pure function of ``(seed, epoch, position)``:
one ``searchsorted`` over the segments and one Feistel permutation per batch, O(batch) numpy
work independent of N.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from meshfeed.order.permutation import Permutation, derive_seed

__all__ = ["GatedOrder"]

_OP = 0xC022  # keeps the curriculum's permutation seeds apart from other uses of the seed
_FOREVER = 1 << 62


class GatedOrder:
    """Maps global sample positions to dataset indices for a pool that grows with the step.

    ``describe(epoch, position)`` reports the step of the last batch returned before
    ``position`` (the loader's cursor), its difficulties and pool size.
    """

    def __init__(
        self,
        *,
        pool_order: np.ndarray,
        entry_steps: np.ndarray,
        global_batch_size: int,
        samples_per_epoch: int,
        seed: int,
        difficulties: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        if global_batch_size < 1 or samples_per_epoch < 1:
            raise ValueError(
                f"need global_batch_size >= 1 and samples_per_epoch >= 1 (got "
                f"{global_batch_size=}, {samples_per_epoch=})"
            )
        if len(pool_order) != len(entry_steps) or len(pool_order) == 0:
            raise ValueError(
                f"pool_order and entry_steps must be non-empty and of equal length (got "
                f"{len(pool_order)} and {len(entry_steps)})"
            )
        if int(entry_steps[0]) > 0:
            raise ValueError(
                f"no sample is eligible at step 0 (the first enters at step {int(entry_steps[0])})"
                "; lower min_difficulty so that training can start"
            )
        self.pool_order = pool_order
        self.entry_steps = np.asarray(entry_steps)
        self.global_batch_size = int(global_batch_size)
        self.samples_per_epoch = int(samples_per_epoch)
        self.seed = int(seed)
        self._difficulties = difficulties
        self._segments = self._build_segments()
        self._cache: dict[tuple[int, int], Permutation] = {}

    def pool_size(self, step: int) -> int:
        """How many samples are eligible at global ``step`` (O(log N))."""
        return int(np.searchsorted(self.entry_steps, step, side="right"))

    def _build_segments(self) -> np.ndarray:
        g_size = self.global_batch_size
        final = len(self.entry_steps)
        rows: list[tuple[int, int, int, int]] = []  # (start position, first rank, size, repeats)
        g, used = 0, 0
        while True:
            high = self.pool_size(g // g_size)
            if used and high > used:  # samples joined during this round: walk them first
                rows.append((g, used, high - used, 1))
                g, used = g + high - used, high
            elif used == 0 or high == used:  # a new round over the whole current pool
                if high == final:
                    rows.append((g, 0, high, _FOREVER))
                    break
                change = int(self.entry_steps[high]) * g_size  # first position with a bigger pool
                reps = max(1, -(-(change - g) // high))
                rows.append((g, 0, high, reps))
                g, used = g + reps * high, high
        return np.asarray(rows, dtype=np.int64)

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def epoch_length(self, epoch: int) -> int:
        return self.samples_per_epoch

    def global_position(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if epoch < 0 or (
            positions.size and (positions.min() < 0 or positions.max() >= self.samples_per_epoch)
        ):
            raise IndexError(
                f"positions must lie in [0, {self.samples_per_epoch}) and epoch >= 0 (got "
                f"{epoch=}, positions in [{positions.min()}, {positions.max()}])"
            )
        return epoch * self.samples_per_epoch + positions

    def step(self, epoch: int, position: int) -> int:
        """The global curriculum step of the batch holding ``position`` of ``epoch``."""
        return (epoch * self.samples_per_epoch + int(position)) // self.global_batch_size

    def _perm(self, seg: int, rep: int, size: int) -> Permutation:
        key = (seg, rep)
        perm = self._cache.get(key)
        if perm is None:
            if len(self._cache) > 64:
                self._cache.clear()
            perm = self._cache[key] = Permutation(size, derive_seed(self.seed, _OP, seg, rep))
        return perm

    def ranks(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Ranks into ``pool_order`` (the pool is ``[0, pool_size)``) for ``positions``."""
        g = self.global_position(epoch, positions)
        flat = g.ravel()
        seg_rows = self._segments
        seg = np.searchsorted(seg_rows[:, 0], flat, side="right") - 1
        start, size = seg_rows[seg, 0], seg_rows[seg, 2]
        offset = flat - start
        rep, within = np.divmod(offset, size)
        out = np.empty_like(flat)
        # A batch nearly always falls in one or two (segment, round) groups; 1-D uniques are
        # far cheaper than np.unique(axis=0) on pairs.
        for s in np.unique(seg).tolist():
            in_seg = seg == s
            for r in np.unique(rep[in_seg]).tolist():
                mask = in_seg & (rep == r)
                perm = self._perm(s, r, int(seg_rows[s, 2]))
                out[mask] = int(seg_rows[s, 1]) + perm[within[mask]]
        return out.reshape(g.shape)

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) at ``positions`` of ``epoch``: a pure function."""
        return np.asarray(self.pool_order[self.ranks(epoch, positions)], dtype=np.int64)

    def describe(self, epoch: int, position: int) -> dict[str, Any]:
        step = self.step(epoch, position) - 1
        at = max(step, 0)
        return {
            "version": 1,
            "step": step,
            "pool_size": self.pool_size(at),
            "difficulty": self._difficulties(at) if self._difficulties else {},
        }
