"""A dependency-free progress bar for long offline jobs (convert, analyze, demo)."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO


class Progress:
    """Prints ``desc: done/total (rate/s)`` to stderr at most a few times per second.

    >>> with Progress(total=3, desc="work", enabled=False) as bar:
    ...     for _ in range(3):
    ...         bar.update()
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "",
        unit: str = "it",
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.25,
        initial: int = 0,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.count = initial
        self._initial = initial
        self._start = time.perf_counter()
        self._last = 0.0
        # Redraw in place on a terminal; elsewhere (CI logs) print only the final line.
        self._live = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1) -> None:
        self.count += n
        now = time.perf_counter()
        if self.enabled and self._live and now - self._last >= self.interval:
            self._last = now
            self._render(now, end="\r")

    def _render(self, now: float, end: str) -> None:
        elapsed = max(now - self._start, 1e-9)
        of = f"/{self.total}" if self.total is not None else ""
        pct = f" {100 * self.count / self.total:5.1f}%" if self.total else ""
        self.stream.write(
            f"{self.desc}: {self.count}{of}{pct} [{elapsed:.1f}s, "
            f"{(self.count - self._initial) / elapsed:.1f} {self.unit}/s]{end}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._render(time.perf_counter(), end="\n")
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
