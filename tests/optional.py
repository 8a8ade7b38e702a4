"""Marks for tests that need an optional extra: skipped, with the reason, where it is absent."""

import importlib.util

import pytest

__all__ = ["NEEDS_ZSTD", "ZSTD", "importable"]


def importable(module: str) -> bool:
    """Whether ``module`` is installed here (found by the import system, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it
        return False


#: For a test that writes or reads zstd-compressed data.
NEEDS_ZSTD = pytest.mark.skipif(
    not importable("zstandard"),
    reason='needs zstandard (pip install "meshfeed[zstd]"), which is not installed',
)
#: The ``"zstd"`` value of a ``compression`` parameter, skipped without zstandard.
ZSTD = pytest.param("zstd", marks=NEEDS_ZSTD, id="zstd")
