"""A real HTTP server on 127.0.0.1 that serves a directory with byte ranges (HTTP 206), as
static file servers and object stores do; it counts the requests it answers."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _RangeHandler(SimpleHTTPRequestHandler):
    requests: list[str]

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.requests.append(f"GET {self.path} {self.headers.get('Range')}")
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        path = self.translate_path(self.path)
        if m is None or not os.path.isfile(path):
            return super().do_GET()
        size = os.path.getsize(path)
        lo, hi = int(m.group(1)), min(int(m.group(2)), size - 1)
        if lo >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.end_headers()
            return
        with open(path, "rb") as f:
            f.seek(lo)
            data = f.read(hi - lo + 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {lo}-{hi}/{size}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_HEAD(self) -> None:
        self.requests.append(f"HEAD {self.path}")
        super().do_HEAD()


@contextlib.contextmanager
def serve(directory: str) -> Iterator[tuple[str, list[str]]]:
    """``(base URL, request log)`` of a server over ``directory`` while the block runs."""
    log: list[str] = []
    handler = type("Handler", (_RangeHandler,), {"requests": log})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=directory))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
