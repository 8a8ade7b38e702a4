"""A seeded shuffle buffer whose state is explicit, small and exact.

The buffer first fills to ``size`` items. Draw ``j`` takes slot ``u[j] % len(buffer)``, where
``u`` is a counter-based SplitMix64 stream keyed on ``seed`` (computed with numpy, many draws
at a time): while the source still has items, the drawn slot is refilled in place with the
next item; once the source is exhausted, the last slot moves into the drawn one and the buffer
shrinks. So the output is a pure function of ``(seed, the items read)``, the checkpoint holds
no RNG bytes, and ``next_many(n)`` does one vectorised draw and one source call for ``n``
items (the Python left per item is a list read and a list write).

The buffer contents are in the state, in slot order. By default the items themselves are
stored (they must be JSON-serialisable); pass ``ref`` (item -> JSON reference, e.g.
``[shard, row]``, called once per item as it enters the buffer) and ``load`` (list of
references -> items, in order) to store references instead and re-read the items on
``load_state_dict`` (rows of a stream are usually tensors or large dicts). References must be
unique: a checkpoint that lists one twice is refused (it would deliver that item twice).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from meshfeed.nodes.base import Deferred, Node, materialize
from meshfeed.order.permutation import derive_seed, splitmix64
from meshfeed.state import MAX_COUNT, check_count, envelope, open_envelope

T = TypeVar("T")

__all__ = ["RefSource", "ShuffleBuffer"]


@runtime_checkable
class RefSource(Protocol):
    """A node whose items carry cheap references, for ``ShuffleBuffer(source_refs=True)``.

    ``next_many_refs(n)`` returns up to ``n`` items and their keys (fewer only at the end);
    ``json_refs`` is a module-level function turning a list of keys into a list of JSON
    references; ``load_refs(json_refs)`` re-reads those items and returns ``(items, keys)``,
    refusing a reference that is malformed, repeated or no longer there (``ValueError``).
    """

    json_refs: Callable[[list[Any]], list[Any]]

    def next_many_refs(self, n: int) -> tuple[list[Any], list[Any]]: ...

    def load_refs(self, refs: list[Any]) -> tuple[list[Any], list[Any]]: ...


_SHUFFLE_OP = 0x5348
_BLOCK = 4096
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _uniforms(key: int, start: int, count: int) -> np.ndarray:
    """``splitmix64(key + (j + 1) * gamma) >> 1`` for ``j`` in ``[start, start + count)``."""
    j = np.arange(start, start + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64(key) + (j + np.uint64(1)) * _GAMMA
        x = (x ^ (x >> np.uint64(30))) * _C1
        x = (x ^ (x >> np.uint64(27))) * _C2
        x = x ^ (x >> np.uint64(31))
    return x >> np.uint64(1)


class ShuffleBuffer(Node[T]):
    """Shuffle ``source`` through a buffer of ``size`` items (``size <= 1``: pass-through)."""

    KIND, VERSION = "node.shuffle", 1

    def __init__(
        self,
        source: Node[T],
        *,
        size: int,
        seed: int,
        ref: Callable[[T], Any] | None = None,
        load: Callable[[list[Any]], list[T]] | None = None,
        source_refs: bool = False,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"shuffle buffer size must be an int >= 0 (got {size=!r})")
        if (ref is None) != (load is None):
            raise ValueError("give both ref= and load= (store references) or neither")
        if source_refs and (ref is not None or not isinstance(source, RefSource)):
            raise ValueError(
                f"source_refs=True takes the references from the source: give a source with "
                f"next_many_refs / json_refs / load_refs (got {type(source).__name__}) and no "
                "ref= / load="
            )
        self.source, self.size, self.seed = source, size, seed
        self.ref, self.load, self.source_refs = ref, load, source_refs
        self.buffer: list[T] = []
        self._refs: list[Any] = []  # ref(item) per slot, kept in step with buffer
        self.draws = 0
        self._source_done = False
        self._key = splitmix64(derive_seed(_SHUFFLE_OP, seed))
        self._cache_start, self._cache = 0, np.empty(0, np.uint64)
        # u % size of a block of draws, as ints (the steady state's slots)
        self._slot_start, self._slot_cache = 0, list[int]()

    def _u(self, start: int, count: int) -> np.ndarray:
        lo = start - self._cache_start
        if lo < 0 or lo + count > self._cache.shape[0]:
            self._cache_start = start
            self._cache = _uniforms(self._key, start, max(count, _BLOCK))
            lo = 0
        return self._cache[lo : lo + count]

    def _slots(self, start: int, count: int) -> list[int]:
        """Steady-state slots ``u[j] % size`` for draws ``[start, start + count)``: one
        numpy pass per block of draws, a list slice per call."""
        lo = start - self._slot_start
        if lo < 0 or lo + count > len(self._slot_cache):
            block = max(count, _BLOCK)
            self._slot_start = start
            self._slot_cache = (_uniforms(self._key, start, block) % np.uint64(self.size)).tolist()
            lo = 0
        return self._slot_cache[lo : lo + count]

    def _take(self, n: int) -> list[T]:
        """Up to ``n`` items from the source, marking it done when it returns fewer."""
        items = self.source.next_many(n) if n > 0 else []
        if len(items) < n:
            self._source_done = True
        return items

    def _take_refs(self, n: int) -> tuple[list[T], list[Any]]:
        items, keys = self.source.next_many_refs(n) if n > 0 else ([], [])  # type: ignore[attr-defined]
        if len(items) < n:
            self._source_done = True
        return items, keys

    def _fill(self) -> None:
        if self.source_refs and not self._source_done and len(self.buffer) < self.size:
            items, keys = self._take_refs(self.size - len(self.buffer))
            self.buffer.extend(items)
            self._refs.extend(keys)
        elif not self._source_done and len(self.buffer) < self.size:
            items = self._take(self.size - len(self.buffer))
            self.buffer.extend(items)
            if self.ref is not None:
                ref = self.ref
                self._refs.extend([ref(x) for x in items])

    def next(self) -> T:
        items = self.next_many(1)
        if not items:
            raise StopIteration
        return items[0]

    def next_many(self, n: int) -> list[T]:
        if self.size <= 1:
            return self.source.next_many(n)
        out: list[T] = []
        self._fill()
        buf, refs, ref = self.buffer, self._refs, self.ref
        if len(out) < n and not self._source_done:
            # steady state: the buffer is full; each draw's slot takes the next source item
            keys: list[Any] = []
            if self.source_refs:
                incoming, keys = self._take_refs(n)
            else:
                incoming = self._take(n)
            m = len(incoming)
            slots = self._slots(self.draws, m)
            self.draws += m
            if self.source_refs:
                for s, x, k in zip(slots, incoming, keys, strict=True):
                    out.append(buf[s])
                    buf[s] = x
                    refs[s] = k
            elif ref is None:
                for s, x in zip(slots, incoming, strict=True):
                    out.append(buf[s])
                    buf[s] = x
            else:
                for s, x in zip(slots, incoming, strict=True):
                    out.append(buf[s])
                    buf[s] = x
                    refs[s] = ref(x)
        if len(out) < n and buf:
            # drain: the source is exhausted, the buffer shrinks by one per draw
            k = min(n - len(out), len(buf))
            us = self._u(self.draws, k).tolist()
            self.draws += k
            for u in us:
                s = u % len(buf)
                out.append(buf[s])
                buf[s] = buf[-1]
                buf.pop()
                if ref is not None or self.source_refs:
                    refs[s] = refs[-1]
                    refs.pop()
        return out

    def state_dict(self) -> dict[str, Any]:
        if self.source_refs:
            return materialize(self.snapshot())
        items = list(self._refs) if self.ref is not None else list(self.buffer)
        return envelope(
            self.KIND,
            self.VERSION,
            draws=self.draws,
            buffer=items,
            source_done=self._source_done,
            **{self.SOURCE_KEY: self.source.state_dict()},
        )

    def snapshot(self) -> dict[str, Any]:
        if not self.source_refs:
            return self.state_dict()
        return envelope(
            self.KIND,
            self.VERSION,
            draws=self.draws,
            buffer=Deferred(self.source.json_refs, list(self._refs)),  # type: ignore[attr-defined]
            source_done=self._source_done,
            **{self.SOURCE_KEY: self.source.snapshot()},
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        what = "shuffle buffer state"
        s = open_envelope(
            state,
            kind=self.KIND,
            version=self.VERSION,
            fields={"draws": int, "buffer": list, "source_done": bool, self.SOURCE_KEY: dict},
            what=what,
        )
        draws = check_count(s["draws"], name="draws", what=what, upper=MAX_COUNT)
        items = s["buffer"]
        cap = self.size if self.size > 1 else 0
        if len(items) > cap:
            raise ValueError(
                f"{what} holds {len(items)} items but this buffer has size={self.size}; resume "
                "with the shuffle buffer size that wrote the checkpoint"
            )
        if not s["source_done"] and items and len(items) != cap:
            raise ValueError(
                f"{what} holds {len(items)} items of {cap} while its source is not exhausted "
                "(a buffer is full until its source ends); the checkpoint is corrupted"
            )
        if self.load is not None or self.source_refs:
            keys = [json.dumps(r) for r in items]
            if len(set(keys)) != len(keys):
                dup = next(k for k in keys if keys.count(k) > 1)
                raise ValueError(
                    f"{what} lists the reference {dup} more than once (it would deliver that "
                    "item twice); the checkpoint is corrupted"
                )
        self.source.load_state_dict(s[self.SOURCE_KEY])
        if self.source_refs:
            loaded, found = self.source.load_refs(list(items))  # type: ignore[attr-defined]
            if len(loaded) != len(items) or len(found) != len(items):
                raise ValueError(
                    f"{what}: load_refs() returned {len(loaded)} items for {len(items)} references"
                )
            self.buffer, self._refs = list(loaded), list(found)
            self.draws = draws
            self._source_done = s["source_done"]
            return
        loaded = self.load(list(items)) if self.load is not None else list(items)
        if len(loaded) != len(items):
            raise ValueError(
                f"{what}: load() returned {len(loaded)} items for {len(items)} references"
            )
        self.buffer = loaded
        self._refs = list(items) if self.ref is not None else []
        self.draws = draws
        self._source_done = s["source_done"]
