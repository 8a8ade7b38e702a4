"""A seeded shuffle buffer whose state is explicit, small and exact.

The buffer fills to ``size`` items, then each output is drawn at slot ``u[draws] %
len(buffer)`` and the slot is refilled from the source, where ``u`` is a counter-based
SplitMix64 stream keyed on ``seed`` (computed 1,024 draws at a time with numpy). The
randomness is a pure function of ``(seed, draws)``, so the checkpoint holds no RNG bytes.

The buffer contents are in the state. By default the items themselves are stored (they must
be JSON-serialisable); pass ``ref`` (item -> JSON reference, e.g. ``[shard, row]``) and
``load`` (list of references -> items, in order) to store references instead and re-read the
items on ``restore`` (rows of a stream are usually tensors or large dicts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from meshfeed.nodes.base import Node
from meshfeed.order.permutation import derive_seed, splitmix64

T = TypeVar("T")

__all__ = ["ShuffleBuffer"]

_SHUFFLE_OP = 0x5348
_BLOCK = 1024
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _uniform_block(key: int, start: int) -> list[int]:
    """``splitmix64(key + j * gamma)`` for ``j`` in ``[start, start + _BLOCK)``, vectorised."""
    j = np.arange(start, start + _BLOCK, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64(key) + (j + np.uint64(1)) * _GAMMA
        x = (x ^ (x >> np.uint64(30))) * _C1
        x = (x ^ (x >> np.uint64(27))) * _C2
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(1)).tolist()


class ShuffleBuffer(Node[T]):
    """Shuffle ``source`` through a buffer of ``size`` items (``size <= 1``: pass-through)."""

    def __init__(
        self,
        source: Node[T],
        *,
        size: int,
        seed: int,
        ref: Callable[[T], Any] | None = None,
        load: Callable[[list[Any]], list[T]] | None = None,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"shuffle buffer size must be an int >= 0 (got {size=!r})")
        if (ref is None) != (load is None):
            raise ValueError("give both ref= and load= (store references) or neither")
        self.source, self.size, self.seed = source, size, seed
        self.ref, self.load = ref, load
        self.buffer: list[T] = []
        self.draws = 0
        self._source_done = False
        self._key = splitmix64(derive_seed(_SHUFFLE_OP, seed))
        self._block: tuple[int, list[int]] = (-1, [])

    def _fill(self) -> None:
        while not self._source_done and len(self.buffer) < self.size:
            try:
                self.buffer.append(self.source.next())
            except StopIteration:
                self._source_done = True

    def next(self) -> T:
        if self.size <= 1:
            return self.source.next()
        self._fill()
        if not self.buffer:
            raise StopIteration
        start = self.draws - self.draws % _BLOCK
        if self._block[0] != start:
            self._block = (start, _uniform_block(self._key, start))
        slot = self._block[1][self.draws - start] % len(self.buffer)
        self.draws += 1
        item = self.buffer[slot]
        last = self.buffer.pop()
        if slot < len(self.buffer):
            self.buffer[slot] = last
        self._fill()
        return item

    def get_state(self) -> dict[str, Any]:
        items = [self.ref(x) for x in self.buffer] if self.ref is not None else list(self.buffer)
        return {
            "draws": self.draws,
            "buffer": items,
            "source_done": self._source_done,
            self.SOURCE_KEY: self.source.get_state(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        for key in ("draws", "buffer", "source_done", self.SOURCE_KEY):
            if key not in state:
                raise ValueError(
                    f"shuffle buffer state is missing {key!r} (keys: {sorted(state)}); restore "
                    "a state saved by a ShuffleBuffer"
                )
        self.source.restore(state[self.SOURCE_KEY])
        self.draws = int(state["draws"])
        self._source_done = bool(state["source_done"])
        refs = list(state["buffer"])
        self.buffer = self.load(refs) if self.load is not None else refs
