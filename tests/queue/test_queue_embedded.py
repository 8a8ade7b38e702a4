"""The embedded backend: condition-variable waits with deadlines, no polling."""

from __future__ import annotations

import threading
import time

import pytest

from meshfeed.queue.embedded import wait_for


def test_wait_for_times_out_after_its_deadline_and_counts_the_waiter():
    cond = threading.Condition()
    waiting: list[int] = []
    start = time.monotonic()
    with cond, pytest.raises(TimeoutError, match="demo timed out after 0.05s"):
        wait_for(cond, lambda: None, 0.05, "demo", waiting.append)
    assert 0.04 <= time.monotonic() - start < 2
    assert waiting == [1, -1]  # entered and left the waiting count


def test_wait_for_wakes_on_notify_not_on_a_timer():
    cond = threading.Condition()
    box: list[int] = []
    attempts = 0

    def attempt() -> int | None:
        nonlocal attempts
        attempts += 1
        return box[0] if box else None

    def notify() -> None:
        with cond:
            box.append(7)
            cond.notify_all()

    timer = threading.Timer(0.1, notify)
    timer.start()
    with cond:
        assert wait_for(cond, attempt, 10, "demo", lambda d: None) == 7
    assert attempts == 2  # once before waiting, once after the single notification
