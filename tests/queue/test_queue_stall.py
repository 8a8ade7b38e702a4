"""Stalls at capacity (#28): a get that can never be served is refused at once; producers and
consumers that wait on each other are named (a warning when it starts, the TimeoutError);
puts and gets that cannot wait on each other never stall, over many random trials."""

from __future__ import annotations

import logging
import random
import threading

import pytest

from meshfeed.queue import PartitionClosed, RankAwareSampler, SampleStore
from meshfeed.queue.engine import stall


def test_a_get_larger_than_the_capacity_is_refused_at_once(make_store):
    store = make_store(capacity=4)
    with pytest.raises(ValueError, match=r"batch_size=5.*capacity=4 can ever hold"):
        store.get("t", ["x"], 5, "p", timeout=30)
    round_of_two = RankAwareSampler(data_rank=0, data_world_size=2)
    with pytest.raises(ValueError, match=r"plans 6 samples at once"):
        store.get("t", ["x"], 3, "p", sampler=round_of_two, batch_index=0, timeout=30)
    assert store.stats()["waiting_consumers"] == 0


def test_a_reader_whose_rounds_in_flight_cannot_fit_is_refused_naming_prefetch(make_store):
    # A loader with prefetch=2 keeps its last round held (consumed, pinned by its plan) while
    # it asks for the next: with capacity=4 and batches of 4 nothing more could ever be put,
    # and the producers and the loader waited on each other for the loader's whole timeout.
    store = make_store(capacity=4, tasks=["t"])
    store.put("p", {"x": [0, 1, 2, 3]})
    one = RankAwareSampler(data_rank=0, data_world_size=1)
    ask = dict(sampler=one, prefetch=2, timeout=30)
    assert store.get("t", ["x"], 4, "p", batch_index=0, **ask).ids == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"prefetch=2 .* needs 4 more .* 8 samples, more than"):
        store.get("t", ["x"], 4, "p", batch_index=1, **ask)
    assert store.stats()["waiting_consumers"] == 0
    # With prefetch=1 the round before is let go as the next is asked for: 4 fit in 4.
    stall.check_fits(store.options, one, 4, 1)


@pytest.mark.slow
def test_a_put_and_a_get_that_wait_on_each_other_are_named(make_store, caplog, monkeypatch):
    """capacity 4, 3 held: a get of 4 waits for one more sample, a put of 4 for room; the
    stall is logged once it lasts STALL_WARN seconds and both time out naming it (the audit's
    120-180 s silent stall), the store unchanged."""
    monkeypatch.setattr(stall, "STALL_WARN", 0.5)
    store = make_store(capacity=4, tasks=["t"])
    store.put("p", {"x": [0, 1, 2]})
    errors: list[BaseException] = []

    def get() -> None:
        try:
            store.get("t", ["x"], 4, "p", timeout=3)
        except BaseException as exc:
            errors.append(exc)

    consumer = threading.Thread(target=get)
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        consumer.start()
        with pytest.raises(TimeoutError, match="wait on each other") as put_error:
            store.put("p", {"x": [3, 4, 5, 6]}, timeout=2)
        consumer.join(10)
    assert "3 samples of capacity=4 (1 free)" in str(put_error.value)
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
    if store.backend == "embedded":  # the Ray actor logs in its own process
        assert any("stalled" in r.getMessage() for r in caplog.records)
    store.close("p")
    assert store.get("t", ["x"], 4, "p", timeout=5).ids == [0, 1, 2]  # nothing lost


def _trial(seed: int) -> tuple[list[BaseException], list[int], int]:
    """Producers and consumers of random sizes on a store of random capacity, sized so they
    can never wait on each other (batch_size + samples per put <= capacity + 1, one task)."""
    rng = random.Random(seed)
    cap = rng.randint(2, 10)
    batch_max = rng.randint(1, cap)
    n, producers = rng.randint(20, 60), rng.randint(1, 3)
    store = SampleStore(capacity=cap, tasks=["t"])
    sizes = [[rng.randint(1, cap + 1 - batch_max) for _ in range(n)] for _ in range(producers)]
    batches = [rng.randint(1, batch_max) for _ in range(rng.randint(1, 3))]
    errors: list[BaseException] = []
    got: list[int] = []
    lock = threading.Lock()

    def produce(j: int) -> None:
        try:
            mine = list(range(j, n, producers))
            for size in sizes[j]:
                ids, mine = mine[:size], mine[size:]
                if not ids:
                    return
                store.put("p", {"x": ids}, ids=ids, timeout=10)
        except BaseException as exc:
            errors.append(exc)

    def consume(size: int) -> None:
        try:
            while True:
                try:
                    batch = store.get("t", ["x"], size, "p", timeout=10)
                except PartitionClosed:
                    return
                with lock:
                    got.extend(batch.ids)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(j,)) for j in range(producers)]
    consumers = [threading.Thread(target=consume, args=(b,)) for b in batches]
    for t in threads + consumers:
        t.start()
    for t in threads:
        t.join(30)
    store.close("p")
    for t in consumers:
        t.join(30)
    return errors, got, n


@pytest.mark.slow
def test_puts_and_gets_that_cannot_wait_on_each_other_never_stall():
    """The audit's stall was two parties waiting on each other (named above), not a missed
    wake-up: with sizes that cannot deadlock, 60 random trials of concurrent producers and
    consumers at capacity all finish, each sample delivered once (every wait bounded)."""
    for seed in range(60):
        errors, got, n = _trial(seed)
        assert not errors, (seed, errors)
        assert sorted(got) == list(range(n)), seed
