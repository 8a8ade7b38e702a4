"""The node protocol of the streaming tier: explicit-state iterators.

A node implements ``next()`` (raise ``StopIteration`` at the end) and the one state protocol of
meshfeed, ``state_dict()`` / ``load_state_dict(state)`` with the envelope of
:mod:`meshfeed.state` (``{"kind": ..., "version": ..., **fields}``); the base class owns
``__iter__`` / ``__next__`` and a default ``next_many(n)``. The state reported is the state as
of the last item *returned*, a small JSON-serialisable dict; a parent nests its source's state
under the key ``"source"``. Iterators rather than generators, because a generator hides its
state on its stack.

``next_many(n)`` returns up to ``n`` items (fewer only at the end, ``[]`` once exhausted). The
default calls ``next()``; nodes on a hot path override it to do the per-item work in bulk
(one reader call for many rows, one vectorised draw for many shuffle slots). Mixing ``next``
and ``next_many`` gives the same items in the same order.

>>> node = ListNode(["a", "b", "c"])
>>> next(node), node.state_dict()["position"]
('a', 1)
>>> node.load_state_dict({**node.state_dict(), "position": 2}); next(node)
'c'
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from meshfeed.state import check_count, envelope, open_envelope

T = TypeVar("T")

__all__ = ["ListNode", "Node"]


class Node(Generic[T]):
    """Base of explicit-state iterators: subclasses write ``next``, ``state_dict`` and
    ``load_state_dict`` (and may override ``next_many``)."""

    SOURCE_KEY = "source"

    def next(self) -> T:
        raise NotImplementedError

    def next_many(self, n: int) -> list[T]:
        """Up to ``n`` items in order; fewer only when the node ends."""
        out: list[T] = []
        try:
            while len(out) < n:
                out.append(self.next())
        except StopIteration:
            pass
        return out

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return self.next()


class ListNode(Node[T]):
    """Yields the items of a sequence; the state is the position."""

    KIND, VERSION = "node.list", 1

    def __init__(self, items: Sequence[T]) -> None:
        self.items = items
        self.position = 0

    def next(self) -> T:
        if self.position >= len(self.items):
            raise StopIteration
        self.position += 1
        return self.items[self.position - 1]

    def next_many(self, n: int) -> list[T]:
        lo = self.position
        self.position = min(len(self.items), lo + max(0, n))
        return list(self.items[lo : self.position])

    def state_dict(self) -> dict[str, Any]:
        return envelope(self.KIND, self.VERSION, position=self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        what = "ListNode state"
        s = open_envelope(state, kind=self.KIND, version=self.VERSION, fields={"position": int})
        self.position = check_count(
            s["position"], name="position", what=what, upper=len(self.items)
        )
