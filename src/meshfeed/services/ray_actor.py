"""The loader actor of Ray mode (:mod:`meshfeed.services.ray`): what runs inside each Ray actor.

The actor builds the dataset from the user's callable (an error there is kept and re-raised by
``describe`` with its own type), describes it to the driver, and makes every data rank's batch
of one global step with a :class:`~meshfeed.fetch.Fetcher` that it configures, and seeds, on the
first task of each configuration (so an actor that Ray restarted configures itself again).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from meshfeed.fetch import Fetcher, FetchTask
from meshfeed.order.permutation import derive_seed
from meshfeed.protocols import OrderedSource
from meshfeed.services.workers import seed_globals
from meshfeed.state import dataset_fingerprint

__all__: list[str] = []

_ACTOR_SEED_OP = 0x5241


class _LoaderActor:
    """Runs inside a Ray actor: builds the dataset from the callable, then makes batches."""

    def __init__(self, create_dataset: Callable[[], Any], index: int, count: int) -> None:
        self.index, self.count = index, count
        self.dataset: Any = None
        self.error: BaseException | None = None
        self.fetcher: Fetcher | None = None
        self.config_id: str | None = None
        try:
            self.dataset = create_dataset()
        except Exception as exc:  # re-raised by describe() with its own type and traceback
            self.error = exc

    def describe(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        ds = self.dataset
        try:
            length = len(ds)
        except TypeError:
            raise TypeError(
                f"create_dataset() returned {type(ds).__name__}, which has no len(); "
                "RayService needs a callable that returns a map-style dataset"
            ) from None
        return {
            "length": length,
            "fingerprint": dataset_fingerprint(ds),
            "has_make_order": isinstance(ds, OrderedSource),
            "pid": os.getpid(),
        }

    def make_order(self, kwargs: dict[str, Any]) -> Any:
        return self.dataset.make_order(**kwargs)

    def ping(self) -> int:
        return os.getpid()

    def fetch_step(self, config: list[Any], tasks: list[FetchTask]) -> tuple[Any, ...]:
        """Every data rank's batch of one step, then (first return) their FetchEvents."""
        fetcher = self._fetcher(config[0])
        made = [fetcher(task) for task in tasks]
        return ([events for _, events in made], *(batch for batch, _ in made))

    def _fetcher(self, config_ref: Any) -> Fetcher:
        # The configuration travels as a nested reference with every call, so an actor that
        # Ray restarted (which re-runs only __init__) configures itself on its first task.
        key = config_ref.hex()
        if self.fetcher is None or self.config_id != key:
            import ray

            config = ray.get(config_ref)
            seed_globals(derive_seed(config["seed"], _ACTOR_SEED_OP, self.index))
            fetcher = Fetcher(self.dataset, **config)
            fetcher.worker_id, fetcher.num_workers = self.index, self.count
            self.fetcher, self.config_id = fetcher, key
        return self.fetcher
