"""What ``stats()["delivery"]`` and ``on_step`` report, against known waits and known work.

- The quantiles: at least the true wait and at most one bucket (4.9 %) above it.
- A walk's first ``next()``: its wait is everything that ``next()`` spent (starting the
  service, draining what a dropped walk left in flight), not only the delivery stage's part.
- A batch whose ``on_step`` raised is served again by the next walk: its phases count once.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from meshfeed import DataLoader
from meshfeed.services import InProcessService
from meshfeed.telemetry import Telemetry, WaitHistogram
from tests.test_telemetry import Slow

#: The documented bound: a quantile is never below the true wait, and at most this above it.
WIDTH = 0.05
EPS = 1e-12  # float rounding at a bucket's edge


def _within(reported: float, true: float) -> bool:
    return true * (1 - EPS) <= reported <= true * (1 + WIDTH + EPS)


@pytest.mark.parametrize("wait", [2e-7, 1e-6, 7.3e-6, 1e-4, 5e-4, 1e-3, 2e-3, 0.01, 0.3, 1.0, 42.0])
def test_a_constant_wait_is_reported_within_the_documented_bound(wait):
    hist = WaitHistogram()
    for _ in range(100):
        hist.add(wait)
    for q in (0.0, 0.5, 0.99, 1.0):
        assert _within(hist.quantile(q), wait), (q, hist.quantile(q) / wait - 1)


def test_every_wait_on_a_fine_grid_is_reported_within_the_bound():
    # 2000 log-spaced waits from 1 us to 100 s, bucket edges included: each alone.
    for k in range(2001):
        wait = 1e-6 * 10 ** (k / 250)
        hist = WaitHistogram()
        hist.add(wait)
        assert _within(hist.quantile(0.5), wait), (wait, hist.quantile(0.5) / wait - 1)


def test_quantiles_of_a_spread_of_waits_are_those_of_the_nearest_rank():
    waits = [1e-5 * (1 + i) ** 1.5 for i in range(1000)]  # 10 us .. ~0.32 s
    hist = WaitHistogram()
    for w in reversed(waits):
        hist.add(w)
    for q in (0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0):
        true = sorted(waits)[math.ceil(q * len(waits)) - 1]  # the ceil(q n)-th smallest
        assert _within(hist.quantile(q), true), (q, hist.quantile(q) / true - 1)


def test_the_telemetry_report_of_known_waits():
    tel = Telemetry("x", warn_wait_share=None)
    for k in range(100):
        tel.took(float(k), float(k) + 0.002)  # every wait 2 ms
        tel.returned()
    report = tel.report()
    assert report["steps"] == 100 and report["wait_mean_s"] == pytest.approx(0.002)
    assert _within(report["wait_p50_s"], 0.002) and _within(report["wait_p99_s"], 0.002)


# ---------------------------------------------------------------- a walk's first next()
class _SlowStart(InProcessService):
    """An in-process service whose start and map take known time before any batch is made
    (as forking workers, or draining batches an abandoned walk left in flight, do)."""

    def __init__(self, start_s: float, map_s: float) -> None:
        super().__init__()
        self.start_s, self.map_s = start_s, map_s

    def start(self, fetcher):
        time.sleep(self.start_s)
        super().start(fetcher)

    def map(self, tasks):
        time.sleep(self.map_s)
        return super().map(tasks)


def _timed_next(it) -> float:
    start = time.perf_counter()
    next(it)
    return time.perf_counter() - start


@pytest.mark.parametrize("device", [None, "cpu"])
def test_the_first_wait_includes_starting_the_service_and_its_map(device):
    seen = []
    loader = DataLoader(
        list(range(40)), batch_size=2, seed=0, device=device, on_step=seen.append,
        service=_SlowStart(0.15, 0.1), warn_wait_share=None,
    )  # fmt: skip
    it = iter(loader)
    first = _timed_next(it)
    assert first >= 0.25
    assert seen[0].wait_s >= 0.25 and seen[0].wait_s <= first
    rest = []
    for _ in range(5):
        time.sleep(0.01)  # the loop's own work
        rest.append(_timed_next(it))
    stats = loader.stats()["delivery"]
    # What the loop waited, all of it: the first next() included.
    assert stats["wait_total_s"] == pytest.approx(first + sum(rest), abs=0.02)
    assert stats["wait_total_s"] >= 0.25
    # A new walk (iter again): its first next() runs map() again, also counted.
    it = iter(loader)
    again = _timed_next(it)
    assert again >= 0.1 and seen[-1].wait_s >= 0.1 and seen[-1].wait_s <= again
    loader.shutdown()


def test_the_first_wait_after_a_break_includes_draining_the_batches_in_flight():
    seen = []
    loader = DataLoader(
        Slow(64, 0.05), batch_size=2, num_workers=2, prefetch=2, seed=0,
        on_step=seen.append, warn_wait_share=None,
    )  # fmt: skip
    it = iter(loader)
    first = _timed_next(it)
    assert seen[-1].wait_s >= 0.9 * first - 0.005
    it = iter(loader)  # break at once: batches are still being made; a new loop
    waited = _timed_next(it)  # drains them (~0.2 s), then waits for its own batch
    assert waited > 0.15
    assert seen[-1].wait_s >= 0.9 * waited - 0.005
    stats = loader.stats()["delivery"]
    assert stats["wait_total_s"] >= 0.9 * (first + waited) - 0.01
    loader.shutdown()


# ---------------------------------------------------------------- a refused on_step
def _phases(loader):
    return dict(loader.stats()["delivery"]["phases"])


class _Costly(Slow):
    """Samples 2 and 3 (the second batch in order) take ``slow`` seconds, the others ``seconds``."""

    def __init__(self, n: int, seconds: float, slow: float) -> None:
        super().__init__(n, seconds)
        self.slow = slow

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.slow if i in (2, 3) else self.seconds)
        return torch.tensor([i])


@pytest.mark.parametrize("kwargs", [{}, {"device": "cpu"}, {"num_workers": 1}])
def test_a_batch_refused_by_on_step_counts_its_phases_once(kwargs):
    calls = []

    def on_step(timing):
        calls.append(timing.steps)
        if len(calls) == 2:  # the second batch: samples 2 and 3, 0.1 s each
            raise ValueError("exporter down")

    loader = DataLoader(
        _Costly(8, 0.01, slow=0.1), batch_size=2, shuffle=False, on_step=on_step,
        warn_wait_share=None, **kwargs,
    )  # fmt: skip
    it = iter(loader)
    next(it)
    one = _phases(loader)
    with pytest.raises(ValueError, match="exporter down"):
        next(it)
    # State and stats as before the refused batch: its phases too.
    refused = _phases(loader)
    for phase in ("fetch", "collate", "produce", "pin", "device_copy"):
        assert refused[phase] == pytest.approx(one[phase], abs=1e-9), phase
    assert loader.stats()["delivery"]["steps"] == 1 and loader.position == 2
    rest = list(it)  # the refused batch again, then the rest
    assert [b.view(-1).tolist() for b in rest] == [[2, 3], [4, 5], [6, 7]]
    assert loader.stats()["delivery"]["steps"] == 4
    end = _phases(loader)
    once = 2 * 0.1 + 6 * 0.01  # each batch made once; the refused one twice: 0.46 s
    assert once <= end["fetch"] < once + 0.1
    if "num_workers" not in kwargs:  # in this process or its delivery thread: made = produce
        assert once <= end["produce"] < once + 0.1
    loader.shutdown()


def _steps(t: Telemetry, first_wait: float, wait: float, work: float, n: int) -> None:
    """``n`` steps of a loop working ``work`` s between batches, waiting ``wait`` s for each
    (the first ``first_wait`` s: start-up), on simulated clocks."""
    now = 0.0
    for i in range(n):
        asked, now = now, now + (first_wait if i == 0 else wait)
        t.took(asked, now)
        t.returned()
        now += work


def test_the_wait_warning_leaves_out_the_first_steps_start_up(caplog):
    # Workers that take 2 s to start, then a loop that waits 0.1 ms per 10 ms step: the share
    # since the first ask is 80 %, but more workers would not help; a warning would mislead.
    quiet = Telemetry("loader")
    with caplog.at_level("WARNING", logger="meshfeed"):
        _steps(quiet, 2.0, 1e-4, 1e-2, 50)
    assert quiet.wait_share() > 0.75 and not caplog.records
    slow = Telemetry("loader")  # waiting 20 ms per 10 ms step after it: warned, by share
    with caplog.at_level("WARNING", logger="meshfeed"):
        _steps(slow, 2.0, 2e-2, 1e-2, 50)
    assert len(caplog.records) == 1 and "waited 67% of its time" in caplog.records[0].message
