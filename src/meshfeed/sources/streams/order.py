"""The order of a sharded stream: permuted shards, permuted windows of rows, epochs cut from passes.

See :mod:`meshfeed.sources.streams.stream` for what the order is. Besides the indices, the order
tells its stream two things for the shard cache (#29): the shards each planned block reads
(``on_plan``: download-ahead), and, as the loader returns batches, the shards whose rows of the
current pass have all been returned (``on_done``): a shard lies in a contiguous run of a pass's
rows, so it is read to its end once the windows that hold its rows are returned. That is known
in the process that walks the order, however many worker processes read the rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from meshfeed.order.distinct import distinct
from meshfeed.order.permutation import Permutation, derive_seed
from meshfeed.protocols import OrderBase

__all__ = ["ORDER_VERSION", "PLAN_AHEAD_SHARDS", "StreamOrder"]

_SHARD_OP = 0x5348_4152
_WINDOW_OP = 0x5749_4E44
#: Version of the facts a StreamOrder records in a loader checkpoint.
ORDER_VERSION = 1
#: shards of the pass after a planned block that the reader is told of too (download-ahead;
#: under a cache limit they wait, in order, for room)
PLAN_AHEAD_SHARDS = 4


def _groups(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Each distinct value of the int array ``keys`` (passes, windows), in increasing order,
    with the mask of its positions (:func:`~meshfeed.order.distinct.distinct`: a resumed
    loader's first batch does not wait for ``np.unique``'s import of ``numpy.ma``)."""
    return [(k, keys == k) for k in distinct(keys).tolist()]


class StreamOrder(OrderBase):
    """The order of a :class:`ShardedStream` (module docstring): permuted shards, permuted
    windows of ``window`` rows, epochs of ``samples_per_epoch`` rows cut from the passes.

    ``indices(epoch, positions)`` is vectorised and costs O(positions + shards) per call (the
    shard order of a pass is cached); nothing else is kept, so a checkpoint is a position.
    ``on_plan(shard ids)``: the shards each planned block reads, then the next ones of the pass;
    ``on_done(shard ids)``: as the loader returns batches (:meth:`returned`), the shards whose
    rows of their pass have all been returned, in the order they were finished.
    """

    def __init__(
        self,
        rows: Sequence[int],
        *,
        seed: int,
        stream_seed: int = 0,
        shuffle: bool,
        window: int,
        samples_per_epoch: int | None,
        on_plan: Callable[[list[int]], None] | None = None,
        on_done: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.rows = np.asarray(rows, dtype=np.int64)
        self.on_plan = on_plan  # told the shards each planned block reads (download-ahead)
        self.on_done = on_done  # told the shards read to their end (the cache evicts them first)
        self._returned: tuple[int, int] = (-1, 0)  # (epoch, position) last told to returned
        self.stream_seed = stream_seed
        self.total = int(self.rows.sum())
        if self.total < 1:
            raise ValueError("the stream has no rows; give it at least one non-empty shard")
        self.seed, self.shuffle = derive_seed(stream_seed, seed), shuffle
        self.window = window if shuffle and window > 1 else 0
        self.per_epoch = samples_per_epoch or self.total
        self._canon = np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)
        self._passes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._ends: dict[int, tuple[list[int], list[int]]] = {}  # pass -> _pass_ends

    def epoch_length(self, epoch: int) -> int:
        return self.per_epoch

    def _pass(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, start of each shard in the pass) of pass ``p``."""
        if p not in self._passes:
            n = len(self.rows)
            if self.shuffle and n > 1:
                order = Permutation(n, derive_seed(_SHARD_OP, self.seed, p))[np.arange(n)]
            else:
                order = np.arange(n)
            starts = np.concatenate([[0], np.cumsum(self.rows[order])]).astype(np.int64)
            if len(self._passes) >= 4:
                self._passes.clear()
            self._passes[p] = (order, starts)
        return self._passes[p]

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        first = epoch * self.per_epoch  # Python ints: no overflow
        first_pass = first // self.total
        local = (first - first_pass * self.total) + pos  # < total + per_epoch
        pass_of, offset = np.divmod(local, self.total)
        out = np.empty_like(pos)
        for k, mask in _groups(pass_of):
            out[mask] = self._pass_indices(first_pass + k, offset[mask])
        return out

    def _pass_indices(self, p: int, offset: np.ndarray) -> np.ndarray:
        if self.window:
            offset = offset.copy()
            win = offset // self.window
            for w, mask in _groups(win):
                lo = w * self.window
                size = min(self.window, self.total - lo)
                perm = Permutation(size, derive_seed(_WINDOW_OP, self.seed, p, w))
                offset[mask] = perm[offset[mask] - lo] + lo
        order, starts = self._pass(p)
        k = np.searchsorted(starts, offset, side="right") - 1
        shard = order[k]
        if self.on_plan is not None and shard.size:
            # in the order they are read, then the next shards of the pass: download-ahead
            # must start before a shard's first row is planned to overlap with the reading
            after = order[int(k.max()) + 1 : int(k.max()) + 1 + PLAN_AHEAD_SHARDS]
            self.on_plan(list(dict.fromkeys([*shard.tolist(), *after.tolist()])))
        return self._canon[shard] + (offset - starts[k])

    def returned(self, epoch: int, position: int) -> None:
        """The loader returned ``epoch``'s batches up to ``position``: tell ``on_done`` the
        shards read to their end since the last call (from the start of the epoch on its first
        call: a resumed epoch's earlier shards are done too; none after a step back)."""
        last_epoch, last = self._returned
        self._returned = (epoch, position)
        if self.on_done is None:
            return
        start = last if epoch == last_epoch else 0
        if position <= start:
            return
        first = epoch * self.per_epoch  # Python ints: no overflow
        lo, hi = first + start, first + position
        done: list[int] = []
        for p in range(lo // self.total, (hi - 1) // self.total + 1):
            a = max(lo - p * self.total, 0)
            b = min(hi - p * self.total, self.total)
            done += self._finished(p, a, b)
        if done:
            self.on_done(done)

    def _finished(self, p: int, a: int, b: int) -> list[int]:
        """The shards of pass ``p`` whose last window ends in ``(a, b]`` (pass offsets)."""
        order, ends = self._ends.get(p) or self._pass_ends(p)
        return order[bisect.bisect_right(ends, a) : bisect.bisect_right(ends, b)]

    def _pass_ends(self, p: int) -> tuple[list[int], list[int]]:
        """(shard order, where each shard is done) of pass ``p``, as lists: ``returned`` runs
        once per batch, and bisecting a list beats numpy's per-call cost there."""
        order, starts = self._pass(p)
        ends = starts[1:]
        if self.window:  # a shard is done with the window that holds its last row
            ends = np.minimum(-(-ends // self.window) * self.window, self.total)
        if len(self._ends) >= 4:
            self._ends.clear()
        found = self._ends[p] = (order.tolist(), ends.tolist())
        return found

    def describe(self, epoch: int, position: int) -> dict[str, Any]:
        return {
            "kind": "stream",
            "version": ORDER_VERSION,
            "window": self.window,
            "stream_seed": self.stream_seed,
            "samples_per_epoch": self.per_epoch,
        }

    def validate(self, described: Mapping[str, Any]) -> None:
        mine = self.describe(0, 0)
        if dict(described) != mine:
            raise ValueError(
                f"checkpoint's stream order {dict(described)!r} differs from this stream's "
                f"{mine!r}: build the ShardedStream with the checkpoint's shuffle_buffer "
                "(window), seed and samples_per_epoch to resume this run"
            )
