"""How a store loader's worker process reaches the store: a named Ray store, or this process.

A Ray store is an actor: a worker connects to it by name (:class:`RayReach`). The embedded
store lives in the loader's memory, which worker processes do not share; :class:`LocalDoor`
serves its ``get`` to them over a local socket (``multiprocessing.connection``, with a random
key), on one thread, and a worker's :class:`LocalReach` calls it as it would call the store.
Batches travel as they would to a worker that fetched them itself.

Requests are served in batch-index order: request ``j`` of a walk (one token, named by
:meth:`LocalDoor.open`) goes to the store once every request before ``j`` has, so which samples
form batch ``j`` does not depend on which worker asked first (as with one fetch thread); one
that came early waits its turn, within its own timeout (then ``TimeoutError``). A request of an
older walk is answered at once (the store refuses its cancelled token) and moves nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, Protocol

__all__ = ["LocalDoor", "LocalReach", "RayReach", "Reach"]


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


class LocalDoor:
    """Serves ``store.get`` to this machine's worker processes (module docstring) until
    :meth:`close`; ``reach`` is what the workers connect with."""

    def __init__(self, store: Any) -> None:
        self.store = store
        key = os.urandom(32)
        self._listener = Listener(family="AF_UNIX", authkey=key)
        self.reach = LocalReach(str(self._listener.address), key)
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self._lock = threading.Lock()
        self._new: list[Connection] = []  # accepted, not yet served
        self._token: object = None  # the walk served in order, from index _next
        self._next = 0
        self._closed = False
        _thread(self._accept, "meshfeed-store-door")
        _thread(self._serve, "meshfeed-store-door-serve")

    def open(self, token: object, start: int) -> None:
        """A new walk: ``token``'s requests in index order from ``start`` (earlier: at once)."""
        with self._lock:
            self._token, self._next = token, start
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send_bytes(b"")

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
                self._new.append(conn)
            self._wake()

    def _serve(self) -> None:
        conns: list[Connection] = []
        early: dict[int, _Request] = {}  # came before their turn, by batch index
        while not self._closed:
            with self._lock:
                conns += self._new
                self._new.clear()
            soonest = min((r.deadline for r in early.values() if r.deadline), default=None)
            left = None if soonest is None else max(0.0, soonest - time.monotonic())
            for ready in wait([self._wake_r, *conns], left):
                if ready is self._wake_r:
                    with contextlib.suppress(EOFError, OSError):
                        self._wake_r.recv_bytes()
                    continue
                assert isinstance(ready, Connection)
                request = _Request.read(ready)
                if request is None:  # the worker is gone
                    conns.remove(ready)
                    ready.close()
                elif self._in_turn(request):
                    self._answer(request)
                else:
                    early[request.index] = request
            self._answer_due(early)
        for conn in [*conns, self._wake_r, self._wake_w]:
            conn.close()

    def _in_turn(self, request: _Request) -> bool:
        with self._lock:
            return request.token != self._token or request.index <= self._next

    def _answer_due(self, early: dict[int, _Request]) -> None:
        """The early requests whose turn came (in order), of an older walk, or out of time."""
        while True:
            with self._lock:
                token, nxt = self._token, self._next
            due = [i for i, r in early.items() if i == nxt or r.token != token or r.late()]
            if not due:
                return
            for index in sorted(due):
                self._answer(early.pop(index))

    def _answer(self, request: _Request) -> None:
        try:
            if request.late():
                raise TimeoutError(
                    f"batch {request.index} waited {request.timeout:.1f} s for the requests "
                    "before it to reach the store (requests go in index order)"
                )
            request.kwargs["timeout"] = request.left()
            reply: tuple[bool, Any] = (True, self.store.get(*request.args, **request.kwargs))
        except Exception as exc:  # raised in the worker, where the fetch was asked
            reply = (False, exc)
        with self._lock:
            if request.token == self._token and request.index >= self._next:
                self._next = request.index + 1
        with contextlib.suppress(OSError):
            request.conn.send(reply)

    def close(self) -> None:
        """Stop serving: the listener and every worker's connection closed. Idempotent; a
        forked copy's close leaves the socket file (``multiprocessing`` unlinks it only in the
        process that made it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            new, self._new = self._new, []
        self._wake()  # the serving thread sees the flag and closes its connections
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
            wake.connect(self.reach.address)  # a blocked accept() returns, sees the flag
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in new:
            conn.close()


class _Request:
    """One ``get`` a worker sent: its batch index, token and timeout."""

    __slots__ = ("args", "conn", "deadline", "index", "kwargs", "timeout", "token")

    def __init__(self, conn: Connection, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.conn, self.args, self.kwargs = conn, args, kwargs
        index = kwargs.get("batch_index")
        self.index = -1 if index is None else int(index)  # no index: served at once
        self.token = kwargs.get("token")
        # checked by the loader (check_timeout): None or finite
        self.timeout: float | None = kwargs.get("timeout")
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout

    @classmethod
    def read(cls, conn: Connection) -> _Request | None:
        try:
            args, kwargs = conn.recv()
        except (EOFError, OSError):
            return None
        return cls(conn, args, kwargs)

    def left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def late(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def _thread(target: Callable[[], None], name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()
