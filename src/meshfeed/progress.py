"""Progress of long offline jobs (convert, analyze, demo), drawn by ``tqdm``.

On a terminal the bar is tqdm's, redrawn in place. Elsewhere (CI logs, files, pipes) a line is
written every ``log_interval`` seconds and once at the end, so a log shows progress while a job
runs without filling up with redraws. ``enabled=False`` writes nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class Progress:
    """A progress bar on stderr: ``desc: done/total [elapsed, rate]``.

    ``initial`` counts work done before this bar started (a resumed epoch), so the rate is of
    this run only. The API is the same with or without a terminal.

    >>> with Progress(total=3, desc="work", enabled=False) as bar:
    ...     for _ in range(3):
    ...         bar.update()
    >>> bar.count
    3
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "",
        unit: str = "it",
        unit_scale: bool = False,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.25,
        initial: int = 0,
        log_interval: float = 5.0,
    ) -> None:
        if interval < 0 or not log_interval > 0:
            raise ValueError(
                f"intervals must be positive (got {interval=!r}, {log_interval=!r}); "
                "use e.g. interval=0.25, log_interval=5.0"
            )
        self.total = total
        self.desc = desc
        self.unit = unit
        self.unit_scale = unit_scale
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.log_interval = log_interval
        self.count = initial
        self._initial = initial
        self._start = time.perf_counter()
        self._last_line = self._start
        self._live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: tqdm | None = None
        if self.enabled and self._live:
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=unit_scale,
                initial=initial,
                file=self.stream,
                mininterval=interval,
                dynamic_ncols=True,
                leave=True,
            )

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        self.count += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last_line >= self.log_interval:
            self._last_line = now
            self._write_line(now)

    def _write_line(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        line = tqdm.format_meter(
            self.count,
            self.total,
            elapsed,
            prefix=self.desc,
            unit=self.unit,
            unit_scale=self.unit_scale,
            rate=(self.count - self._initial) / elapsed,
            initial=self._initial,
            ncols=0,
        )
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Write the final state (once); later updates are counted but not shown."""
        if not self.enabled:
            return
        self.enabled = False
        if self._bar is not None:
            self._bar.close()
        else:
            self._write_line(time.perf_counter())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
