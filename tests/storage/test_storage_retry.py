from __future__ import annotations

import errno
import time

import pytest

from meshfeed.errors import SourceError
from meshfeed.storage import RetryPolicy, is_transient


class _ClientError(Exception):
    """Shaped like botocore's ClientError: the status lives in ``response``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {}}


class EndpointConnectionError(Exception):
    """Named like botocore's: matched by class name, botocore is never imported."""


@pytest.mark.parametrize(
    "exc",
    [
        TimeoutError("t"),
        ConnectionResetError("reset"),
        ConnectionRefusedError("refused"),
        _ClientError(500),
        _ClientError(503),
        _ClientError(429),
        OSError(errno.EREMOTEIO, "InternalError"),
        EndpointConnectionError("no route"),
    ],
)
def test_timeouts_resets_and_5xx_are_transient(exc: Exception) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [FileNotFoundError("gone"), PermissionError("denied"), _ClientError(403), ValueError("x")],
)
def test_missing_denied_and_bad_requests_are_not(exc: Exception) -> None:
    assert not is_transient(exc)


def test_a_wrapped_transient_cause_counts() -> None:
    try:
        try:
            raise ConnectionResetError("reset by peer")
        except ConnectionResetError as inner:
            raise RuntimeError("read failed") from inner
    except RuntimeError as outer:
        assert is_transient(outer)


def test_transient_failures_are_retried_until_success() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError("reset")
        return "ok"

    seen: list[BaseException] = []
    policy = RetryPolicy(timeout=5.0, base=0.001, cap=0.01)
    assert policy.call(flaky, url="s3://b/k", on_retry=seen.append) == "ok"
    assert len(calls) == 4 and len(seen) == 3


def test_past_the_bound_a_source_error_names_the_url_and_the_last_error() -> None:
    def down() -> None:
        raise ConnectionRefusedError("connection refused")

    t0 = time.monotonic()
    with pytest.raises(SourceError, match=r"s3://b/shard-7.*ConnectionRefusedError"):
        RetryPolicy(timeout=0.3, base=0.01, cap=0.05).call(down, url="s3://b/shard-7")
    assert time.monotonic() - t0 < 2.0  # the bound (0.3 s) plus scheduling on a loaded machine


def test_a_permanent_error_is_raised_at_once() -> None:
    calls: list[int] = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("no such key")

    with pytest.raises(FileNotFoundError):
        RetryPolicy(timeout=5.0).call(missing, url="s3://b/k")
    assert len(calls) == 1


def test_pauses_grow_and_stay_within_cap_with_jitter() -> None:
    policy = RetryPolicy(base=0.1, cap=1.0)
    for attempt in range(8):
        d = min(1.0, 0.1 * 2**attempt)
        pauses = {policy.pause(attempt) for _ in range(20)}
        assert all(d / 2 <= p <= d for p in pauses)
        assert len(pauses) > 1  # jitter


def test_negative_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        RetryPolicy(timeout=-1)
