"""Retries for remote reads: which failures are transient, and a bounded backoff around a call.

A network read fails in ordinary ways (a timeout, a reset connection, a 5xx answer, a server
that restarts); those are retried with exponential backoff and jitter until ``timeout`` seconds
have passed since the first attempt, then one :class:`~meshfeed.errors.SourceError` names the
URL, the number of attempts and the last error. A server that refuses every connection (or a
host that does not resolve) is a wrong endpoint far more often than a restart: it is given
only ``refused`` seconds (3 by default), then the error names the URL and the endpoint. Both
bounds count whole calls: a call in flight ends first, with the retries of the client library
itself (botocore's default ones make a refused call take seconds), which are left as the
caller configured them.
Every other failure (a missing object, a denied
request, a bad argument) is raised at once: waiting would not change it.
"""

from __future__ import annotations

import errno
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from meshfeed.errors import SourceError

__all__ = ["RetryPolicy", "is_transient"]

T = TypeVar("T")

# Exception classes of botocore, aiohttp, urllib3 and fsspec that mean "try again", matched by
# name so that none of those libraries needs importing here.
_TRANSIENT_NAMES = frozenset(
    {
        "ClientConnectionError",
        "ClientPayloadError",
        "ConnectTimeoutError",
        "ConnectionClosedError",
        "EndpointConnectionError",
        "FSTimeoutError",
        "HTTPClientError",
        "IncompleteRead",
        "ProtocolError",
        "ReadTimeoutError",
        "ResponseStreamingError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,  # s3fs: SlowDown / ServiceUnavailable
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.EPIPE,
        errno.ETIMEDOUT,
        getattr(errno, "EREMOTEIO", 121),  # s3fs: InternalError / 500
    }
)
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


#: Class names of connection failures before any byte reached a server (botocore, aiohttp).
_REFUSED_NAMES = frozenset({"EndpointConnectionError", "ClientConnectorError"})


def is_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is a connection that never reached a server: refused,
    or a host name that does not resolve."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (ConnectionRefusedError, socket.gaierror)) or (
            isinstance(cur, OSError) and cur.errno == errno.ECONNREFUSED
        ):
            return True
        if _REFUSED_NAMES.intersection(c.__name__ for c in type(cur).__mro__):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (botocore ``response``, aiohttp ``status``)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata") or {}
        code = meta.get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _transient_here(exc: BaseException) -> bool | None:
    """True / False where ``exc`` itself decides; None to look at its cause."""
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, socket.timeout)):
        return True
    status = _status(exc)
    if status is not None and (status >= 500 or status in (408, 429)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if _TRANSIENT_NAMES.intersection(c.__name__ for c in type(exc).__mro__):
        return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is worth retrying.

    Timeouts, refused or reset connections, HTTP 5xx / 408 / 429, and the equivalents of
    botocore, aiohttp and fsspec are transient; a missing object or a denied request is not.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        verdict = _transient_here(cur)
        if verdict is not None:
            return verdict
        cur = cur.__cause__ or cur.__context__
    return False


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, bounded by a total wait.

    ``timeout``: seconds from the first attempt after which no new attempt starts (an attempt
    in flight finishes or times out on its own client timeout). ``base`` and ``cap``: the
    first and the largest pause; pause ``n`` is drawn from ``[d/2, d]`` with
    ``d = min(cap, base * 2**n)``, so concurrent clients do not retry in step. ``refused``:
    the bound (at most ``timeout``) while every attempt so far was refused or did not resolve.
    """

    timeout: float = 60.0
    base: float = 0.05
    cap: float = 2.0
    refused: float = 3.0

    def __post_init__(self) -> None:
        for name in ("timeout", "base", "cap", "refused"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds (got {value!r})")

    def pause(self, attempt: int) -> float:
        d = min(self.cap, self.base * 2.0**attempt)
        return d / 2 + random.uniform(0.0, d / 2)

    def call(
        self,
        fn: Callable[[], T],
        *,
        url: str,
        action: str = "read",
        on_retry: Callable[[BaseException], Any] | None = None,
        endpoint: str | None = None,
    ) -> T:
        """``fn()``, retried on transient errors; a :class:`SourceError` naming ``url`` (and
        ``endpoint``, the server asked, where given) past the bound.

        A permanent error is raised unchanged (``FileNotFoundError`` and the like).
        """
        start = time.monotonic()
        attempt = 0
        refused = True  # every attempt so far refused: a wrong endpoint, given little time
        while True:
            try:
                return fn()
            except Exception as e:
                if not is_transient(e):
                    raise
                refused = refused and is_refused(e)
                elapsed = time.monotonic() - start
                delay = self.pause(attempt)
                attempt += 1
                bound = min(self.refused, self.timeout) if refused else self.timeout
                if elapsed + delay > bound:
                    raise self._failure(url, endpoint, action, attempt, elapsed, refused, e) from e
                if on_retry is not None:
                    on_retry(e)
                time.sleep(delay)

    def _failure(
        self,
        url: str,
        endpoint: str | None,
        action: str,
        attempt: int,
        elapsed: float,
        refused: bool,
        e: BaseException,
    ) -> SourceError:
        at = f" at {endpoint}" if endpoint else ""
        last = f"last error: {type(e).__name__}: {e}"
        if refused:
            return SourceError(
                f"cannot {action} {url}: the server{at} refused every connection ({attempt} "
                f"attempts over {elapsed:.1f} s; {last}); check the endpoint (endpoint_url in "
                "storage_options, or AWS_ENDPOINT_URL) and that the server is running"
            )
        return SourceError(
            f"cannot {action} {url}{at}: {attempt} attempts failed over {elapsed:.1f} s "
            f"(retry_timeout={self.timeout:g} s); {last}; check the endpoint and the network, "
            "or raise retry_timeout"
        )
