"""Group the items of a node into lists of ``batch_size``."""

from __future__ import annotations

from typing import Any, TypeVar

from meshfeed.nodes.base import Node
from meshfeed.state import envelope, open_envelope

T = TypeVar("T")

__all__ = ["Batcher"]


class Batcher(Node[list[T]]):
    """Lists of ``batch_size`` items; the last short list is dropped when ``drop_last``.

    Each batch is one ``source.next_many(batch_size)`` call, so a source that works in bulk
    pays its per-call cost once per batch. The state is the source's state after the last
    item of the last batch returned (nested under ``"source"``), so a restore never splits a
    batch.
    """

    KIND, VERSION = "node.batcher", 1

    def __init__(self, source: Node[T], *, batch_size: int, drop_last: bool = True) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (got {batch_size=!r})")
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last must be a bool (got {drop_last=!r})")
        self.source, self.batch_size, self.drop_last = source, batch_size, drop_last

    def next(self) -> list[T]:
        batch = self.source.next_many(self.batch_size)
        if not batch or (self.drop_last and len(batch) < self.batch_size):
            raise StopIteration
        return batch

    def state_dict(self) -> dict[str, Any]:
        return envelope(self.KIND, self.VERSION, **{self.SOURCE_KEY: self.source.state_dict()})

    def snapshot(self) -> dict[str, Any]:
        return envelope(self.KIND, self.VERSION, **{self.SOURCE_KEY: self.source.snapshot()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = open_envelope(
            state, kind=self.KIND, version=self.VERSION, fields={self.SOURCE_KEY: dict}
        )
        self.source.load_state_dict(s[self.SOURCE_KEY])
