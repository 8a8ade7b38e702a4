"""Policy versions in the store (#30): bounded staleness, admission, partial rollouts, bad input.

The property test runs on both backends: random producer and trainer speeds (a random
interleaving of puts, weight syncs, train steps and version bumps), and no sample older than
``max_staleness`` is ever served, none twice, none lost without being counted stale."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from meshfeed.queue import GroupSampler, PartitionClosed, SampleStore, StaleVersion
from meshfeed.queue.engine.core import StoreOptions
from meshfeed.testing import reset_store
from tests.optional import HealthCheck, given, settings, st
from tests.queue.test_queue_store import waiting

BACKENDS = [pytest.param("embedded"), pytest.param("ray", marks=pytest.mark.ray)]


@pytest.fixture(params=BACKENDS)
def fresh(request: pytest.FixtureRequest) -> Callable[..., SampleStore]:
    """Empty stores on the parametrised backend, any number per test (Ray: one actor)."""
    if request.param == "embedded":
        return lambda **kw: SampleStore(**kw)
    shared: SampleStore = request.getfixturevalue("ray_store")
    return lambda **kw: reset_store(shared, StoreOptions(**kw))


def test_a_get_drops_samples_older_than_max_staleness_and_reports_versions(fresh):
    store = fresh()
    store.put("p", {"x": [0, 1]}, version=0)
    store.put("p", {"x": [2, 3]}, version=1)
    store.put("p", {"x": [4, 5]}, version=2)
    batch = store.get("t", ["x"], 2, "p", version=2, max_staleness=1, timeout=5)
    assert batch["x"] == [2, 3] and batch.versions == [1, 1]
    stats = store.stats()
    assert stats["stale"] == {"t": 2} and stats["consumed"] == {"t": 4}
    assert stats["partitions"]["p"]["trainer_versions"] == {"t": 2}
    assert store.get("t", ["x"], 2, "p", version=3, max_staleness=1, timeout=5).versions == [2, 2]
    # Another task without a bound still reads everything, versions reported.
    assert store.get("u", ["x"], 6, "p", timeout=5).versions == [0, 0, 1, 1, 2, 2]


def test_bad_version_arguments_are_refused_by_name(fresh):
    store = fresh()
    with pytest.raises(ValueError, match=r"max_staleness must be .* \(got max_staleness=-1\)"):
        store.get("t", ["x"], 1, "p", version=3, max_staleness=-1, timeout=1)
    with pytest.raises(ValueError, match="pass version= .* with it"):
        store.get("t", ["x"], 1, "p", max_staleness=1, timeout=1)
    with pytest.raises(ValueError, match=r"version must be .* \(got version=True\)"):
        store.put("p", {"x": [1]}, version=True)
    with pytest.raises(ValueError, match="version_of must be one of"):
        store.get("t", ["x"], 1, "p", version=1, version_of="latest", timeout=1)
    store.put("p", {"x": [1, 2]}, version=5)
    store.get("t", ["x"], 1, "p", version=5, max_staleness=0, timeout=1)
    with pytest.raises(ValueError, match=r"asked with version=4 after version=5; .* backwards"):
        store.get("t", ["x"], 1, "p", version=4, max_staleness=0, timeout=1)
    assert store.get("t", ["x"], 1, "p", version=5, max_staleness=0, timeout=1)["x"] == [2]


def test_a_put_that_goes_backwards_or_splits_a_group_is_refused_and_changes_nothing(fresh):
    store = fresh()
    store.put("p", {"prompt": [1, 2]}, ids=["a", "b"], groups="g", version=3)
    with pytest.raises(ValueError, match=r"sample 'a' .* version 3; a put of version=2 goes"):
        store.put("p", {"answer": [10]}, ids=["a"], version=2)
    with pytest.raises(ValueError, match=r"group 'g' .* version 3; .* split it across versions"):
        store.put("p", {"prompt": [3]}, ids=["c"], groups="g", version=4)
    assert store.stats()["produced"] == 2
    store.put("p", {"answer": [10, 20]}, ids=["a", "b"], version=4)  # continued, newer weights
    batch = store.get("t", ["prompt", "answer"], 2, "p", sampler=GroupSampler(group_size=2))
    assert batch["answer"] == [10, 20] and batch.versions == [3, 3]
    store.put("p", {"prompt": [5], "answer": [6]}, ids=["d"], version=1)
    store.put("p", {"reward": [1.0]}, ids=["d"], version=2)
    newest = store.get("u", ["prompt"], 3, "p", version_of="newest", timeout=5)
    assert newest.ids == ["a", "b", "d"] and newest.versions == [4, 4, 2]


def test_a_put_too_old_for_every_reader_is_refused_as_stale(fresh):
    store = fresh()
    store.put("p", {"x": [0, 1]}, version=4)
    store.get("t", ["x"], 1, "p", version=6, max_staleness=2, timeout=5)
    with pytest.raises(StaleVersion, match=r"version=3 .* older than every reader accepts"):
        store.put("p", {"x": [9]}, version=3)
    store.put("p", {"x": [2]}, version=4)  # within the bound: admitted
    store.get("u", ["x"], 1, "p", timeout=5)  # a reader without a bound: old puts are welcome
    store.put("p", {"x": [9]}, version=0)


def test_a_versioned_put_waits_while_the_trainer_has_its_staleness_worth_ahead(fresh):
    """max_staleness=1, 2 samples per get: a put of new samples waits while (1 + 1) * 2 are
    unconsumed ahead, and lands once the trainer takes a batch (one that overshoots the bound
    is admitted, so a put never waits on a get that waits on it)."""
    store = fresh()
    store.put("p", {"x": [0, 1]}, version=0)
    store.get("t", ["x"], 2, "p", version=0, max_staleness=1, timeout=5)
    store.put("p", {"x": [2, 3, 4, 5, 6]}, version=0)  # 0 ahead: admitted, now 5 ahead
    with pytest.raises(TimeoutError, match="admission of a versioned put"):
        store.put("p", {"x": [7]}, version=0, timeout=0.2)
    store.put("p", {"y": [0]}, ids=[2], version=1)  # more fields of a held sample: admitted
    done = threading.Event()

    def put() -> None:
        store.put("p", {"x": [7]}, version=1, timeout=20)
        done.set()

    producer = threading.Thread(target=put)
    producer.start()
    time.sleep(0.3)
    assert not done.is_set()
    assert store.get("t", ["x"], 2, "p", version=1, max_staleness=1, timeout=5)["x"] == [2, 3]
    producer.join(20)
    assert done.is_set()


def test_stale_counts_and_versions_survive_save_and_load(tmp_path):
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": [0, 1, 2, 3]}, version=0)
    store.put("p", {"x": [4, 5]}, version=2)
    store.get("t", ["x"], 1, "p", version=2, max_staleness=1, timeout=1)
    store.save(tmp_path / "s")
    loaded = SampleStore.load(tmp_path / "s")
    assert loaded.stats()["stale"] == {"t": 4}
    with pytest.raises(ValueError, match="backwards"):
        loaded.get("t", ["x"], 1, "p", version=1, max_staleness=1, timeout=1)
    assert loaded.get("t", ["x"], 1, "p", version=2, max_staleness=1, timeout=1).versions == [2]


@st.composite
def _schedules(draw: Any) -> tuple[int, int, list[tuple[str, int]]]:
    staleness = draw(st.integers(0, 2))
    batch = draw(st.integers(1, 3))
    steps = draw(
        st.lists(
            st.tuples(st.sampled_from(["put", "sync", "train", "bump"]), st.integers(1, 3)),
            min_size=5,
            max_size=40,
        )
    )
    return staleness, batch, steps


def _run_schedule(store: SampleStore, staleness: int, batch: int, steps: list) -> None:
    trainer = producer = 0
    produced: dict[int, int] = {}  # sample value -> version it was put with
    served: list[int] = []
    made = 0
    for op, n in steps:
        if op == "sync":  # the producer loads the trainer's weights
            producer = trainer
        elif op == "bump":  # an optimizer step
            trainer += 1
        elif op == "put":
            values, made = list(range(made, made + n)), made + n
            try:
                store.put("p", {"x": values}, version=producer, timeout=0)
            except (StaleVersion, TimeoutError):  # too old, or too far ahead: not stored
                continue
            produced.update(dict.fromkeys(values, producer))
        else:
            try:
                got = store.get(
                    "t", ["x"], batch, "p", version=trainer, max_staleness=staleness, timeout=0
                )
            except TimeoutError:
                continue
            assert all(v >= trainer - staleness for v in got.versions)  # never too stale
            assert got.versions == [produced[x] for x in got["x"]]
            served.extend(got["x"])
    store.close("p")
    while True:
        try:
            got = store.get("t", ["x"], batch, "p", version=trainer, max_staleness=staleness)
        except PartitionClosed:
            break
        assert all(v >= trainer - staleness for v in got.versions)
        served.extend(got["x"])
    assert len(served) == len(set(served))  # none twice
    stale = store.stats()["stale"].get("t", 0)
    assert len(served) + stale == len(produced)  # every sample served or counted stale


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schedule=_schedules())
def test_no_sample_older_than_max_staleness_is_ever_served(fresh, schedule):
    staleness, batch, steps = schedule
    _run_schedule(fresh(), staleness, batch, steps)


def test_a_get_that_drops_stale_samples_and_then_waits_admits_the_waiting_put(fresh):
    """The trainer's get drops the stale round, then waits for fresh samples: the producer
    waiting for admission must be woken by the drop, not by the end of that get (a missed
    wake-up there stalled both until their timeouts)."""
    store = fresh()
    store.put("p", {"x": [0, 1]}, version=0)
    store.get("t", ["x"], 2, "p", version=0, max_staleness=0, timeout=5)  # 2 ahead at most
    store.put("p", {"x": [2, 3]}, version=0)
    errors: list[BaseException] = []

    def put() -> None:
        try:
            store.put("p", {"x": [4, 5]}, version=1, timeout=20)
        except BaseException as exc:
            errors.append(exc)

    producer = threading.Thread(target=put)
    producer.start()
    waiting(store, "producers", 1, timeout=20)
    batch = store.get("t", ["x"], 2, "p", version=1, max_staleness=0, timeout=5)
    producer.join(20)
    assert batch["x"] == [4, 5] and batch.versions == [1, 1] and not errors
    assert store.stats()["stale"] == {"t": 2}


def test_a_group_id_used_again_after_its_samples_left_starts_a_new_group(fresh):
    # The same prompt sampled again later (its group id again) under newer weights: the old
    # group's samples left the store, so there is nothing to split. The version of a group
    # once stayed forever and refused it.
    store = fresh(tasks=["t"])
    sampler = GroupSampler(group_size=2)
    store.put("p", {"x": [1, 2]}, ids=["a", "b"], groups="prompt-7", version=0)
    assert store.get("t", ["x"], 2, "p", sampler=sampler, timeout=5).ids == ["a", "b"]
    assert store.stats()["held"] == 0
    store.put("p", {"x": [3, 4]}, ids=["c", "d"], groups="prompt-7", version=1)
    with pytest.raises(ValueError, match=r"group 'prompt-7' .* version 1; .* split it across"):
        store.put("p", {"x": [5]}, ids=["e"], groups="prompt-7", version=2)  # still held: one group
    assert store.get("t", ["x"], 2, "p", sampler=sampler, timeout=5).versions == [1, 1]
    store.put("p", {"x": [5, 6]}, ids=["e", "f"], groups="prompt-7", version=2)
    assert store.get("t", ["x"], 2, "p", sampler=sampler, timeout=5).versions == [2, 2]


def test_a_groups_lifetime_survives_save_and_load(tmp_path):
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": [1, 2]}, ids=["a", "b"], groups="g", version=0)
    store.put("p", {"x": [3, 4]}, ids=["c", "d"], groups="h", version=0)
    store.get("t", ["x"], 2, "p", sampler=GroupSampler(group_size=2), timeout=5)  # g leaves
    store.save(tmp_path / "s")
    again = SampleStore.load(tmp_path / "s")
    again.put("p", {"x": [5, 6]}, ids=["e", "f"], groups="g", version=1)  # a new group g
    with pytest.raises(ValueError, match=r"group 'h' .* version 0; .* split it across"):
        again.put("p", {"x": [7]}, ids=["i"], groups="h", version=1)  # h is still held
