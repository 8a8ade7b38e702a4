"""A real S3 API for the tests: moto's server on 127.0.0.1, and a small HTTP proxy in front of it
that counts requests and injects faults (500 answers, slow answers, throttled bodies, a stop and
a restart of the endpoint), so the client under test talks plain HTTP to a real server."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

_HOP = {"connection", "keep-alive", "expect", "transfer-encoding", "proxy-connection"}
_CHUNK = 64 << 10
_ERROR_500 = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>injected by the test proxy</Message></Error>"
)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.proxy._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.proxy._track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                out += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return bytes(out)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

    def _forward(self) -> None:
        proxy = self.server.proxy
        body = self._body()
        fail, delay, cut = proxy._on_request(
            self.command, self.path, ranged="Range" in self.headers
        )
        try:
            if delay:
                time.sleep(delay)
            if fail is True:
                self._send(500, [("Content-Type", "application/xml")], _ERROR_500)
                return
            conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            if fail:  # the request landed; its reply is lost
                self._send(500, [("Content-Type", "application/xml")], _ERROR_500)
                return
            keep = [
                (k, v)
                for k, v in resp.getheaders()
                if k.lower() not in _HOP | {"content-length", "date", "server"}
            ]
            length = resp.getheader("Content-Length") if self.command == "HEAD" else None
            self._send(resp.status, keep, data, length=length, cut=cut)
        except (ConnectionError, OSError):
            self.close_connection = True  # the client went away (timed out) or we were stopped

    def _send(
        self,
        status: int,
        headers: list[tuple[str, str]],
        data: bytes,
        length: str | None = None,
        cut: int | None = None,
    ) -> None:
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", length if length is not None else str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        for i in range(0, len(data) if cut is None else cut, _CHUNK):
            self.wfile.write(data[i : i + _CHUNK if cut is None else min(i + _CHUNK, cut)])
            if self.server.proxy.throttle:
                time.sleep(self.server.proxy.throttle)
        if cut is not None:  # the body ends short of its Content-Length: the connection drops
            self.wfile.flush()
            if self.server.proxy.on_cut is not None:
                self.server.proxy.on_cut()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up mid-answer is part of the tests


class FaultProxy:
    """HTTP proxy on 127.0.0.1 in front of ``upstream_port``.

    ``fail_next``: answer the next k requests with 500 InternalError. ``lose_next_puts``: forward
    the next k PUTs, then answer them with 500 (each landed, its reply lost). ``slow_next`` with
    ``delay``: hold the next k requests that long before answering. ``throttle``: seconds to
    sleep after each 64 KiB of a body. ``cut_next`` with ``cut_at``: end the bodies of the next
    k object GETs after ``cut_at`` bytes and drop their connections (``on_cut``, if set, is
    called first). ``counts``: requests per method since the last
    :meth:`reset`, ``object_gets``: GETs of objects (listings excluded) per path, ``whole_gets``:
    those without a Range header (a client resuming a stalled body asks for a range). :meth:`stop` closes the listening socket and every open connection (the
    endpoint is down); :meth:`start` listens again on the same port.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.fail_next = 0
        self.lose_next_puts = 0
        self.slow_next = 0
        self.delay = 0.0
        self.throttle = 0.0
        self.cut_next = 0
        self.cut_at = 0
        self.on_cut: Callable[[], None] | None = None
        self.counts: Counter[str] = Counter()
        self.object_gets: Counter[str] = Counter()  # GETs of objects (not listings), per path
        self.whole_gets: Counter[str] = Counter()  # of those, GETs without a Range header
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def _on_request(
        self, method: str, path: str, *, ranged: bool = False
    ) -> tuple[bool | str, float, int | None]:
        with self._lock:
            self.counts[method] += 1
            cut = None
            if method == "GET" and "?" not in path:
                self.object_gets[path] += 1
                self.whole_gets[path] += not ranged
                if self.cut_next > 0:
                    self.cut_next -= 1
                    cut = self.cut_at
            fail = self.fail_next > 0
            self.fail_next -= fail
            if not fail and method == "PUT" and self.lose_next_puts > 0:
                self.lose_next_puts -= 1
                fail = "after"  # forwarded, then the reply is lost (a 500 in its place)
            slow = self.slow_next > 0
            self.slow_next -= slow
        return fail, self.delay if slow else 0.0, cut

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.object_gets.clear()
            self.whole_gets.clear()
            self.fail_next = self.slow_next = self.cut_next = self.cut_at = 0
            self.lose_next_puts = 0
            self.delay = self.throttle = 0.0
            self.on_cut = None

    def start(self) -> FaultProxy:
        server = _Server(("127.0.0.1", self.port), _Handler)
        server.proxy = self
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server.shutdown()
        self._server.server_close()
        self._server = None
