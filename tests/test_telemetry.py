"""Stall telemetry: the loop's waits per step, phases, the warning and ``on_step``, per door."""

import logging
import time

import pytest
import torch

from meshfeed import DataLoader, StreamLoader
from meshfeed.delivered import Delivered
from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.sources import ShardedStream
from meshfeed.telemetry import PHASES, WARN_AFTER, StepTiming, Telemetry, WaitHistogram
from meshfeed.testing import assert_resume_equivalence
from tests.dist_utils import run_distributed


class Slow:
    """Items that take ``seconds`` each to read."""

    def __init__(self, n, seconds):
        self.n, self.seconds = n, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return torch.tensor([i])


def test_histogram_quantiles_are_within_a_bucket_and_memory_is_bounded():
    hist = WaitHistogram()
    for i in range(1, 10_001):
        hist.add(i * 1e-6)  # 1 us .. 10 ms, uniform
    size = len(hist.counts)
    assert hist.count == 10_000 and abs(hist.mean() - 5.0005e-3) < 1e-9
    assert 5e-3 <= hist.quantile(0.5) <= 5e-3 * 1.13
    assert 9.9e-3 <= hist.quantile(0.99) <= 9.9e-3 * 1.13
    hist.add(0.0)
    hist.add(1e6)  # beyond the last bucket: counted there
    assert len(hist.counts) == size and hist.count == 10_002
    assert WaitHistogram().quantile(0.5) == 0.0


def test_wait_share_on_step_and_one_warning_naming_the_fix(caplog):
    seen = []
    loader = DataLoader(
        Slow(WARN_AFTER * 2 + 8, 0.001),
        batch_size=2,
        on_step=seen.append,
        warn_wait_share=0.05,
    )
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        n = 0
        for _ in loader:
            time.sleep(0.0003)  # the loop's own work: a training step waiting for data
            n += 1
    stats = loader.stats()["delivery"]
    assert stats["steps"] == n == len(seen) and all(isinstance(s, StepTiming) for s in seen)
    assert seen[0].step_s is None and all(s.step_s >= s.wait_s for s in seen[1:])
    assert [s.steps for s in seen] == list(range(1, n + 1))
    assert stats["wait_share"] > 0.5  # reading a batch takes longer than the step
    assert stats["wait_p50_s"] >= 0.002 * 0.9 and stats["wait_p99_s"] >= stats["wait_p50_s"]
    assert stats["phases"]["produce"] >= 0.002 * n * 0.9 and stats["phases"]["plan"] > 0
    assert set(stats["phases"]) == set(PHASES)
    warnings = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(warnings) == 1 and "more workers (num_workers)" in warnings[0]


def _slow_collate(items):
    time.sleep(0.02)
    return torch.stack(items)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fetch_and_collate_seconds_are_told_apart_wherever_batches_are_made(num_workers):
    # 8 batches of 2 items: 1 ms of reading and 20 ms of collating each, in this process or
    # in the workers (their seconds travel back with each batch).
    loader = DataLoader(Slow(16, 0.0005), batch_size=2, collate_fn=_slow_collate,
                        num_workers=num_workers)  # fmt: skip
    assert len(list(loader)) == 8
    phases = loader.stats()["delivery"]["phases"]
    assert phases["collate"] >= 8 * 0.02 * 0.95
    assert 8 * 0.001 * 0.9 <= phases["fetch"] < 0.1  # with the collate it would be >= 0.16
    loader.shutdown()


def test_a_loop_that_only_collects_batches_is_not_warned(caplog):
    loader = DataLoader(Slow(WARN_AFTER * 2 + 8, 0.0005), batch_size=2, warn_wait_share=0.05)
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        assert len(list(loader)) == WARN_AFTER + 4
    assert loader.stats()["delivery"]["wait_share"] > 0.5
    assert not [r for r in caplog.records if "waited" in r.getMessage()]


def test_a_loop_slower_than_its_data_does_not_warn(caplog):
    loader = DataLoader(list(range(4 * (WARN_AFTER + 10))), batch_size=4, device="cpu")
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        for _ in loader:
            time.sleep(0.002)  # the step; the delivery thread has the next batch ready
    stats = loader.stats()["delivery"]
    assert stats["wait_share"] < 0.25, stats
    assert not [r for r in caplog.records if "waited" in r.getMessage()]


def test_stream_loader_and_store_loader_report_the_same_telemetry():
    stream = ShardedStream([lambda: range(0, 10), lambda: range(10, 20)])
    stream_loader = StreamLoader(stream, batch_size=2, seed=0)
    assert sum(1 for _ in stream_loader) == 10
    assert stream_loader.stats()["delivery"]["steps"] == 10
    store = SampleStore()
    store.put("p", {"x": list(range(9))})
    store.close("p")
    seen = []
    with StoreLoader(
        store, task="t", fields=["x"], partition="p", batch_size=3, mesh={"dp": 1}, rank=0,
        on_step=seen.append, device="cpu",
    ) as loader:  # fmt: skip
        assert [b["x"] for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
        stats = loader.stats()["delivery"]
    assert stats["steps"] == len(seen) == 3 and stats["wait_total_s"] > 0


class _StoreDoor:
    """A StoreLoader with device="cpu" plus its store's consumption: one checkpointable object."""

    def __init__(self):
        self.store = SampleStore()
        self.store.put("p", {"x": [torch.tensor([i]) for i in range(10)]})
        self.store.close("p")
        self.loader = StoreLoader(
            self.store, task="t", fields=["x"], partition="p", batch_size=2, mesh={"dp": 1},
            rank=0, device="cpu", collate_fn=_stack, prefetch=2,
        )  # fmt: skip

    def __next__(self):
        return next(self.loader)

    def state_dict(self):
        loader = self.loader.state_dict()  # first: waits for batches in flight
        return {"loader": loader, "store": self.store.state_dict()}

    def load_state_dict(self, state):
        self.store.load_state_dict(state["store"])
        self.loader.load_state_dict(state["loader"])


def test_store_loader_resume_is_exact_with_device_and_telemetry():
    out = assert_resume_equivalence(_StoreDoor, num_items=5, max_epochs=1)
    assert [b.view(-1).tolist() for b in out] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def _stack(batch):
    return torch.as_tensor(batch["x"]).view(-1)


def test_telemetry_before_any_step_and_bad_phase():
    tel = Telemetry("X")
    assert tel.report()["steps"] == 0 and tel.wait_share() == 0.0
    with pytest.raises(KeyError):
        tel.add("nap", 1.0)


def _slowest(rank, world):
    # Rank 1 reads slowly: its loop waits most; every rank learns which rank that is.
    loader = DataLoader(Slow(40, 0.004 if rank == 1 else 0.0), batch_size=2, seed=0)
    for _ in loader:
        time.sleep(0.002)
    quiet = loader.stats()["delivery"]
    return quiet, loader.delivery_stats(across_ranks=True)


@pytest.mark.slow
def test_slowest_rank_wait_on_two_gloo_ranks():
    results = run_distributed(_slowest, 2)
    for quiet, asked in results:
        assert "slowest" not in quiet  # no collective unless asked
        assert asked["slowest"]["rank"] == 1
    assert results[0][1]["slowest"]["wait_share"] == pytest.approx(results[1][1]["wait_share"])
    assert results[1][1]["wait_share"] > results[0][1]["wait_share"]


def test_slowest_rank_without_a_process_group_is_this_one():
    loader = DataLoader(list(range(8)), batch_size=2)
    list(loader)
    assert loader.delivery_stats(across_ranks=True)["slowest"]["rank"] == 0


def _door(kind, on_step, **kwargs):
    """Each door over 0..11 in order, 2 per batch; ``holder["door"]`` is what to checkpoint."""
    if kind == "store":
        store = SampleStore()
        store.put("p", {"x": list(range(12))})
        store.close("p")
        return StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=2,
                           mesh={"dp": 1}, rank=0, on_step=on_step, **kwargs)  # fmt: skip
    if kind == "stream":
        stream = ShardedStream([lambda: range(0, 6), lambda: range(6, 12)])
        return StreamLoader(stream, batch_size=2, shuffle=False, on_step=on_step, **kwargs)
    if kind == "delivered":
        return Delivered(_Items(12), on_step=on_step, **kwargs)
    return DataLoader(list(range(12)), batch_size=2, shuffle=False, on_step=on_step, **kwargs)


class _Items:
    """0..n-1 in pairs, with the count taken as its state."""

    def __init__(self, n):
        self.n, self.i = n, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 2
        return [self.i - 2, self.i - 1]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def _values(batch):
    if not isinstance(batch, (list, torch.Tensor)):  # a store Batch
        batch = batch["x"]
    return [int(v) for v in (batch.tolist() if isinstance(batch, torch.Tensor) else batch)]


def _steps(stats):
    """The steps a door's stats count (Delivered's stats are the telemetry itself)."""
    return stats["delivery"]["steps"] if "delivery" in stats else stats["steps"]


def _mark(state):
    """Where a state says the door is: the samples returned."""
    if state.get("kind") == "store_loader":
        return state["next"] * 2
    return state["i"] if "i" in state else state["position"]


DOORS = [
    ("map", {}), ("map", {"device": "cpu"}), ("map", {"num_workers": 1}), ("stream", {}),
    ("store", {}), ("store", {"device": "cpu"}), ("delivered", {"device": "cpu"}),
]  # fmt: skip


@pytest.mark.parametrize("kind, kwargs", DOORS)
def test_on_step_sees_the_batch_counted_on_every_door(kind, kwargs):
    holder, seen = {}, []

    def on_step(timing):
        door = holder["door"]
        seen.append((timing.steps, _mark(door.state_dict()), _steps(door.stats())))

    door = holder["door"] = _door(kind, on_step, **kwargs)
    with door:
        it = iter(door)
        got = [_values(next(it)) for _ in range(3)]
    assert got == [[0, 1], [2, 3], [4, 5]]
    # on_step is told of step n with the state after n batches, and the stats count n steps
    assert seen == [(1, 2, 1), (2, 4, 2), (3, 6, 3)]


@pytest.mark.parametrize("kind, kwargs", DOORS)
def test_a_raising_on_step_returns_nothing_and_counts_nothing(kind, kwargs):
    # The decision: a batch whose on_step raised is not returned. The state and the step
    # stats stay as before it, and the door serves that batch next.
    calls = []

    def on_step(timing):
        calls.append(timing.steps)
        if len(calls) == 2:
            raise KeyError("dashboard down")

    door = _door(kind, on_step, **kwargs)
    with door:
        it = iter(door)
        first = _values(next(it))
        with pytest.raises(KeyError, match="dashboard down"):
            next(it)
        assert _mark(door.state_dict()) == 2
        assert _steps(door.stats()) == 1
        it = iter(door)
        rest = [_values(b) for b in it]
        assert [first, *rest] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
        assert _steps(door.stats()) == 6
    assert calls == [1, 2, 2, 3, 4, 5, 6]
