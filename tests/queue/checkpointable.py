"""A StoreLoader with its store as one checkpointable object, for the resume harness."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshfeed.queue import SampleStore, StoreLoader


class StoreWithLoader:
    """``next()`` is ``item(next(loader))``; the state is the loader's, then its store's (the
    two saved between the same two batches, as a training job saves them)."""

    def __init__(
        self, store: SampleStore, loader: StoreLoader, item: Callable[[Any], Any] = lambda b: b
    ) -> None:
        self.store, self.loader, self.item = store, loader, item

    def __next__(self) -> Any:
        return self.item(next(self.loader))

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "store": self.store.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.store.load_state_dict(state["store"])
        self.loader.load_state_dict(state["loader"])
