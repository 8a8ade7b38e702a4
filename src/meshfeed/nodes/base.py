"""The node protocol of the streaming tier: explicit-state iterators.

A node implements ``next()`` (raise ``StopIteration`` at the end), ``get_state()`` and
``restore(state)``; the base class owns ``__iter__`` / ``__next__``. The state reported is the
state as of the last item *returned*, as a small JSON-serialisable dict; a parent nests its
source's state under the key ``"source"``. Iterators rather than generators, because a
generator hides its state on its stack.

>>> node = ListNode(["a", "b", "c"])
>>> next(node), node.get_state()
('a', {'position': 1})
>>> node.restore({"position": 2}); next(node)
'c'
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["ListNode", "Node"]


class Node(Generic[T]):
    """Base of explicit-state iterators: subclasses write ``next``, ``get_state``, ``restore``."""

    SOURCE_KEY = "source"

    def next(self) -> T:
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return self.next()


class ListNode(Node[T]):
    """Yields the items of a sequence; the state is the position."""

    def __init__(self, items: Sequence[T]) -> None:
        self.items = items
        self.position = 0

    def next(self) -> T:
        if self.position >= len(self.items):
            raise StopIteration
        self.position += 1
        return self.items[self.position - 1]

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position}

    def restore(self, state: dict[str, Any]) -> None:
        position = state.get("position")
        if not isinstance(position, int) or not 0 <= position <= len(self.items):
            raise ValueError(
                f"ListNode state has position={position!r} for {len(self.items)} items; "
                "restore a state saved by the same pipeline"
            )
        self.position = position
