"""Shared fixtures: one local Ray runtime per test session, started only if a test asks; tests
marked ``gpu`` are skipped, naming the reason, where CUDA is missing."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

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
    """Skip ``gpu`` tests without CUDA (never deselected: where CUDA is, they run)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here")
    for item in gpu:
        item.add_marker(skip)
