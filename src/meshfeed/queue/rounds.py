"""A round: one global batch planned once for every data rank, kept as one id list and a rule.

A rank-aware sampler over ``D`` data ranks plans ``D * batch_size`` samples at once; data rank
``r`` reads part ``r``. A :class:`Round` keeps the ids once, in part order, and computes any
part on demand (O(batch) for one part, O(1) to make), so the store's cost per reader does not
grow with ``D``: no list per data rank is made unless a caller asks for all of them
(:meth:`Round.lists`). The rule of :func:`split_round` (contiguous parts of whole units, sizes
differing by at most one unit, the larger first) is the default; a sampler whose parts are not
contiguous in order (Karmarkar-Karp) gives them as lists (:meth:`Round.of`).
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Hashable, Iterator, Sequence
from itertools import accumulate
from typing import overload

__all__ = ["Progress", "Round", "split_round"]

Key = Hashable


class Round(Sequence[list[Key]]):
    """``parts`` parts of ``ids``: contiguous parts of whole ``unit``-sample units by the
    rule of :func:`split_round`, or cut at ``offsets`` (``parts + 1`` positions).

    ``ids`` may be a ``range`` (a FIFO round of consecutive ids: O(1) to keep, whatever its
    size); a part is still a list (O(part))."""

    __slots__ = ("_lists", "_offsets", "_unit", "ids", "parts")

    def __init__(
        self, ids: list[Key], parts: int, unit: int = 1, offsets: list[int] | None = None
    ) -> None:
        if parts < 1 or unit < 1:
            raise ValueError(f"a round needs parts >= 1 and unit >= 1 (got {parts=}, {unit=})")
        self.ids = ids
        self.parts, self._unit, self._offsets = parts, unit, offsets
        self._lists: list[list[Key]] | None = None

    @classmethod
    def of(cls, parts: Sequence[list[Key]]) -> Round:
        """``parts`` as a round (a :class:`Round` is returned as it is)."""
        if type(parts) is Round:  # not isinstance: an ABC check on every get costs more
            return parts
        if len(parts) == 1:
            return cls(parts[0], 1)
        offsets = [0, *accumulate(map(len, parts))]
        return cls([k for p in parts for k in p], len(parts), offsets=offsets)

    def bounds(self, part: int) -> tuple[int, int]:
        """Where part ``part`` starts and ends in :attr:`ids`."""
        if self._offsets is not None:
            return self._offsets[part], self._offsets[part + 1]
        n, unit = len(self.ids), self._unit
        q, r = divmod(-(-n // unit), self.parts)
        start = (part * q + min(part, r)) * unit
        return start, min(n, start + (q + (part < r)) * unit)

    def __len__(self) -> int:
        return self.parts

    @overload
    def __getitem__(self, part: int) -> list[Key]: ...

    @overload
    def __getitem__(self, part: slice) -> list[list[Key]]: ...

    def __getitem__(self, part: int | slice) -> list[Key] | list[list[Key]]:
        if isinstance(part, slice):
            return [self[i] for i in range(*part.indices(self.parts))]
        if not -self.parts <= part < self.parts:
            raise IndexError(f"part {part} of a round of {self.parts} parts")
        start, end = self.bounds(part % self.parts)
        got = self.ids[start:end]
        return list(got) if type(got) is range else got

    def __iter__(self) -> Iterator[list[Key]]:
        return (self[i] for i in range(self.parts))

    def lists(self) -> list[list[Key]]:
        """Every part as a list, made once (C-level slicing, O(round)) and shared by every
        caller: read-only."""
        if self._lists is None:
            cuts = self._offsets
            if cuts is None:
                n, unit, parts = len(self.ids), self._unit, self.parts
                q, r = divmod(-(-n // unit), parts)
                sizes = [(q + 1) * unit] * r + [q * unit] * (parts - r)
                cuts = [0, *accumulate(sizes)]
                cuts[-1] = n  # a last unit may be short
            # One list per part survives: without a pause the collector would scan the
            # growing heap again and again (measured 4-7x the slicing itself at 64k parts).
            ids = list(self.ids) if type(self.ids) is range else self.ids
            enabled = gc.isenabled()
            gc.disable()
            try:
                self._lists = list(map(ids.__getitem__, map(slice, cuts, cuts[1:])))
            finally:
                if enabled:
                    gc.enable()
        return self._lists


def split_round(ids: list[Key], parts: int, unit: int) -> list[list[Key]]:
    """``ids`` (whole units of ``unit`` samples, in order) split into ``parts`` contiguous
    parts whose unit counts differ by at most one, the larger first: how
    :class:`~meshfeed.queue.samplers.RankAwareSampler` splits a round (its docstring: the last
    round), and how a store loader's state is split again on another number of data ranks."""
    return list(Round(ids, parts, unit))


class Progress:
    """The lowest batch index every one of ``readers`` readers acknowledged, for one plan key
    prefix, in O(log readers) per move (a heap), not a scan of every reader per request.

    ``asked`` (reader -> index, the partition's record that checkpoints keep) is the truth;
    this is derived from it and rebuilt when the number of readers changes (a resume on
    another number of data ranks: readers at or above ``readers`` are gone and do not count).
    """

    __slots__ = ("heap", "missing", "readers")

    def __init__(self, asked: dict[int, int], readers: int) -> None:
        self.readers = readers
        self._build(asked)

    def _build(self, asked: dict[int, int]) -> None:
        self.heap: list[tuple[int, int]] = [(at, r) for r, at in asked.items() if r < self.readers]
        self.missing = self.readers - len(self.heap)
        heapq.heapify(self.heap)

    def moved(self, asked: dict[int, int], reader: int, old: int | None) -> None:
        """``reader`` moved from ``old`` (``None``: its first request) to ``asked[reader]``."""
        if reader >= self.readers:
            return
        if old is None:
            self.missing -= 1
        heapq.heappush(self.heap, (asked[reader], reader))
        if len(self.heap) > 4 * self.readers + 64:  # old positions of readers far ahead
            self._build(asked)

    def low(self, asked: dict[int, int]) -> int | None:
        """The lowest index every reader acknowledged; ``None`` while some never asked."""
        if self.missing > 0:
            return None
        heap = self.heap
        while asked.get(heap[0][1]) != heap[0][0]:  # an old position of a reader that moved
            heapq.heappop(heap)
        return heap[0][0]
