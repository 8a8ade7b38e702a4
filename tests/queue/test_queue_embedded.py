"""The embedded backend: bounded waits on per-waiter conditions, targeted wake-ups, no polling."""

from __future__ import annotations

import threading
import time

import pytest

from meshfeed.queue import PartitionClosed, RequestCancelled, SampleStore
from meshfeed.queue.backends.embedded import wait_for
from meshfeed.queue.engine.wakeups import Waiter, Waiters
from tests.queue.test_queue_store import waiting as _waiting


def test_wait_for_times_out_after_its_deadline_and_unregisters_the_waiter():
    lock, waiters = threading.Lock(), Waiters()
    start = time.monotonic()
    with lock, pytest.raises(TimeoutError, match="demo timed out after 0.05s"):
        wait_for(lock, waiters, lambda n: Waiter("consumer", n), lambda: None, 0.05, "demo")
    assert 0.04 <= time.monotonic() - start < 2
    assert waiters.waiters == []


def test_wait_for_wakes_on_its_notification_not_on_a_timer():
    lock, waiters = threading.Lock(), Waiters()
    box: list[int] = []
    attempts = 0

    def attempt() -> int | None:
        nonlocal attempts
        attempts += 1
        return box[0] if box else None

    def notify() -> None:
        with lock:
            box.append(7)
            waiters.wake_all()

    timer = threading.Timer(0.1, notify)
    timer.start()
    with lock:
        got = wait_for(lock, waiters, lambda n: Waiter("consumer", n), attempt, 10, "demo")
    assert got == 7
    assert attempts == 2  # once before waiting, once after the single notification


def test_a_put_wakes_only_the_consumers_it_may_serve():
    store = SampleStore()
    out: dict[str, list] = {}

    def consume(name: str, partition: str, field: str) -> None:
        out[name] = store.get("t", [field], 1, partition, timeout=10).ids

    threads = [
        threading.Thread(target=consume, args=args)
        for args in (("x@p", "p", "x"), ("y@p", "p", "y"), ("x@q", "q", "x"))
    ]
    for t in threads:
        t.start()
    _waiting(store, "consumers", 3)
    for _ in range(5):
        store.put("p", {"x": [1]})  # serves x@p once, then concerns no waiter
    threads[0].join(10)
    waiters = {(w.partition, tuple(w.need)): w.woken for w in store._backend.waiters.waiters}
    assert waiters == {("p", ("y",)): 0, ("q", ("x",)): 0}  # never woken by puts of others
    store.put("p", {"y": [1]})
    store.put("q", {"x": [1]})
    for t in threads:
        t.join(10)
    assert out == {"x@p": [0], "y@p": [5], "x@q": [0]}


@pytest.mark.parametrize("timeout", [None, float("inf"), 1e10])
def test_close_wakes_consumers_blocked_without_a_deadline(timeout):
    from meshfeed.queue import PartitionClosed

    store = SampleStore()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            store.get("t", ["x"], 1, "p", timeout=timeout)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    _waiting(store, "consumers", 3)
    store.close("p")
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 3 and all(isinstance(e, PartitionClosed) for e in errors)


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_shutdown_wakes_every_waiting_call_and_refuses_later_ones(timeout):
    # A waiting get once slept on after shutdown() (forever without a deadline), and the
    # store served puts and gets afterwards.
    store = SampleStore(capacity=1)
    store.put("q", {"x": [0]})
    errors: list[BaseException] = []

    def call(fn) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    calls = [
        lambda: store.get("t", ["x"], 1, "p", timeout=timeout),
        lambda: store.put("p", {"x": [1]}, timeout=timeout),  # the store is full
    ]
    threads = [threading.Thread(target=call, args=(fn,), daemon=True) for fn in calls]
    for t in threads:
        t.start()
    _waiting(store, "consumers", 1)
    _waiting(store, "producers", 1)
    store.shutdown()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) for e in errors)
    assert all("was shut down" in str(e) for e in errors)
    for fn in calls:
        with pytest.raises(RuntimeError, match=r"shut down .*nothing was put or consumed"):
            fn()


def test_cancel_wakes_the_requests_of_one_token_and_consumes_nothing():
    store = SampleStore()
    errors: list[BaseException] = []

    def consume(token: str) -> None:
        try:
            store.get("t", ["x"], 1, "p", token=token)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(t,), daemon=True) for t in ("a", "b")]
    for t in threads:
        t.start()
    _waiting(store, "consumers", 2)
    store.cancel("a")
    threads[0].join(5)
    assert not threads[0].is_alive() and isinstance(errors[0], RequestCancelled)
    assert threads[1].is_alive()  # the other token's request still waits
    store.put("p", {"x": [1]})
    threads[1].join(5)
    assert len(errors) == 1 and store.stats()["consumed"] == {"t": 1}
    with pytest.raises(RequestCancelled):  # a cancelled token is refused from then on
        store.get("t", ["x"], 1, "p", token="a", timeout=1)


def test_targeted_wake_ups_lose_no_request_among_mixed_waiters_at_capacity():
    """Grouped consumers (same task, batch size and sampler) are woken one at a time and
    producers by the capacity freed; with consumers of other batch sizes and two producers
    racing to create the same samples (one puts x, the other y), every request is still
    served: each sample once, no get or put left waiting."""
    store = SampleStore(capacity=8, tasks=["t"])
    n, errors, got = 240, [], []
    lock = threading.Lock()

    def produce(field: str, order: list[int]) -> None:
        try:
            for i in range(0, n, 4):
                ids = order[i : i + 4]
                store.put("p", {field: [float(k) for k in ids]}, ids=ids, timeout=20)
        except BaseException as exc:
            errors.append(exc)

    def consume(size: int) -> None:
        try:
            while True:
                try:
                    batch = store.get("t", ["x", "y"], size, "p", timeout=20)
                except PartitionClosed:
                    return
                assert batch["x"] == batch["y"] == [float(k) for k in batch.ids]
                with lock:
                    got.extend(batch.ids)
        except BaseException as exc:
            errors.append(exc)

    ids = list(range(n))
    producers = [
        threading.Thread(target=produce, args=("x", ids)),
        threading.Thread(target=produce, args=("y", ids)),
    ]
    consumers = [threading.Thread(target=consume, args=(size,)) for size in (4, 4, 4, 3, 1)]
    for t in consumers + producers:
        t.start()
    for t in producers:
        t.join(60)
    store.close("p")
    for t in consumers:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in consumers + producers)
    assert sorted(got) == ids


def test_like_consumers_are_woken_one_at_a_time_and_pass_the_wake_on_while_more_is_ready():
    store = SampleStore()
    got: list[list] = []
    lock = threading.Lock()

    def consume() -> None:
        batch = store.get("t", ["x"], 2, "p", timeout=10)
        with lock:
            got.append(batch.ids)

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    _waiting(store, "consumers", 3)
    store.put("p", {"x": [0]})  # not a batch yet: wakes the first of the three only
    time.sleep(0.05)
    assert sorted(w.woken for w in store._backend.waiters.waiters) == [0, 0, 1]
    store.put("p", {"x": [1, 2, 3]})  # two batches: the first passes the wake to the second
    deadline = time.monotonic() + 10
    while len(got) < 2:
        assert time.monotonic() < deadline, "the second batch was not handed out"
        time.sleep(0.005)
    (last,) = store._backend.waiters.waiters
    assert last.woken == 0  # nothing was left for it: never woken in vain
    store.put("p", {"x": [4, 5]})
    for t in threads:
        t.join(10)
    assert sorted(got) == [[0, 1], [2, 3], [4, 5]]
