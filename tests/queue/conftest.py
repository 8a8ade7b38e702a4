"""Backends for the queue tests: every behavioural test runs on the embedded store and on Ray.

Starting a Ray actor process costs seconds on a busy machine, so the Ray stores of the
behavioural suite share one actor, re-initialised empty for every store a test makes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from meshfeed.queue import SampleStore
from meshfeed.queue.engine.core import StoreOptions
from meshfeed.testing import reset_store

BACKENDS = [pytest.param("embedded"), pytest.param("ray", marks=pytest.mark.ray)]


@pytest.fixture(scope="session")
def ray_store(ray_session: Any) -> Iterator[SampleStore]:
    """One Ray-backed store (one actor process) for the whole session."""
    store = SampleStore("ray")
    yield store
    store.shutdown()


@pytest.fixture(params=BACKENDS)
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable[..., SampleStore]]:
    """A factory of empty stores on the parametrised backend (one store per test on Ray)."""
    backend = request.param
    made = 0

    def factory(**kwargs: Any) -> SampleStore:
        nonlocal made
        if backend == "embedded":
            return SampleStore(backend, **kwargs)
        assert made == 0, "Ray tests make one store each (they share one actor)"
        made += 1
        shared: SampleStore = request.getfixturevalue("ray_store")
        options = StoreOptions(
            capacity=kwargs.get("capacity"),
            fields=None if kwargs.get("fields") is None else tuple(kwargs["fields"]),
            tasks=None if kwargs.get("tasks") is None else tuple(kwargs["tasks"]),
            lease_timeout=kwargs.get("lease_timeout"),
        )
        return reset_store(shared, options)

    yield factory
