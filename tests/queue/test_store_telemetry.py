"""StoreLoader's ``stats()["delivery"]`` against known work: what every door reports, here.

- ``fetch`` and ``collate``: the fetcher's seconds, wherever it ran (``fetch`` includes the
  time a request waited in the store for producers); a batch ``on_step`` refused counts once.
- A walk's first wait includes starting the service and the ranks' start agreement.
- ``warn_wait_share=`` as on the other doors; the warning names the store's likely cause.
- ``on_error="skip"``: a skipped batch's making counts with the next batch returned.
- A ``next()`` that raised (``TimeoutError``) adds its time to the next batch's wait.

Known sleeps of 20-200 ms; bounds are generous (a loaded 2-core machine).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from meshfeed import DataLoader
from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.services import InProcessService
from meshfeed.telemetry import WARN_AFTER

COLLATE_S = 0.03
DOORS = [{"prefetch": 1}, {}, {"device": "cpu"}]


def _loader(store: SampleStore, **kwargs) -> StoreLoader:
    defaults = {"task": "t", "fields": ["x"], "partition": "p", "mesh": {"dp": 1}, "rank": 0}
    return StoreLoader(store, **{"batch_size": 2, **defaults, **kwargs})


def _filled(n: int) -> SampleStore:
    store = SampleStore()
    store.put("p", {"x": list(range(n))})
    store.close("p")
    return store


def _slow_collate(batch):  # top level: worker processes run it too
    time.sleep(COLLATE_S)
    return batch["x"]


# ---------------------------------------------------------------- fetch and collate
@pytest.mark.parametrize("kwargs", [*DOORS, {"num_workers": 2}])
def test_fetch_and_collate_are_reported_wherever_the_batch_is_made(kwargs):
    with _loader(_filled(16), collate_fn=_slow_collate, **kwargs) as loader:
        assert len(list(loader)) == 8
        phases = loader.stats()["delivery"]["phases"]
    assert phases["collate"] >= 0.8 * 8 * COLLATE_S
    assert phases["fetch"] > 0.0


@pytest.mark.parametrize("kwargs", DOORS)
def test_the_fetch_phase_includes_waiting_in_the_store_for_producers(kwargs):
    store = SampleStore()
    late = threading.Timer(0.2, lambda: (store.put("p", {"x": [0, 1]}), store.close("p")))
    late.start()
    with _loader(store, timeout=10, **kwargs) as loader:
        assert [b["x"] for b in loader] == [[0, 1]]
        phases = loader.stats()["delivery"]["phases"]
    late.join()
    assert phases["fetch"] >= 0.8 * 0.2


class _Timed:
    """A collate_fn that records how long its last call on each batch took, and how many
    calls each had; batch ``[2, 3]`` takes 0.2 s."""

    def __init__(self) -> None:
        self.last: dict[int, float] = {}
        self.calls: dict[int, int] = {}

    def __call__(self, batch):
        start = time.perf_counter()
        time.sleep(0.2 if 2 in batch["x"] else 0.02)
        first = batch["x"][0]
        self.last[first] = time.perf_counter() - start
        self.calls[first] = self.calls.get(first, 0) + 1
        return batch["x"]


@pytest.mark.parametrize("kwargs", DOORS)
def test_a_batch_refused_by_on_step_counts_its_fetch_and_collate_once(kwargs):
    calls = []

    def on_step(timing):
        calls.append(timing.steps)
        if len(calls) == 2:  # the second batch, [2, 3]: collated in 0.2 s
            raise ValueError("exporter down")

    collate = _Timed()
    with _loader(_filled(12), collate_fn=collate, on_step=on_step, **kwargs) as loader:
        it = iter(loader)
        next(it)
        one = dict(loader.stats()["delivery"]["phases"])
        with pytest.raises(ValueError, match="exporter down"):
            next(it)
        refused = loader.stats()["delivery"]["phases"]
        for phase in ("fetch", "collate", "produce", "pin", "device_copy"):
            assert refused[phase] == pytest.approx(one[phase], abs=1e-9), phase
        assert [b for b in it] == [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
        phases = loader.stats()["delivery"]["phases"]
    # The refused batch is kept, not made again, and counted once (twice, it would add 0.2 s
    # more); a batch fetched ahead and dropped by the refusal counts its last making only.
    assert collate.calls[2] == 1 and sorted(collate.last) == [0, 2, 4, 6, 8, 10]
    made = sum(collate.last.values())
    assert made * 0.99 <= phases["collate"] <= made + 0.1


# ---------------------------------------------------------------- the first wait
class _SlowStart(InProcessService):
    """An in-process service whose start takes ``seconds`` (as forking workers does)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def start(self, fetcher):
        time.sleep(self.seconds)
        super().start(fetcher)


def test_the_first_wait_includes_starting_the_service_and_the_start_agreement():
    seen = []
    loader = _loader(_filled(8), service=_SlowStart(0.15), on_step=seen.append)
    agree = loader._agree_start

    def slow_agreement():  # the ranks' agreement at the first next() (a process group)
        time.sleep(0.1)
        agree()

    loader._agree_start = slow_agreement
    start = time.perf_counter()
    next(loader)
    first = time.perf_counter() - start
    assert first >= 0.25
    assert 0.25 <= seen[0].wait_s <= first
    assert loader.stats()["delivery"]["wait_total_s"] >= 0.25
    loader.shutdown()


# ---------------------------------------------------------------- the warning
def test_warn_wait_share_is_checked_as_on_the_other_doors():
    store = _filled(4)
    assert _loader(store, warn_wait_share=0.5).telemetry.warn_wait_share == 0.5
    assert _loader(store, task="u", warn_wait_share=None).telemetry.warn_wait_share is None
    for bad in (0, 1.5, "0.3", True):
        with pytest.raises((TypeError, ValueError)) as door:
            _loader(store, task="v", warn_wait_share=bad)
        with pytest.raises(type(door.value)) as other:
            DataLoader(list(range(4)), batch_size=2, warn_wait_share=bad)
        assert str(door.value) == str(other.value)


def _fed_slowly(store: SampleStore, batches: int, seconds: float) -> threading.Thread:
    def produce():
        for i in range(batches):
            time.sleep(seconds)
            store.put("p", {"x": [2 * i, 2 * i + 1]})
        store.close("p")

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("share", [0.25, None])
def test_a_trainer_waiting_for_producers_is_told_so_or_not_at_all(caplog, share):
    store = SampleStore()
    producer = _fed_slowly(store, WARN_AFTER + 2, 0.02)  # rollouts: 20 ms per batch
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        with _loader(store, timeout=10, warn_wait_share=share) as loader:
            for _ in loader:
                time.sleep(0.002)  # the training step
    producer.join()
    warnings = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    if share is None:
        assert not warnings
        return
    assert len(warnings) == 1
    assert "producers" in warnings[0] and "stats()['store']" in warnings[0]
    assert "num_workers" not in warnings[0] and "warn_wait_share=None" in warnings[0]


# ---------------------------------------------------------------- on_error="skip"
def _skipping_collate(batch):
    if 4 in batch["x"] or 10 in batch["x"]:
        time.sleep(0.1)
        raise ValueError("bad batch")
    time.sleep(COLLATE_S)
    return batch["x"]


@pytest.mark.parametrize("kwargs", DOORS)
def test_a_skipped_batch_counts_its_making_with_the_next_batch(kwargs):
    logging.getLogger("meshfeed").setLevel(logging.ERROR)  # the skip warning
    try:
        with _loader(_filled(16), collate_fn=_skipping_collate, on_error="skip",
                     collate_retries=0, **kwargs) as loader:  # fmt: skip
            assert len(list(loader)) == 6
            stats = loader.stats()
    finally:
        logging.getLogger("meshfeed").setLevel(logging.NOTSET)
    assert stats["skipped"] == 2
    made = 2 * 0.1 + 6 * COLLATE_S  # every batch made once: 0.38 s
    phases = stats["delivery"]["phases"]
    assert phases["produce"] >= 0.9 * made
    assert phases["collate"] >= 0.9 * made
    assert stats["delivery"]["wait_total_s"] >= 0.9 * made


# ---------------------------------------------------------------- a next() that raised
@pytest.mark.parametrize("kwargs", DOORS)
def test_the_time_of_a_next_that_timed_out_counts_in_the_next_wait(kwargs):
    store = SampleStore()
    seen = []
    loader = _loader(store, timeout=0.3, on_step=seen.append, **kwargs)
    late = threading.Timer(0.45, lambda: (store.put("p", {"x": [0, 1]}), store.close("p")))
    late.start()
    waited = 0.0
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        next(loader)
    waited += time.perf_counter() - start
    start = time.perf_counter()
    assert next(loader)["x"] == [0, 1]
    waited += time.perf_counter() - start
    late.join()
    delivery = loader.stats()["delivery"]
    assert waited >= 0.4 and delivery["steps"] == 1  # the timer started first
    assert delivery["wait_total_s"] >= 0.95 * waited - 0.005
    assert seen[0].wait_s >= 0.95 * waited - 0.005
    loader.shutdown()


def test_a_next_that_on_step_refused_is_not_a_wait_for_data():
    seen = []

    def on_step(timing):
        seen.append(timing.wait_s)
        if len(seen) == 1:
            time.sleep(1.0)  # the dashboard hangs, then fails
            raise ValueError("exporter down")

    with _loader(_filled(4), prefetch=1, on_step=on_step) as loader:
        with pytest.raises(ValueError, match="exporter down"):
            next(loader)
        next(loader)  # the refused batch again: ready at once
        assert seen[1] < 0.5  # not the 1 s on_step stalled


class _TimedSkipping(_Timed):
    """:class:`_Timed`, except that batch ``[4, 5]`` fails after 0.2 s (skipped)."""

    def __call__(self, batch):
        if 4 not in batch["x"]:
            return super().__call__(batch)
        start = time.perf_counter()
        time.sleep(0.2)
        self.last[4] = time.perf_counter() - start
        self.calls[4] = self.calls.get(4, 0) + 1
        raise ValueError("bad batch")


@pytest.mark.parametrize("kwargs", DOORS)
def test_a_skipped_batch_counts_once_when_on_step_refuses_the_next(kwargs):
    calls = []

    def on_step(timing):
        calls.append(timing.steps)
        if len(calls) == 3:  # [6, 7], the batch after the skipped [4, 5]
            raise ValueError("exporter down")

    collate = _TimedSkipping()
    logging.getLogger("meshfeed").setLevel(logging.ERROR)  # the skip warning
    try:
        with _loader(_filled(10), collate_fn=collate, on_error="skip", collate_retries=0,
                     on_step=on_step, **kwargs) as loader:  # fmt: skip
            it = iter(loader)
            assert [next(it), next(it)] == [[0, 1], [2, 3]]
            with pytest.raises(ValueError, match="exporter down"):
                next(it)
            assert list(it) == [[6, 7], [8, 9]]
            stats = loader.stats()
    finally:
        logging.getLogger("meshfeed").setLevel(logging.NOTSET)
    assert stats["skipped"] == 1 and collate.calls[4] == collate.calls[6] == 1
    made = sum(collate.last.values())  # each batch's making, the skipped one's included
    phases = stats["delivery"]["phases"]
    assert made * 0.99 <= phases["collate"] <= made + 0.1  # counted twice: 0.2 s more
    if kwargs.get("prefetch") == 1:  # made on the loop's thread: produce is the making
        assert phases["produce"] >= 0.9 * made
