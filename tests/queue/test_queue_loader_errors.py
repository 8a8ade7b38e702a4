"""StoreLoader on_error: "raise" keeps the batch (CollateError), "skip" drops it counted and
warned, agreed by every rank; "substitute" is refused for a store."""

from __future__ import annotations

import logging
import math

import pytest

from meshfeed.queue import Batch, CollateError, SampleStore, StoreLoader


class _FailsOn:
    """A collate_fn that always fails on batches holding ``bad`` (and counts its calls)."""

    def __init__(self, bad: int) -> None:
        self.bad, self.calls = bad, 0

    def __call__(self, batch: Batch) -> list:
        self.calls += 1
        if self.bad in batch.ids:
            raise ValueError(f"cannot collate sample {self.bad}")
        return list(batch.ids)


def _loader(store: SampleStore, **kwargs) -> StoreLoader:
    defaults = {"task": "t", "fields": ["x"], "partition": "p", "mesh": {"dp": 1}, "rank": 0,
                "batch_size": 2, "timeout": 20}  # fmt: skip
    return StoreLoader(store, **{**defaults, **kwargs})


def _store(n: int = 8) -> SampleStore:
    store = SampleStore()
    store.put("p", {"x": list(range(n))})
    store.close("p")
    return store


@pytest.mark.parametrize("prefetch", [1, 3])
def test_skip_drops_a_batch_that_keeps_failing_counts_it_and_warns_once(prefetch, caplog):
    store = _store(8)
    collate = _FailsOn(3)
    loader = _loader(store, collate_fn=collate, on_error="skip", prefetch=prefetch)
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        batches = list(loader)
    assert batches == [[0, 1], [4, 5], [6, 7]]  # batch 1 ([2, 3]) dropped, nothing else
    assert collate.calls == 4 + 2  # the bad batch: the first attempt and collate_retries=2
    stats = loader.stats()
    assert (stats["skipped"], stats["skipped_samples"], stats["batches"]) == (1, 2, 3)
    assert stats["failures"] == [[1, [2, 3], "ValueError", "cannot collate sample 3"]]
    assert stats["store"]["consumed"] == 8  # the dropped batch's samples stay consumed
    assert stats["collate_errors"] == 0
    warnings = [r.getMessage() for r in caplog.records if "StoreLoader" in r.getMessage()]
    assert len(warnings) == 1
    assert "batch 1 (sample ids [2, 3]): ValueError: cannot collate sample 3" in warnings[0]
    assert "stats()['failures']" in warnings[0]


def test_a_skipped_batch_is_not_in_the_state_and_a_resume_goes_on_after_it():
    store = _store(8)
    loader = _loader(store, collate_fn=_FailsOn(3), on_error="skip", prefetch=1)
    assert next(loader) == [0, 1]
    assert next(loader) == [4, 5]  # batch 1 skipped on the way
    state = loader.state_dict()
    assert state["next"] == 3 and state["requested"] == 3
    again = _loader(store, collate_fn=_FailsOn(3), on_error="skip", prefetch=1)
    again.load_state_dict(state)
    assert list(again) == [[6, 7]]


def test_raise_is_the_default_and_keeps_the_batch():
    store = _store(4)
    loader = _loader(store, collate_fn=_FailsOn(1), prefetch=1)
    assert loader.on_error == "raise" and loader.options.on_error == "raise"
    with pytest.raises(CollateError, match="failed 3 times on batch 0"):
        next(loader)
    assert loader.stats()["skipped"] == 0 and loader.stats()["failures"] == []
    state = loader.state_dict()
    assert (state["next"], state["requested"]) == (0, 1)  # kept: its plan is read back
    again = _loader(store, collate_fn=None, prefetch=1)
    again.load_state_dict(state)
    assert next(again).ids == [0, 1]


def test_substitute_is_refused_for_a_store_naming_why_and_the_fix():
    with pytest.raises(ValueError, match="on_error='substitute' is not available for a "
                       "StoreLoader: a store batch has no deterministic substitute.*"
                       "on_error='skip'"):  # fmt: skip
        _loader(_store(), on_error="substitute")
    with pytest.raises(ValueError, match="on_error='ignore' is not one of"):
        _loader(_store(), on_error="ignore")


def test_skip_on_a_mesh_of_several_ranks_without_a_process_group_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"on_error='skip' on a mesh of 2 ranks needs the "
                       r"process group.*one step fewer"):  # fmt: skip
        _loader(_store(), mesh={"dp": 2}, rank=1, on_error="skip")
    with pytest.raises(ValueError, match="on_error='skip' on a mesh of 2 ranks"):
        _loader(_store(), mesh={"dp": 1, "tp": 2}, rank=0, on_error="skip")
    # One rank: nothing to agree with.
    assert _loader(_store(), on_error="skip", timeout=math.inf).on_error == "skip"


class _FailsUntilFixed(_FailsOn):
    """A collate_fn that fails on batches holding ``bad`` until ``fixed`` is set."""

    fixed = False

    def __call__(self, batch: Batch) -> list:
        if self.fixed:
            return list(batch.ids)
        return super().__call__(batch)


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("again", ["next", "iter"])
def test_raise_then_fixed_goes_on_with_every_batch_and_no_wait(workers, again):
    """With workers, the batch kept by a CollateError is collated again without a store
    request, but the store door waited for its request first: the next batch's request waited
    out the whole timeout and raised TimeoutError."""
    store = _store(12)
    collate = _FailsUntilFixed(5)
    loader = _loader(store, collate_fn=collate, num_workers=workers, timeout=10, prefetch=2)
    it = iter(loader)
    got = [next(it), next(it)]
    with pytest.raises(CollateError, match="on batch 2"):
        next(it)
    collate.fixed = True
    rest = list(it if again == "next" else iter(loader))
    assert got + rest == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    loader.shutdown()
