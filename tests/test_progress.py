"""meshfeed.progress: tqdm on a terminal, periodic lines elsewhere, nothing when disabled."""

from __future__ import annotations

import io

import pytest

from meshfeed.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_disabled_writes_nothing_but_counts() -> None:
    out = io.StringIO()
    with Progress(5, desc="work", enabled=False, stream=out) as bar:
        bar.update(3)
    assert bar.count == 3
    assert out.getvalue() == ""


def test_progress_not_a_terminal_writes_periodic_lines_and_a_final_one() -> None:
    out = io.StringIO()
    bar = Progress(10, desc="work", unit="doc", stream=out, log_interval=1e-9)
    # Every update may write a line (the interval is tiny); no carriage returns in a log.
    for _ in range(4):
        bar.update(2)
    assert out.getvalue().count("\n") == 4
    bar.close()
    bar.update(2)  # after close: counted, not shown
    lines = out.getvalue().splitlines()
    assert len(lines) == 5
    assert "\r" not in out.getvalue()
    assert lines[-1].startswith("work:") and "8/10" in lines[-1] and "doc" in lines[-1]
    assert bar.count == 10


def test_progress_not_a_terminal_is_quiet_between_intervals() -> None:
    out = io.StringIO()
    with Progress(100, desc="slow", stream=out, log_interval=3600.0) as bar:
        for _ in range(100):
            bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1  # only the final line within the hour-long interval
    assert "100/100" in lines[0]


def test_progress_on_a_terminal_draws_a_tqdm_bar() -> None:
    out = _Terminal()
    with Progress(4, desc="live", unit="batch", stream=out, initial=1) as bar:
        bar.update(3)
    text = out.getvalue()
    assert "\r" in text  # redrawn in place
    assert "live" in text and "4/4" in text


def test_progress_rejects_a_non_positive_log_interval() -> None:
    with pytest.raises(ValueError, match="log_interval=0"):
        Progress(1, log_interval=0)
