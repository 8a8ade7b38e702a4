"""Marks for tests that need an optional extra: skipped, with the reason, where it is absent.

Property tests import ``given``, ``settings``, ``st`` (and ``assume``, ``HealthCheck``) from
here, not from hypothesis: where hypothesis is missing they are stand-ins that skip each
property test with the reason, so the rest of its file still runs (#27)."""

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest

__all__ = [
    "NEEDS_HTTP",
    "NEEDS_HYPOTHESIS",
    "NEEDS_ZSTD",
    "ZSTD",
    "HealthCheck",
    "assume",
    "given",
    "importable",
    "settings",
    "st",
]


def importable(module: str) -> bool:
    """Whether ``module`` is installed here (found by the import system, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module without a spec
        return False


#: For a test that writes or reads zstd-compressed data.
NEEDS_ZSTD = pytest.mark.skipif(
    not importable("zstandard"),
    reason='needs zstandard (pip install "meshfeed[zstd]"), which is not installed',
)
#: The ``"zstd"`` value of a ``compression`` parameter, skipped without zstandard.
ZSTD = pytest.param("zstd", marks=NEEDS_ZSTD, id="zstd")
#: For a test that reads http:// URLs: fsspec's http filesystem needs aiohttp.
NEEDS_HTTP = pytest.mark.skipif(
    not importable("aiohttp"),
    reason='reading http:// needs aiohttp (pip install "meshfeed[remote]"), which is not installed',
)
#: For a property test: skipped where hypothesis (the test extra) is missing.
NEEDS_HYPOTHESIS = pytest.mark.skipif(
    not importable("hypothesis"),
    reason='needs hypothesis (pip install "meshfeed[test]"), which is not installed',
)


class _Anything:
    """A strategy, health check or ``settings`` stand-in: every use gives one back, never runs."""

    def __getattr__(self, name: str) -> "_Anything":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> "_Anything":
        return self

    def __or__(self, other: object) -> "_Anything":
        return self


class _Settings(_Anything):
    """``@settings(...)`` without hypothesis: leaves the test as it is (``given`` skips it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self


def _given(*args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@given(...)`` without hypothesis: the property test is skipped, naming the extra."""
    return NEEDS_HYPOTHESIS


def _assume(condition: object) -> bool:
    """Never reached without hypothesis (``given`` skips the test first)."""
    return bool(condition)


if importable("hypothesis"):
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st
else:
    HealthCheck = _Anything()
    st = _Anything()
    settings = _Settings()
    given = _given
    assume = _assume
