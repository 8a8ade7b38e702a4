"""The node protocol of the streaming tier: explicit-state iterators.

A node implements ``next()`` (raise ``StopIteration`` at the end) and the one state protocol of
meshfeed, ``state_dict()`` / ``load_state_dict(state)`` with the envelope of
:mod:`meshfeed.state` (``{"kind": ..., "version": ..., **fields}``); the base class owns
``__iter__`` / ``__next__`` and a default ``next_many(n)``. The state reported is the state as
of the last item *returned*, a small JSON-serialisable dict; a parent nests its source's state
under the key ``"source"``. Iterators rather than generators, because a generator hides its
state on its stack.

``snapshot()`` is ``state_dict()`` made cheap enough to take after every item: a field that is
costly to write out (a shuffle buffer's references) may be a :class:`Deferred`, which
:func:`materialize` turns into its JSON value only when the state is actually saved. A loader
records snapshots per batch and materialises the one it is asked for.

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

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from meshfeed.state import check_count, envelope, open_envelope

T = TypeVar("T")

__all__ = ["Deferred", "ListNode", "Node", "materialize"]


class Deferred:
    """A state field written out only when the state is saved: ``fn(arg)`` (a JSON value).

    ``fn`` must be a module-level function (a snapshot may travel from a worker process) and
    ``arg`` a private copy (the node keeps changing after the snapshot).
    """

    __slots__ = ("arg", "fn")

    def __init__(self, fn: Callable[[Any], Any], arg: Any) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple[Any, ...]:
        return Deferred, (self.fn, self.arg)


def materialize(state: Any) -> Any:
    """``state`` with every :class:`Deferred` field (in nested dicts) written out."""
    if isinstance(state, Deferred):
        return state.fn(state.arg)
    if isinstance(state, dict):
        return {k: materialize(v) for k, v in state.items()}
    return state


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

    def snapshot(self) -> dict[str, Any]:
        """The state as of the last item returned, with costly fields :class:`Deferred`;
        ``materialize(node.snapshot()) == node.state_dict()``."""
        return self.state_dict()

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
