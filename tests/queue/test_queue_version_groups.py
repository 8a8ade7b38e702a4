"""Policy versions and groups (#30): a group goes stale whole, is all versioned or all not,
and admission never holds back the put that completes the group a trainer waits for.

Behavioural tests run on both backends (``make_store``); the checkpoint one on the embedded
store (its save and load are the backend-independent state module)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from meshfeed.queue import GroupSampler, PartitionClosed, SampleStore, SequentialSampler
from meshfeed.queue.engine.core import StoreCore, StoreOptions
from meshfeed.queue.request import GetRequest, PutRequest
from tests.queue.test_queue_store import waiting

PAIRS = GroupSampler(group_size=2)


def test_a_group_continued_under_newer_weights_goes_stale_whole(make_store):
    """version_of="newest": answer 0/0 continued under version 2, answer 0/1 finished under
    version 0. Judged alone, 0/1 went stale and 0/0 stayed pending forever: never served (a
    group sampler waited for its pair), never counted stale."""
    store = make_store()
    store.put("p", {"prompt": [1, 1]}, ids=["0/0", "0/1"], groups=0, version=0)
    store.put("p", {"reward": [1.0]}, ids=["0/0"], version=2)
    store.put("p", {"reward": [0.0]}, ids=["0/1"], version=0)
    store.put(
        "p", {"prompt": [2, 2], "reward": [0.0, 1.0]}, ids=["1/0", "1/1"], groups=1, version=2
    )
    ask = dict(sampler=PAIRS, version=2, max_staleness=1, version_of="newest", timeout=5)
    batch = store.get("actor", ["prompt", "reward"], 2, "p", **ask)
    assert batch.ids == ["1/0", "1/1"] and batch.versions == [2, 2]
    assert store.stats()["stale"] == {"actor": 2}  # the whole group, counted
    store.close("p")
    with pytest.raises(PartitionClosed):
        store.get("actor", ["prompt", "reward"], 2, "p", **ask)
    assert store.stats()["consumed"] == {"actor": 4}  # every sample served or counted stale


def test_the_pending_members_of_a_stale_group_go_with_its_stale_one(make_store):
    """One answer of a group is still being generated: the group is judged by the members
    it has, and those go together (its members all older than the bound, or one of them)."""
    store = make_store()
    store.put("p", {"x": [0, 1, 2]}, ids=["a", "b", "c"], groups="g", version=1)
    store.put("p", {"y": [0, 0]}, ids=["a", "b"], version=3)  # a, b continued; c not yet
    store.put("p", {"x": [5, 6, 7], "y": [1, 1, 1]}, ids=["d", "e", "f"], groups="h", version=3)
    ask = dict(sampler=GroupSampler(group_size=3), version=3, max_staleness=1, timeout=5)
    batch = store.get("t", ["x", "y"], 3, "p", version_of="newest", **ask)
    assert batch.ids == ["d", "e", "f"]
    assert store.stats()["stale"] == {"t": 3}  # c is stale (newest 1 < 2): a and b with it


def test_a_group_mixing_versioned_and_unversioned_samples_is_refused_by_name(make_store):
    """Accepted before, a get bounding staleness dropped the versioned half only and a group
    sampler waited forever for the other half."""
    store = make_store()
    store.put("p", {"r": [0.0]}, ids=["0/0"], groups=0)  # unversioned, before any version
    unversioned = r"group 0 of 'p' has samples put without a version; .* '0/1' with version=0"
    with pytest.raises(ValueError, match=unversioned + " would mix versioned and unversioned"):
        store.put("p", {"r": [1.0]}, ids=["0/1"], groups=0, version=0)
    store.put("p", {"r": [0.0, 1.0]}, ids=["1/0", "1/1"], groups=1, version=3)
    versioned = r"group 1 of 'p' has samples put with version=3; .* '1/2' without a version"
    with pytest.raises(ValueError, match=versioned + " would mix"):
        store.put("p", {"r": [2.0]}, ids=["1/2"], groups=1)
    assert store.stats()["produced"] == 3  # nothing of the refused puts landed
    store.put("p", {"r": [1.0]}, ids=["0/1"], groups=0)  # the group, unversioned: fine
    store.put("p", {"r": [0.0, 1.0]}, ids=["2/0", "2/1"], groups=2)  # a new unversioned one
    got = store.get("t", ["r"], 6, "p", sampler=PAIRS, version=3, max_staleness=0, timeout=5)
    assert sorted(got.ids) == ["0/0", "0/1", "1/0", "1/1", "2/0", "2/1"]
    assert got.versions == [3 if k.startswith("1/") else None for k in got.ids]


def test_mixing_is_refused_once_a_versioned_get_made_the_book(make_store):
    store = make_store()
    store.put("p", {"r": [0.0]}, ids=["0/0"], groups=0)
    store.put("p", {"r": [5.0, 6.0]}, ids=["u", "v"])
    assert store.get("t", ["r"], 2, "p", version=0, timeout=5).ids == ["0/0", "u"]
    with pytest.raises(ValueError, match="would mix versioned and unversioned"):
        store.put("p", {"r": [1.0]}, ids=["0/1"], groups=0, version=0)


def test_an_unversioned_group_stays_one_across_save_and_load(tmp_path):
    store = SampleStore()
    store.put("p", {"r": [0.0]}, ids=["0/0"], groups=0)
    store.put("p", {"r": [0.0, 1.0]}, ids=["1/0", "1/1"], groups=1, version=0)
    store.save(tmp_path / "s")
    loaded = SampleStore.load(tmp_path / "s")
    with pytest.raises(ValueError, match="would mix versioned and unversioned"):
        loaded.put("p", {"r": [1.0]}, ids=["0/1"], groups=0, version=0)
    with pytest.raises(ValueError, match=r"group 1 .* version 0; .* split it across versions"):
        loaded.put("p", {"r": [1.0]}, ids=["1/2"], groups=1, version=1)


def test_a_put_that_completes_the_group_a_trainer_waits_for_is_admitted(make_store):
    """GroupSampler(group_size=2), 2 per get, max_staleness=0: two rollouts put their answers
    one at a time, interleaved (A0, B0, A1, B1). A0 and B0 fill the bound with two incomplete
    groups: the put of A1 waited for admission while the get waited for a complete group,
    until both timed out. A put is held back only while a round is ready for the trainer."""
    store = make_store()
    store.put("p", {"r": [0.0, 1.0]}, ids=["Z/0", "Z/1"], groups="Z", version=0)
    ask = dict(sampler=PAIRS, version=0, max_staleness=0, timeout=5)
    assert store.get("actor", ["r"], 2, "p", **ask).ids == ["Z/0", "Z/1"]  # the bound: 2 ahead
    for g, a in [("A", 0), ("B", 0), ("A", 1)]:
        store.put("p", {"r": [float(a)]}, ids=[f"{g}/{a}"], groups=g, version=0, timeout=3)
    # Group A is ready and 3 samples are ahead: new work waits again (admission still bounds).
    with pytest.raises(TimeoutError, match="admission of a versioned put"):
        store.put("p", {"r": [1.0]}, ids=["B/1"], groups="B", version=0, timeout=0.2)
    assert store.get("actor", ["r"], 2, "p", **ask).ids == ["A/0", "A/1"]
    store.put("p", {"r": [1.0]}, ids=["B/1"], groups="B", version=0, timeout=3)
    assert store.get("actor", ["r"], 2, "p", **ask).ids == ["B/0", "B/1"]


def test_interleaved_rollouts_and_a_waiting_trainer_make_progress(make_store):
    """The explorer's schedule: the trainer's get waits first, the puts come after."""
    store = make_store()
    store.put("p", {"r": [0.0, 1.0]}, ids=["Z/0", "Z/1"], groups="Z", version=0)
    ask = dict(sampler=PAIRS, version=0, max_staleness=0)
    store.get("actor", ["r"], 2, "p", timeout=5, **ask)
    got: list[list[str]] = []

    def train() -> None:
        got.append(store.get("actor", ["r"], 2, "p", timeout=20, **ask).ids)

    trainer = threading.Thread(target=train)
    trainer.start()
    waiting(store, "consumers", 1, timeout=20)
    for g, a in [("A", 0), ("B", 0), ("A", 1)]:  # A1 timed out waiting for admission
        store.put("p", {"r": [float(a)]}, ids=[f"{g}/{a}"], groups=g, version=0, timeout=5)
    trainer.join(20)
    assert got == [["A/0", "A/1"]]


def test_a_waiting_put_is_asked_again_when_the_trainer_asks_for_groups(make_store):
    """The put of A1 waited for admission under the trainer's last get (sequential: A0 and
    B0 were a ready round). Its next get asks for whole groups and cannot plan one: the
    waiting put is woken to ask again, admitted, and completes the group."""
    store = make_store()
    store.put("p", {"r": [0.0, 1.0]}, ids=["Z/0", "Z/1"], groups="Z", version=0)
    seq = dict(sampler=SequentialSampler(), version=0, max_staleness=0, timeout=5)
    assert store.get("actor", ["r"], 2, "p", **seq).ids == ["Z/0", "Z/1"]
    store.put("p", {"r": [0.0]}, ids=["A/0"], groups="A", version=0)
    store.put("p", {"r": [0.0]}, ids=["B/0"], groups="B", version=0)
    errors: list[BaseException] = []

    def put() -> None:
        try:
            store.put("p", {"r": [1.0]}, ids=["A/1"], groups="A", version=0, timeout=20)
        except BaseException as exc:
            errors.append(exc)

    producer = threading.Thread(target=put)
    producer.start()
    waiting(store, "producers", 1, timeout=20)
    batch = store.get("actor", ["r"], 2, "p", sampler=PAIRS, version=0, max_staleness=0, timeout=8)
    producer.join(20)
    assert batch.ids == ["A/0", "A/1"] and not errors


def test_the_core_names_why_a_refused_put_waits():
    """What a backend's put timeout can say (the store's capacity, or admission), instead of
    "store at capacity None" for a put waiting for admission."""
    core = StoreCore(StoreOptions())
    core.try_put(PutRequest("p", {"x": [0, 1]}, version=0))
    ask = GetRequest(task="t", fields=("x",), batch_size=2, partition="p", version=0)
    assert core.try_get(replace(ask, max_staleness=0)) is not None
    core.try_put(PutRequest("p", {"x": [2, 3]}, version=0))
    assert core.try_put(PutRequest("p", {"x": [4]}, version=0)) is None
    assert core.put_waits_for.startswith("waiting for admission of a versioned put to 'p': ")
    assert "task 't' (version 0, max_staleness=0, 2 per get) has 2 samples" in core.put_waits_for
    full = StoreCore(StoreOptions(capacity=2))
    full.try_put(PutRequest("p", {"x": [0, 1]}))
    assert full.try_put(PutRequest("p", {"x": [2]})) is None
    assert full.put_waits_for == "store at capacity 2 (2 held, the put needs 1 more)"


def test_a_put_that_times_out_says_what_it_waited_for(make_store):
    store = make_store(capacity=2)
    store.put("p", {"x": [0, 1]})
    with pytest.raises(TimeoutError, match=r"store at capacity 2 \(2 held, the put needs 1 more\)"):
        store.put("p", {"x": [2]}, timeout=0.3)
