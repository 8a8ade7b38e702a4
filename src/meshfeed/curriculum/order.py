"""The difficulty-gated order: a growing pool that is honoured at once, with no early repeats.

Input: the pool order ``pool_order`` (dataset indices) and, for each, the first curriculum step
at which it is eligible, ``entry_steps`` (non-decreasing). The pool at curriculum step ``t`` is
the prefix ``pool_order[:P(t)]`` with ``P(t) = searchsorted(entry_steps, t, "right")``: O(log N)
per difficulty change, whatever the number of metrics. Global batch ``b`` is curriculum step
``b + first_step`` (``first_step=1`` is DeepSpeed's sampler, which increments before it samples).

The global positions ``g = epoch * samples_per_epoch + position`` are cut into *rounds*, each
over a set of pool ranks:

- a *fresh* round walks a seeded permutation of the whole current pool ``[0, P)``; it starts
  at position 0 and whenever the previous round was used up before the pool grew;
- when the pool grows (at a global batch boundary) in the middle of a round, that round stops
  (or ends exactly there) and a *continuation* round starts over its unused rest plus the newly
  eligible ranks. So a new sample can be drawn in the very batch at which it becomes eligible
  (the schedule never lags), and still no sample repeats before every sample eligible at that
  moment has been used.

A continuation places its new ranks evenly among its positions (in their own permuted order,
so every batch after a change draws new samples in proportion to their number, as DeepSpeed's
cluster sampling does on average) and fills the other positions by continuing the stopped round
from where it stopped; a chain of continuations is as long as the number of pool changes since
the last fresh round, and each level costs a few integer operations. Consecutive
fresh rounds over an unchanged pool are one table row with a repeat count, and the final pool
repeats forever, so the table has at most three rows per pool change. It depends on the pool
sizes and the global batch size only, so it is built once; every position is then a pure
function of ``(seed, epoch, position)``: one permutation per rank plus O(chain) integer steps,
independent of N, and a resume anywhere costs the same.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from meshfeed.mapped import check_mapped
from meshfeed.order.permutation import derive_seed, splitmix64
from meshfeed.protocols import OrderBase
from meshfeed.state import envelope, open_envelope

__all__ = ["ORDER_VERSION", "GatedOrder"]

_OP = 0xC022  # keeps the curriculum's permutation seeds apart from other uses of the seed
_FOREVER = 1 << 62
#: Version of the facts a GatedOrder records (2: pool changes start continuation rounds).
ORDER_VERSION = 2


def _mul_div(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a * b // c`` elementwise, exact also where ``a * b`` exceeds int64."""
    if a.size == 0:
        return a.copy()
    if int(a.max()) * int(b.max()) < (1 << 62):
        return a * b // c
    return np.array(
        [
            int(p) * int(q) // int(r)
            for p, q, r in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)
        ],
        dtype=np.int64,
    )


_ROUNDS = 6
_ONE = np.uint64(1)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@functools.lru_cache(maxsize=4096)
def _round_keys(seed: int, row: int, rep: int) -> tuple[int, ...]:
    base = derive_seed(seed, _OP, row, rep)
    return tuple(splitmix64(derive_seed(base, r)) for r in range(_ROUNDS))


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> _S30)) * _C1
    x = (x ^ (x >> _S27)) * _C2
    return x ^ (x >> _S31)


def _feistel(x: np.ndarray, n: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Per element, a bijection of ``range(n)``: a Feistel network over the smallest power of
    two >= n (keys per element, unbalanced halves) with cycle walking back into range."""
    # bit_length(n - 1), exact through float64 for the pool sizes here (n < 2**53).
    bits = np.frexp((n - _ONE).astype(np.float64))[1].astype(np.uint64)
    bits = np.maximum(bits, np.uint64(2))
    wl0 = bits // np.uint64(2)
    wr0 = bits - wl0

    def encrypt(v: np.ndarray, wl: np.ndarray, wr: np.ndarray, k: np.ndarray) -> np.ndarray:
        left, right = v >> wr, v & ((_ONE << wr) - _ONE)
        for r in range(_ROUNDS):
            f = _mix(right ^ k[:, r]) & ((_ONE << wl) - _ONE)
            left, right = right, left ^ f
            wl, wr = wr, wl
        return (left << wr) | right

    y = encrypt(x, wl0, wr0, keys)
    out = np.flatnonzero(y >= n)
    while out.size:
        y[out] = encrypt(y[out], wl0[out], wr0[out], keys[out])
        out = out[y[out] >= n[out]]
    return y


#: Fewer positions than this per run of consecutive ones (on average): walked one by one.
_RUN_MIN = 10


class _Pieces:
    """What a range walk found: per position, its round, repeat, offset in that round's
    permutation, where it goes in the output, and what is added to the permuted offset."""

    __slots__ = ("at", "base", "offsets", "reps", "rows")

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.reps: list[int] = []
        self.offsets: list[int] = []
        self.at: list[Sequence[int]] = []
        self.base: list[int] = []

    def add(self, row: int, rep: int, first: int, at: Sequence[int], base: int) -> None:
        """Offsets ``first, first + 1, ...`` of round ``(row, rep)`` go to ``at``."""
        self.rows.append(row)
        self.reps.append(rep)
        self.offsets.append(first)
        self.at.append(at)
        self.base.append(base)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per position: its piece, its offset in that piece's round and its output index."""
        counts = np.fromiter(map(len, self.at), dtype=np.int64, count=len(self.at))
        total = int(counts.sum())
        which = np.repeat(np.arange(len(counts)), counts)
        firsts = np.asarray(self.offsets, dtype=np.int64) - (np.cumsum(counts) - counts)
        offsets = firsts[which] + np.arange(total, dtype=np.int64)
        at = np.fromiter(itertools.chain.from_iterable(self.at), dtype=np.int64, count=total)
        return which, offsets, at


# Columns of the round table.
_START, _SIZE, _REPS, _PARENT, _USED, _REST, _LO = range(7)


class GatedOrder(OrderBase):
    """Maps global sample positions to dataset indices for a pool that grows with the step.

    ``describe(epoch, position)`` reports the curriculum step of the last batch returned before
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
        first_step: int = 0,
        batch_start: Callable[[int], int] | None = None,
    ) -> None:
        if global_batch_size < 1 or samples_per_epoch < 1:
            raise ValueError(
                f"need global_batch_size >= 1 and samples_per_epoch >= 1 (got "
                f"{global_batch_size=}, {samples_per_epoch=})"
            )
        if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
            raise ValueError(
                f"first_step must be an int >= 0 (got {first_step=!r}); 1 is DeepSpeed's rule"
            )
        if len(pool_order) != len(entry_steps) or len(pool_order) == 0:
            raise ValueError(
                f"pool_order and entry_steps must be non-empty and of equal length (got "
                f"{len(pool_order)} and {len(entry_steps)})"
            )
        if int(entry_steps[0]) > first_step:
            raise ValueError(
                f"no sample is eligible at step {first_step} (the first enters at step "
                f"{int(entry_steps[0])}); lower min_difficulty so that training can start"
            )
        self.pool_order = pool_order
        self.entry_steps = np.asarray(entry_steps)
        self.global_batch_size = int(global_batch_size)
        self.samples_per_epoch = int(samples_per_epoch)
        self.seed = int(seed)
        self.first_step = first_step
        self._difficulties = difficulties
        self._batch_start = batch_start
        self.rebuild()

    def rebuild(self) -> None:
        """Plan the rounds again from ``batch_start`` (a mixture whose weight schedule changed
        moves the draws where the pool grows). Draws before the first such move are drawn as
        before where their rounds are unchanged; every draw is eligible either way."""
        self._rounds = self._build_rounds()
        columns = (_START, _SIZE, _PARENT, _USED, _REST, _LO)
        self._columns = tuple(self._rounds[:, c] for c in columns)
        self._lists = tuple(c.tolist() for c in self._columns)

    def pool_size(self, step: int) -> int:
        """How many samples are eligible at curriculum ``step`` (O(log N))."""
        return int(np.searchsorted(self.entry_steps, step, side="right"))

    def batch_start(self, batch: int) -> int:
        """The stream position at which global batch ``batch`` starts drawing from this order.

        ``batch * global_batch_size`` unless the order is one source of a mixture, whose draws
        in a batch are given by the mixture (``batch_start=``).
        """
        if self._batch_start is None:
            return batch * self.global_batch_size
        return int(self._batch_start(batch))

    def batch_of(self, g: int) -> int:
        """The global batch whose draws include stream position ``g`` (O(log) calls)."""
        if self._batch_start is None:
            return g // self.global_batch_size
        hi = 1
        while self.batch_start(hi) <= g:
            hi *= 2
        lo = 0  # invariant: batch_start(lo) <= g < batch_start(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.batch_start(mid) <= g:
                lo = mid
            else:
                hi = mid
        return lo

    def _build_rounds(self) -> np.ndarray:
        final = len(self.entry_steps)
        rows: list[list[int]] = []
        g = 0
        pending: tuple[int, int] | None = None  # (row, used) of a round a pool change stopped
        while True:
            pool = self.pool_size(self.batch_of(g) + self.first_step)
            if pending is None:
                parent, used, rest, lo = -1, 0, 0, 0
            else:
                parent, used = pending
                r = rows[parent]
                # lo: the pool size the stopped round covers (its new ranks end there; a fresh
                # round: its size)
                rest, lo = r[_SIZE] - used, r[_SIZE] - r[_REST] + r[_LO]
            size = rest + pool - lo
            change = None  # the pool never grows again
            if pool < final:  # the first batch whose step admits rank ``pool``
                change = self.batch_start(max(0, int(self.entry_steps[pool]) - self.first_step))
                if change >= _FOREVER:  # no run draws 2**62 samples: the pool stays as it is
                    change = None
            if pending is None:
                full = _FOREVER if change is None else (change - g) // size
                if full:
                    rows.append([g, size, full, -1, 0, 0, 0])
                    if change is None:
                        break
                    g += full * size
                    if g == change:  # used up exactly as the pool grows: walk the new first
                        pending = (len(rows) - 1, size)
                        continue
                assert change is not None
                rows.append([g, size, 1, -1, 0, 0, 0])
                pending, g = (len(rows) - 1, change - g), change
                continue
            rows.append([g, size, 1, parent, used, rest, lo])
            if change is None or g + size < change:
                pending, g = None, g + size
            else:
                pending, g = (len(rows) - 1, change - g), change
        return np.asarray(rows, dtype=np.int64)

    @property
    def num_segments(self) -> int:
        """Rows of the round table (at most three per pool change)."""
        return len(self._rounds)

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
        """The curriculum step of the batch holding ``position`` of ``epoch``."""
        g = epoch * self.samples_per_epoch + int(position)
        return g // self.global_batch_size + self.first_step

    def _permute(
        self, rows: list[int], reps: list[int], which: np.ndarray, offset: np.ndarray
    ) -> np.ndarray:
        """Element ``offset[i]`` of the permutation of round ``(rows[w], reps[w])``, ``w =
        which[i]``, in one vectorised pass.

        A fresh round's permutation is over its pool, a continuation's (``rep`` 0) over its
        new ranks; each is a keyed Feistel network with cycle walking, seeded by
        ``(seed, row, rep)``, so a batch touching many rows costs one pass, not one per row.
        """
        if offset.size == 0:
            return offset.copy()
        _, sizes, _, _, rests, _ = self._lists
        size = np.array([sizes[r] - rests[r] for r in rows], dtype=np.uint64)
        keys = np.array(
            [_round_keys(self.seed, r, k) for r, k in zip(rows, reps, strict=True)],
            dtype=np.uint64,
        )
        return _feistel(offset.astype(np.uint64), size[which], keys[which]).astype(np.int64)

    def ranks(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Ranks into ``pool_order`` (the pool is ``[0, pool_size)``) for ``positions``."""
        g = self.global_position(epoch, positions)
        return self.stream_ranks(g.ravel()).reshape(g.shape)

    def stream_ranks(self, flat: np.ndarray) -> np.ndarray:
        """Ranks into ``pool_order`` for stream positions (``epoch * samples_per_epoch + p``).

        A continuation round of ``size`` positions with ``m`` new ranks places its new ranks
        evenly (the ``x``-th position is new when ``floor((x + 1) m / size)`` grows) in their
        own permuted order; its other positions continue the stopped round, in that round's
        order, from where it stopped. So each level of a chain is a few integer operations and
        a rank costs one permutation at the end of its chain.

        Runs of consecutive positions (a rank's part of a batch) are walked as ranges: the
        positions of a run that continue the stopped round are consecutive there too, so a
        level costs a few integer operations for the whole run, plus one for each new rank
        it places. Scattered positions are walked one by one, level by level (the same ranks).
        """
        flat = np.asarray(flat, dtype=np.int64)
        if flat.size == 0:
            return flat.copy()
        breaks = np.flatnonzero(np.diff(flat) != 1) + 1
        if len(breaks) + 1 > max(1, flat.size // _RUN_MIN):
            return self._walk_positions(flat)
        pieces = _Pieces()
        bounds = [0, *breaks.tolist(), flat.size]
        firsts = flat[bounds[:-1]].tolist()
        for first, lo, hi in zip(firsts, bounds[:-1], bounds[1:], strict=True):
            self._walk_run(first, first + hi - lo, lo, pieces)
        out = np.empty_like(flat)
        which, offsets, at = pieces.arrays()
        base = np.asarray(pieces.base, dtype=np.int64)[which]
        out[at] = base + self._permute(pieces.rows, pieces.reps, which, offsets)
        return out

    def _walk_run(self, g0: int, g1: int, at: int, pieces: _Pieces) -> None:
        """Add the ranks of stream positions ``[g0, g1)`` (written from ``out[at]`` on) to
        ``pieces``: the run is cut where a round or a repeat ends, and each piece is walked
        down its chain of stopped rounds as a range."""
        start, sizes, parents, used, rests, los = self._lists
        while g0 < g1:
            row = bisect.bisect_right(start, g0) - 1
            rep, x0 = divmod(g0 - start[row], sizes[row])
            n = min(g1, start[row + 1] if row + 1 < len(start) else g1) - g0
            n = min(n, sizes[row] - x0)  # to the end of this repeat and row at most
            x1 = x0 + n
            # slots[t]: where the t-th position of this level's range goes in the output
            slots: range | list[int] = range(at, at + n)
            while parents[row] >= 0:
                size = sizes[row]
                m = size - rests[row]
                first, last = x0 * m // size, x1 * m // size  # new ranks before x0 and x1
                if last > first:  # the j-th new rank sits at ceil((j + 1) size / m) - 1
                    taken = [((j + 1) * size + m - 1) // m - 1 - x0 for j in range(first, last)]
                    pieces.add(row, 0, first, [slots[t] for t in taken], los[row])
                    if isinstance(slots, range):
                        slots = list(slots)
                    for t in reversed(taken):  # a few per level: del beats a rebuild
                        del slots[t]
                # the other positions continue the stopped round at ``used + x - new before x``
                x0, x1 = used[row] + x0 - first, used[row] + x1 - last
                row, rep = parents[row], 0
                if x1 == x0:
                    break
            else:
                pieces.add(row, rep, x0, slots, 0)
            g0 += n
            at += n

    def _walk_positions(self, flat: np.ndarray) -> np.ndarray:
        """:meth:`stream_ranks` for scattered positions: each position walked level by level."""
        start, sizes, parents, used, rests, los = self._columns
        row = np.searchsorted(start, flat, side="right") - 1
        rep, x = np.divmod(flat - start[row], sizes[row])
        out = np.empty_like(flat)
        todo = np.arange(flat.size)
        fresh: list[tuple[np.ndarray, ...]] = []  # (row, repeat, offset, where) per level
        new: list[tuple[np.ndarray, ...]] = []  # (row, index among new ranks, where)
        while todo.size:
            r0 = int(row[0])
            if parents[r0] < 0 and (row == r0).all():  # the common case: one fresh round
                fresh.append((row, rep, x, todo))
                break
            parent = parents[row]
            done = parent < 0
            if done.any():
                fresh.append((row[done], rep[done], x[done], todo[done]))
                cont = ~done
                row, x, todo, parent = row[cont], x[cont], todo[cont], parent[cont]
            size = sizes[row]
            m = size - rests[row]
            before = _mul_div(x, m, size)
            is_new = _mul_div(x + 1, m, size) > before
            new.append((row[is_new], before[is_new], todo[is_new]))
            old = ~is_new  # continue the stopped round at its offset ``used + (x - before)``
            row = row[old]
            x = used[row] + x[old] - before[old]
            row, todo = parent[old], todo[old]
            rep = np.zeros_like(row)
        if fresh:
            rows, reps, xs, at = (np.concatenate(c) for c in zip(*fresh, strict=True))
            out[at] = self._permute_pairs(rows, reps, xs)
        if new:
            rows, idx, at = (np.concatenate(c) for c in zip(*new, strict=True))
            out[at] = los[rows] + self._permute_pairs(rows, np.zeros_like(rows), idx)
        return out

    def _permute_pairs(self, row: np.ndarray, rep: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """:meth:`_permute` with a round ``(row[i], rep[i])`` per element."""
        pairs, which = np.unique(np.stack([row, rep], axis=1), axis=0, return_inverse=True)
        return self._permute(pairs[:, 0].tolist(), pairs[:, 1].tolist(), which.ravel(), offset)

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) at ``positions`` of ``epoch``: a pure function."""
        check_mapped(self.pool_order, what="the curriculum's pool order")  # SIGBUS otherwise
        return np.asarray(self.pool_order[self.ranks(epoch, positions)], dtype=np.int64)

    def describe(self, epoch: int, position: int) -> dict[str, Any]:
        """The step of the last returned batch, its pool size and difficulties (JSON)."""
        step = self.step(epoch, position) - 1
        at = max(step, self.first_step)
        return envelope(
            "curriculum_order",
            ORDER_VERSION,
            step=step,
            pool_size=self.pool_size(at),
            difficulty=self._difficulties(at) if self._difficulties else {},
        )

    def validate(self, described: Mapping[str, Any]) -> None:
        """Refuse facts written by another order kind or version (never misread them)."""
        facts = open_envelope(
            described,
            kind="curriculum_order",
            version=ORDER_VERSION,
            fields={"pool_size": int},
            what="curriculum order state",
        )
        if "step" not in facts or not isinstance(facts["step"], int):
            raise ValueError(
                f"curriculum order state has step={facts.get('step')!r}; the checkpoint is "
                "corrupted"
            )
        at = max(facts["step"], self.first_step)
        mine = self._difficulties(at) if self._difficulties else {}
        check_gate(facts, pool_size=self.pool_size(at), difficulty=mine, what="curriculum")


def check_gate(facts: Mapping[str, Any], *, pool_size: int, difficulty: Any, what: str) -> None:
    """Refuse a checkpoint's curriculum facts (``step``, ``pool_size``, ``difficulty``) that
    this curriculum does not give at that step: another schedule or metric would serve other
    samples, silently. ``difficulty``: this curriculum's at the step (JSON-comparable)."""
    theirs, pool = facts.get("difficulty", {}), facts.get("pool_size")
    if isinstance(pool, bool) or not isinstance(pool, int):
        raise ValueError(
            f"the checkpoint's {what} has pool_size={pool!r}; the checkpoint is corrupted"
        )
    if pool == pool_size and theirs == json.loads(json.dumps(difficulty)):
        return
    raise ValueError(
        f"the checkpoint's {what} had {pool} eligible samples at difficulty "
        f"{theirs!r} at step {facts['step']}, but this one has {pool_size} at {difficulty!r}: "
        "another schedule or metric; resume with the dataset and curriculum (schedule, "
        "metric index) that wrote the checkpoint"
    )
