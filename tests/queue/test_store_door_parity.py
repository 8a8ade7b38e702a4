"""The store door gives what the other doors give: a damaged file or MemoryError raises as
itself, wrong field names are an error (not an empty stream), a refused constructor,
resize or load_state_dict changes nothing and leaks nothing, and a timeout names its
seconds as given. The process-group checks are in test_store_door_parity_dist.py."""

from __future__ import annotations

import os
import threading
import time

import pytest

from meshfeed.errors import SourceError
from meshfeed.queue import Batch, PartitionClosed, SampleStore, StoreLoader


def _loader(store: SampleStore, **kwargs) -> StoreLoader:
    defaults = {"task": "t", "fields": ["x"], "partition": "p", "mesh": {"dp": 1}, "rank": 0,
                "batch_size": 4, "timeout": 20}  # fmt: skip
    return StoreLoader(store, **{**defaults, **kwargs})


def _store(n: int = 16, *, close: bool = True) -> SampleStore:
    store = SampleStore()
    store.put("p", {"x": list(range(n))}, ids=list(range(n)))
    if close:
        store.close("p")
    return store


class _FailsOnce:
    """A collate_fn that raises ``error`` the first time it sees sample ``bad`` (and counts
    its calls on that batch)."""

    def __init__(self, error: type[BaseException], bad: int = 5) -> None:
        self.error, self.bad, self.calls = error, bad, 0

    def __call__(self, batch: Batch) -> list:
        if self.bad in batch.ids:
            self.calls += 1
            if self.calls == 1:
                raise self.error(f"cannot read the shard of sample {self.bad}")
        return list(batch.ids)


# ----------------------------------------------------------------- fatal errors (finding 1)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("error", [SourceError, MemoryError])
def test_a_damaged_file_or_memory_error_in_collate_fn_raises_as_itself_never_retried_or_skipped(
    error, on_error
):
    # DataLoader and StreamLoader raise these as themselves whatever on_error says; the store
    # door dropped the batch under "skip" and wrapped it in CollateError under "raise".
    collate = _FailsOnce(error)
    loader = _loader(_store(), collate_fn=collate, on_error=on_error, collate_retries=2)
    assert next(loader) == [0, 1, 2, 3]
    with pytest.raises(error, match="cannot read the shard of sample 5") as raised:
        next(loader)
    assert type(raised.value) is error
    assert collate.calls == 1  # not retried (collate_retries=2)
    stats = loader.stats()
    assert (stats["skipped"], stats["failures"], stats["collate_errors"]) == (0, [], 0)
    # The batch stays in the store's plan: the next call reads it again, nothing lost
    assert list(loader) == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    loader.shutdown()


def test_a_source_error_in_a_worker_process_raises_as_itself():
    loader = _loader(_store(), collate_fn=_FailsOnce(SourceError), num_workers=1, on_error="skip")
    try:
        got = [next(loader)]
        with pytest.raises(SourceError, match="sample 5"):
            next(loader)
        assert loader.stats()["skipped"] == 0
    finally:
        loader.shutdown()
    assert got == [[0, 1, 2, 3]]


# ----------------------------------------------------------------- wrong fields (finding 3)
@pytest.mark.parametrize("fields", [["y"], ["x", "y"]])
def test_a_closed_partition_without_the_fields_asked_for_is_an_error_not_an_empty_stream(fields):
    # It ended with no batch and no word; store.get said why (PartitionClosed naming the field)
    loader = _loader(_store(), fields=fields)
    with pytest.raises(
        ValueError, match=r"fields=\[.*'y'\].*field\(s\) \['y'\] \(fields produced: \['x'\]\)"
    ):
        next(loader)
    assert not loader.stats()["ended"]
    loader.shutdown()
    with pytest.raises(PartitionClosed, match=r"field\(s\) \['y'\]"):  # get: as before
        _store().get("t", fields, 4, "p", timeout=1)


def test_a_wrong_field_reaches_a_worker_process_as_an_error():
    loader = _loader(_store(), fields=["y"], num_workers=1)
    try:
        with pytest.raises(ValueError, match=r"no sample of it has field\(s\) \['y'\]"):
            next(loader)
    finally:
        loader.shutdown()


def test_a_closed_partition_nothing_was_put_to_is_still_an_empty_stream():
    store = SampleStore()
    store.close("p")
    assert list(_loader(store)) == []
    drained = _loader(_store(8))
    assert len(list(drained)) == 2 and drained.stats()["ended"]


# ----------------------------------------------------------------- refused constructor (finding 4)
def _door_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("meshfeed-store-door")]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
@pytest.mark.parametrize(
    "bad",
    [
        {"max_staleness": -1},
        {"max_staleness": "x"},
        {"group_filter": 5},  # refused at construction now, not at the first batch
    ],
)
def test_a_refused_constructor_with_workers_leaves_no_door_thread_or_socket(bad):
    store = _store()
    threads, fds = _door_threads(), _fds()
    for _ in range(3):
        with pytest.raises((ValueError, TypeError)):
            _loader(store, num_workers=1, **bad)
    deadline = time.monotonic() + 5
    while _door_threads() != threads and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _door_threads() == threads
    assert _fds() == fds


# ----------------------------------------------------------------- refused resize (finding 5)
def test_a_refused_resize_state_leaves_the_store_loader_where_it_was():
    loader = _loader(_store(40), prefetch=1)
    assert [next(loader).ids for _ in range(3)][-1] == [8, 9, 10, 11]
    good = loader.state_dict()
    with pytest.raises(ValueError, match="at batch 99"):
        loader.resize({"dp": 1}, rank=0, state={**good, "next": 99, "requested": 99})
    assert loader.state_dict() == good  # it was rebuilt at batch 0
    assert next(loader).ids == [12, 13, 14, 15]
    loader.shutdown()


def test_a_resize_the_store_refuses_goes_back_to_the_old_layout_at_its_position(monkeypatch):
    store = _store(40)
    loader = _loader(store, prefetch=1)
    assert [next(loader).ids for _ in range(2)][-1] == [4, 5, 6, 7]
    good = loader.state_dict()

    def refused(*args, **kwargs):
        raise ValueError("replan refused")

    monkeypatch.setattr(store, "replan", refused)
    with pytest.raises(ValueError, match="replan refused"):
        loader.resize({"dp": 2}, rank=0)
    assert (loader.data_world_size, loader.batch_size) == (1, 4)
    assert loader.state_dict() == good
    monkeypatch.undo()
    rest = [b.ids for b in loader]
    assert rest[0] == [8, 9, 10, 11] and len(rest) == 8  # every sample once


# ----------------------------------------------------------------- refused load (finding 6)
def _versioned_store() -> SampleStore:
    store = SampleStore()
    for v in range(4):
        store.put("p", {"x": list(range(v * 4, v * 4 + 4))}, ids=[f"{v}/{i}" for i in range(4)],
                  version=v)  # fmt: skip
    store.close("p")
    return store


def test_a_refused_policy_version_changes_neither_the_loader_nor_the_store(monkeypatch):
    store = _versioned_store()
    loader = _loader(store, max_staleness=0, prefetch=1)
    loader.set_version(3)
    good = loader.state_dict()
    with pytest.raises(ValueError, match="policy_version=-5"):
        loader.load_state_dict({**good, "policy_version": -5})
    assert loader.state_dict()["policy_version"] == 3  # it became None
    replans = []
    monkeypatch.setattr(store, "replan", lambda *a, **k: replans.append(a))
    # A state of another layout: the store's plans were moved before the version was checked
    other = {**good, "data_world_size": 2, "batch_size": 2, "policy_version": -5}
    with pytest.raises(ValueError, match="policy_version=-5"):
        loader.load_state_dict(other)
    assert replans == []
    monkeypatch.undo()
    batches = list(loader)
    assert [b.versions for b in batches] == [[3, 3, 3, 3]]


# ----------------------------------------------------------------- timeout message (finding 7)
def test_a_timeout_with_workers_names_the_seconds_given():
    loader = _loader(_store(2, close=False), num_workers=1, timeout=0.5)
    try:
        with pytest.raises(TimeoutError) as raised:
            next(loader)
    finally:
        loader.shutdown()
    assert "timed out after 0.5s;" in str(raised.value)  # was "after 0.4999957...s"
