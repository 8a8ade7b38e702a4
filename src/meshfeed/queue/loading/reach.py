"""How a store loader's worker process reaches the store: a named Ray store, or this process.

A Ray store is an actor: a worker connects to it by name (:class:`RayReach`). The embedded
store lives in the loader's memory, which worker processes do not share; :class:`LocalDoor`
serves its ``get`` to them over a local socket (``multiprocessing.connection``, with a random
key), one thread per worker, and a worker's :class:`LocalReach` calls it as it would call the
store. Batches travel as they would to a worker that fetched them itself.

Requests are served in batch-index order (:class:`Gate`): request ``j`` goes to the store once
every request before ``j`` of the same walk has, so which samples form batch ``j`` does not
depend on which worker asked first (as with one fetch thread). A request whose predecessors do
not come within its own timeout raises ``TimeoutError``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

__all__ = ["Gate", "LocalDoor", "LocalReach", "RayReach", "Reach"]


class Reach(Protocol):
    """Picklable: how a process other than the loader's connects to the store."""

    def connect(self) -> Any: ...


class RayReach:
    """A named Ray store, from a worker process: ``ray.init`` at ``address``, then connect."""

    def __init__(self, address: str, name: str) -> None:
        self.address, self.name = address, name

    def connect(self) -> Any:
        import ray

        from meshfeed.queue.store import SampleStore

        ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        return SampleStore.connect(self.name)


class LocalReach:
    """The embedded store of the loader's process, through its :class:`LocalDoor`."""

    def __init__(self, address: str, key: bytes) -> None:
        self.address, self.key = address, key

    def connect(self) -> _LocalStore:
        return _LocalStore(Client(self.address, authkey=self.key))


class _LocalStore:
    """What a worker calls in place of the store: ``get`` only (what a fetcher needs)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self._conn.send((args, kwargs))
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value


class Gate:
    """Lets one walk's requests (one token) through in batch-index order, from the index
    :meth:`open` names; a request of an older walk is not held (the store refuses it: its
    token was cancelled) and does not move the gate."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._token: object = None
        self._next = 0

    def open(self, token: object, start: int) -> None:
        """A new walk: ``token``'s requests from ``start`` on (an earlier index passes)."""
        with self._cond:
            self._token, self._next = token, start
            self._cond.notify_all()

    def enter(self, token: object, index: int, timeout: float | None) -> float | None:
        """Wait for ``index``'s turn, at most ``timeout`` s (``None``: no limit); the time left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while token == self._token and index > self._next:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"batch {index} waited {timeout:.1f} s for the request of batch "
                        f"{self._next} to reach the store (requests go in order)"
                    )
                self._cond.wait(left)
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def leave(self, token: object, index: int) -> None:
        with self._cond:
            if token == self._token and index >= self._next:
                self._next = index + 1
                self._cond.notify_all()


class LocalDoor:
    """Serves ``store.get`` to this machine's worker processes (module docstring) until
    :meth:`close`; ``reach`` is what the workers connect with."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.gate = Gate()
        key = os.urandom(32)
        self._listener = Listener(family="AF_UNIX", authkey=key)
        self.reach = LocalReach(str(self._listener.address), key)
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        _thread(self._accept, "meshfeed-store-door")

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception:  # closed, or a client that failed the handshake
                if self._closed:
                    return
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            _thread(functools.partial(self._serve, conn), "meshfeed-store-door-worker")

    def _serve(self, conn: Connection) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                args, kwargs = conn.recv()
                conn.send(self._get(args, kwargs))

    def _get(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        index, token = kwargs.get("batch_index"), kwargs.get("token")
        try:
            if index is not None:  # the wait for its turn counts against the request's timeout
                kwargs["timeout"] = self.gate.enter(token, index, _finite(kwargs.get("timeout")))
            try:
                return True, self.store.get(*args, **kwargs)
            finally:
                if index is not None:
                    self.gate.leave(token, index)
        except Exception as exc:  # raised in the worker, where the fetch was asked
            return False, exc

    def close(self) -> None:
        """Stop serving: the listener and every worker's connection closed. Idempotent; a
        forked copy's close leaves the socket file (``multiprocessing`` unlinks it only in the
        process that made it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = self._conns, []
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
            wake.connect(self.reach.address)  # a blocked accept() returns, sees the flag
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()


def _finite(timeout: float | None) -> float | None:
    return None if timeout is None or math.isinf(timeout) else timeout


def _thread(target: Callable[[], None], name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()
