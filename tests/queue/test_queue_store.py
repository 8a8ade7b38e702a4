"""SampleStore behaviour, run on both backends (embedded and Ray) through ``make_store``."""

from __future__ import annotations

import contextlib
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from meshfeed.queue import PartitionClosed, RankAwareSampler, SampleStore
from tests.optional import given, settings, st

FIELDS = ["prompt", "response", "reward"]


def _join(threads: list[threading.Thread], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "threads did not finish in time"


def test_get_returns_only_samples_whose_requested_fields_all_exist(make_store):
    store = make_store()
    store.put("p", {"prompt": ["a", "b", "c"]})
    store.put("p", {"reward": [0.5]}, ids=[1])
    with pytest.raises(TimeoutError):
        store.get("actor", ["prompt", "reward"], 2, "p", timeout=0.05)
    batch = store.get("actor", ["prompt", "reward"], 1, "p", timeout=1)
    assert batch.ids == [1] and batch["prompt"] == ["b"] and batch["reward"] == [0.5]
    # Another task has its own consumption; a task needing fewer fields sees more samples.
    assert store.get("ref", ["prompt"], 3, "p", timeout=1).ids == [0, 1, 2]


def test_get_marks_consumed_per_task_and_hands_out_in_production_order(make_store):
    store = make_store()
    store.put("p", {"x": torch.arange(8).reshape(4, 2), "y": np.arange(4)})
    first = store.get("t", ["x", "y"], 2, "p", timeout=1)
    second = store.get("t", ["x", "y"], 2, "p", timeout=1)
    assert first.ids == [0, 1] and second.ids == [2, 3]
    assert torch.equal(first["x"], torch.tensor([[0, 1], [2, 3]]))
    assert np.array_equal(second["y"], np.array([2, 3]))
    with pytest.raises(TimeoutError):
        store.get("t", ["x"], 1, "p", timeout=0.05)


def test_user_keys_and_fields_arriving_from_several_producers_in_any_order(make_store):
    store = make_store()
    store.put("train@step_3", {"response": ["r2", "r1"]}, ids=["k2", "k1"])
    store.put("train@step_3", {"prompt": ["p1", "p2"]}, ids=["k1", "k2"])
    batch = store.get("actor", ["prompt", "response"], 2, "train@step_3", timeout=1)
    assert batch.ids == ["k2", "k1"]
    assert batch["prompt"] == ["p2", "p1"] and batch["response"] == ["r2", "r1"]


def test_exactly_once_per_task_with_four_producer_and_four_consumer_threads(make_store):
    store = make_store(capacity=64, tasks=["actor", "critic"])
    per_producer, producers, batch = 24, 4, 4
    got: dict[str, list] = {"actor": [], "critic": []}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            for i in range(0, per_producer, 4):
                ids = [f"{p}-{i + j}" for j in range(4)]
                store.put("p", {"prompt": [1] * 4}, ids=ids, timeout=20)
                store.put("p", {"reward": [2.0] * 4}, ids=ids[::-1], timeout=20)
        except BaseException as exc:
            errors.append(exc)

    def consume(task: str) -> None:
        try:
            while True:
                try:
                    b = store.get(task, ["prompt", "reward"], batch, "p", timeout=20)
                except PartitionClosed:
                    return
                with lock:
                    got[task].extend(b.ids)
        except BaseException as exc:
            errors.append(exc)

    consumers = [threading.Thread(target=consume, args=(t,)) for t in ["actor", "critic"] * 2]
    prods = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in consumers + prods:
        t.start()
    _join(prods)
    store.close("p")
    _join(consumers)
    assert not errors, errors
    expected = sorted(f"{p}-{i}" for p in range(producers) for i in range(per_producer))
    for task in ("actor", "critic"):
        assert sorted(got[task]) == expected  # every sample once: no loss, no duplicate
    assert store.stats()["held"] == 0  # dropped once both tasks consumed them


def test_a_timed_out_get_leaves_the_store_usable(make_store):
    store = make_store()
    with pytest.raises(TimeoutError, match="timed out after 0.05s"):
        store.get("t", ["x"], 1, "p", timeout=0.05)
    assert store.stats()["waiting_consumers"] == 0
    store.put("p", {"x": [7]})
    assert store.get("t", ["x"], 1, "p", timeout=1)["x"] == [7]


def test_blocked_get_wakes_on_put_without_polling(make_store):
    store = make_store()
    result: list = []
    t = threading.Thread(target=lambda: result.append(store.get("t", ["x"], 2, "p", timeout=20)))
    t.start()
    waiting(store, "consumers", 1, timeout=20)
    assert store.stats()["waiting_consumers"] == 1
    store.put("p", {"x": [1, 2]})
    _join([t])
    assert result[0].ids == [0, 1]


def test_put_beyond_capacity_waits_for_space_then_proceeds(make_store):
    store = make_store(capacity=4, tasks=["t"])
    store.put("p", {"x": [0, 1, 2, 3]})
    with pytest.raises(TimeoutError, match="capacity 4"):
        store.put("p", {"x": [4]}, timeout=0.05)
    done = threading.Event()

    def produce() -> None:
        store.put("p", {"x": [4, 5]}, timeout=20)
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    assert not done.wait(0.2)  # backpressure: the producer is parked
    assert store.get("t", ["x"], 2, "p", timeout=1).ids == [0, 1]  # frees two slots
    _join([t])
    assert done.is_set() and store.stats()["held"] == 4
    with pytest.raises(ValueError, match="can never fit capacity=4"):
        store.put("p", {"x": list(range(5))})


def test_delete_frees_capacity_and_clear_drops_the_partition(make_store):
    store = make_store(capacity=3)
    store.put("p", {"x": [0, 1, 2]})
    store.delete("p", [0, 2])
    store.put("p", {"x": [3, 4]}, timeout=1)
    assert store.get("t", ["x"], 3, "p", timeout=1).ids == [1, 3, 4]
    store.clear("p")
    assert store.stats()["held"] == 0
    store.put("p", {"x": [9]}, timeout=1)  # a cleared name starts afresh
    assert store.get("t", ["x"], 1, "p", timeout=1)["x"] == [9]
    with pytest.raises(ValueError, match="holds no samples"):
        store.delete("p", [42])


def test_reset_consumption_replays_the_partition_for_one_task(make_store):
    store = make_store()
    store.put("p", {"x": [0, 1, 2]})
    assert store.get("a", ["x"], 3, "p", timeout=1).ids == [0, 1, 2]
    assert store.get("b", ["x"], 1, "p", timeout=1).ids == [0]
    store.reset_consumption("p", "a")
    assert store.get("a", ["x"], 3, "p", timeout=1).ids == [0, 1, 2]
    assert store.get("b", ["x"], 2, "p", timeout=1).ids == [1, 2]


def test_close_drains_a_short_last_batch_then_raises_partition_closed(make_store):
    store = make_store()
    store.put("p", {"x": [0, 1, 2], "y": [0, 0, 0]})
    store.put("p", {"x": [3]})  # never gets y: never ready
    waiter: list = []

    def wait() -> None:
        try:
            store.get("u", ["x", "y"], 10, "p", timeout=20)
        except PartitionClosed as exc:
            waiter.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    assert store.get("t", ["x", "y"], 2, "p", timeout=1).ids == [0, 1]
    store.close("p")
    _join([t])
    assert store.get("t", ["x", "y"], 2, "p", timeout=1).ids == [2]
    with pytest.raises(PartitionClosed):
        store.get("t", ["x", "y"], 2, "p", timeout=1)
    assert len(waiter) == 0 or isinstance(waiter[0], PartitionClosed)
    with pytest.raises(ValueError, match="is closed; no more puts"):
        store.put("p", {"x": [5]})


def test_stats_report_produced_consumed_waiting_and_bytes(make_store):
    store = make_store()
    store.put("p", {"x": np.zeros((3, 10), dtype=np.float32)})
    store.get("t", ["x"], 2, "p", timeout=1)
    stats = store.stats()
    assert stats["produced"] == 3 and stats["consumed"] == {"t": 2}
    assert stats["waiting_consumers"] == 0 and stats["bytes_held"] == 3 * 40
    assert stats["partitions"]["p"]["consumed"] == {"t": 2}


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: s.put("p", {"a": [1, 2], "b": [1]}), ValueError, "same, non-zero number"),
        (lambda s: s.put("p", {"a": [1]}, ids=[1, 2]), ValueError, "2 ids for 1 samples"),
        (lambda s: s.put("p", {"zzz": [1]}), ValueError, r"unknown field\(s\) \['zzz'\]"),
        (lambda s: s.get("t", ["zzz"], 1, "p"), ValueError, r"unknown field\(s\) \['zzz'\]"),
        (lambda s: s.get("t", ["a"], 0, "p"), ValueError, "batch_size must be a positive"),
        (lambda s: s.get("t", ["a"], -3, "p"), ValueError, "batch_size must be a positive"),
        (lambda s: s.get("t", "a", 1, "p"), TypeError, "non-empty list of field names"),
        (lambda s: s.put("p", {"a": 5}), TypeError, "one entry per sample"),
        (lambda s: s.put("p", {"a": [1]}, ids=[1.5]), TypeError, "int or str"),
        (lambda s: s.put("p", {"a": [1]}, timeout=-1), ValueError, "timeout=-1"),
        (lambda s: s.get("t", ["a"], 1, "p", timeout="5"), TypeError, "timeout='5'"),
        (lambda s: s.put("p", {"a": [1]}, ids=5), TypeError, r"ids=5\); e.g. ids=\[5\]"),
        (lambda s: s.put("p", {"a": [1, 2]}, ids="xy"), TypeError, r"ids='xy'"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, match):
    store = SampleStore(fields=["a", "b"])
    with pytest.raises(error, match=match):
        call(store)


@pytest.mark.parametrize("arg", ["tasks", "fields"])
def test_a_lone_string_of_tasks_or_fields_is_refused_not_read_as_its_letters(arg):
    # tasks="actor" was read as ("a", "c", "t", "o", "r"): no sample was ever evicted.
    with pytest.raises(TypeError, match=rf"{arg} must be a list of names \(got {arg}='actor'\); "):
        SampleStore(**{arg: "actor"})
    with pytest.raises(TypeError, match=rf"{arg} must be non-empty strings"):
        SampleStore(**{arg: ["actor", ""]})
    assert getattr(SampleStore(**{arg: ["actor"]}).options, arg) == ("actor",)


def test_bad_input_is_rejected_by_both_backends(make_store):
    store = make_store()
    store.put("p", {"a": [1, 2]})
    with pytest.raises(ValueError, match="already has fields"):
        store.put("p", {"a": [3]}, ids=[0])
    store.close("p")
    with pytest.raises(ValueError, match="is closed"):
        store.put("p", {"a": [3]})
    # Nothing can ever carry the field now: the stream has ended, named with the field.
    with pytest.raises(PartitionClosed, match=r"has field\(s\) \['nope'\]"):
        store.get("t", ["nope"], 1, "p", timeout=1)
    assert store.get("t", ["a"], 5, "p", timeout=1).ids == [0, 1]  # still healthy


def test_embedded_store_refuses_to_be_pickled():
    with pytest.raises(TypeError, match="backend='ray'"):
        pickle.dumps(SampleStore())


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_readiness_under_interleaved_partial_puts(data):
    n = data.draw(st.integers(1, 6))
    events = data.draw(st.permutations([(i, f) for i in range(n) for f in FIELDS]))
    store = SampleStore()
    present: dict[int, set] = {i: set() for i in range(n)}
    handed: list[int] = []
    for i, f in events:
        store.put("p", {f: [f"{f}{i}"]}, ids=[i])
        present[i].add(f)
        while True:
            try:
                batch = store.get("t", FIELDS, 1, "p", timeout=0)
            except TimeoutError:
                break
            (k,) = batch.ids
            assert present[k] == set(FIELDS)  # only complete samples are ready
            assert batch["reward"] == [f"reward{k}"]
            handed.append(k)
        # every complete sample has been handed out at once
        assert set(handed) == {k for k, fs in present.items() if fs == set(FIELDS)}
    assert sorted(handed) == list(range(n)) and len(handed) == n


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_exactly_once_per_task_under_any_schedule_of_puts_gets_and_close(data):
    n = data.draw(st.integers(1, 12))
    events = data.draw(st.permutations([(i, f) for i in range(n) for f in ("a", "b")]))
    capacity = data.draw(st.sampled_from([None, 2 * n]))
    store = SampleStore(capacity=capacity)  # a get larger than it is refused: see test_queue_stall
    got: dict[str, list] = {"t1": [], "t2": []}
    needs = {"t1": ["a", "b"], "t2": ["a"]}
    for i, f in events:
        store.put("p", {f: [i]}, ids=[i])
        task = data.draw(st.sampled_from(["t1", "t2"]))
        size = data.draw(st.integers(1, min(4, capacity or 4)))
        with contextlib.suppress(TimeoutError):
            got[task].extend(store.get(task, needs[task], size, "p", timeout=0).ids)
    store.close("p")
    for task in got:
        while True:
            try:
                got[task].extend(store.get(task, needs[task], 3, "p", timeout=0).ids)
            except PartitionClosed:
                break
        assert sorted(got[task]) == list(range(n))  # each sample once, none lost


def test_a_rejected_put_changes_nothing():
    store = SampleStore()
    store.put("p", {"a": [1, 2]}, ids=["x", "y"], groups=["g", "h"])
    with pytest.raises(ValueError, match="a sample belongs to one group"):
        store.put("p", {"b": [1, 2, 3]}, ids=["z", "x", "y"], groups=["g", "g", "g"])
    assert store.stats()["held"] == 2
    with pytest.raises(TimeoutError):
        store.get("t", ["b"], 1, "p", timeout=0.01)  # no field b was written


def test_a_get_that_waited_through_puts_wakes_the_producer_its_eviction_makes_room_for(
    make_store,
):
    """The get starts with the store empty, waits while a put fills it and a producer blocks
    at capacity, then takes the batch: its eviction must wake that producer, although the
    store holds no fewer samples than when the get began (which is what was compared)."""
    store = make_store(capacity=2, tasks=["t"])
    results: dict[str, object] = {}

    def run(name: str, call) -> None:
        try:
            results[name] = call()
        except BaseException as exc:
            results[name] = exc

    consumer = threading.Thread(
        target=run, args=("get", lambda: store.get("t", ["x", "y"], 2, "p", timeout=10).ids)
    )
    consumer.start()
    waiting(store, "consumers", 1)
    store.put("p", {"x": [0, 1]}, ids=[0, 1])  # the store is full; the get needs y too
    producer = threading.Thread(
        target=run,
        args=("put", lambda: store.put("p", {"x": [2]}, ids=[2], timeout=60)),
        daemon=True,
    )
    producer.start()
    waiting(store, "producers", 1)
    store.put("p", {"y": [0, 1]}, ids=[0, 1])  # adds fields only: fits, serves the get
    consumer.join(10)
    producer.join(5)  # woken at once; before the fix it slept until its timeout
    assert not producer.is_alive(), "the producer was not woken when capacity was freed"
    assert results == {"get": [0, 1], "put": [2]}


def waiting(store: SampleStore, kind: str, n: int, timeout: float = 10.0) -> None:
    """Return once ``n`` callers of ``kind`` wait in ``store`` (at most ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while store.stats()[f"waiting_{kind}"] < n:
        assert time.monotonic() < deadline, f"{n} {kind} never started waiting"
        time.sleep(0.005)


def test_get_with_parts_names_the_whole_round_of_a_rank_aware_sampler(make_store):
    store = make_store()
    store.put("p", {"x": list(range(6))})
    store.close("p")
    ranks = [RankAwareSampler(data_rank=d, data_world_size=2) for d in range(2)]
    first = store.get("t", ["x"], 2, "p", ranks[0], timeout=5, batch_index=0, parts=True)
    assert first.ids == [0, 1] and first.parts == [[0, 1], [2, 3]]
    second = store.get("t", ["x"], 2, "p", ranks[1], timeout=5, batch_index=0, parts=True)
    assert second.ids == [2, 3] and second.parts == [[0, 1], [2, 3]]  # read from the plan
    plain = store.get("t", ["x"], 2, "p", ranks[0], timeout=5, batch_index=1)
    assert plain.ids == [4] and plain.parts is None  # not asked for
    with pytest.raises(TypeError, match="parts must be True or False"):
        store.get("t", ["x"], 2, "p", ranks[1], timeout=5, batch_index=1, parts=1)
