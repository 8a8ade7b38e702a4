"""Group the items of a node into lists of ``batch_size``."""

from __future__ import annotations

from typing import Any, TypeVar

from meshfeed.nodes.base import Node

T = TypeVar("T")

__all__ = ["Batcher"]


class Batcher(Node[list[T]]):
    """Lists of ``batch_size`` items; the last short list is dropped when ``drop_last``.

    The state is the source's state after the last item of the last batch returned, so a
    restore never splits a batch.
    """

    def __init__(self, source: Node[T], *, batch_size: int, drop_last: bool = True) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (got {batch_size=!r})")
        self.source, self.batch_size, self.drop_last = source, batch_size, drop_last

    def next(self) -> list[T]:
        batch: list[T] = []
        while len(batch) < self.batch_size:
            try:
                batch.append(self.source.next())
            except StopIteration:
                break
        if not batch or (self.drop_last and len(batch) < self.batch_size):
            raise StopIteration
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.get_state()}

    def restore(self, state: dict[str, Any]) -> None:
        if self.SOURCE_KEY not in state:
            raise ValueError(f"batcher state is missing {self.SOURCE_KEY!r} (got {state!r})")
        self.source.restore(state[self.SOURCE_KEY])
