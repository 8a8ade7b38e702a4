"""Shared fixtures: one local Ray runtime per test session, started only if a test asks; tests
marked ``gpu`` are skipped, naming the reason, where CUDA is missing, and tests marked ``ray``
where Ray is."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.optional import importable

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[object]:
    """A local Ray (2 CPUs) shared by every Ray test in the session."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests without CUDA and ``ray`` tests without Ray, naming the reason (never
    deselected: where CUDA or Ray is, they run)."""
    ray = [item for item in items if item.get_closest_marker("ray") is not None]
    if ray and not importable("ray"):
        skip = pytest.mark.skip(reason='needs ray (pip install "meshfeed[ray]"), not installed')
        for item in ray:
            item.add_marker(skip)
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here")
    for item in gpu:
        item.add_marker(skip)
