"""The store door on a real gloo group: ranks whose loaders were built with different settings
are refused at their first batch, by name, on every rank (with another batch_size they took
overlapping samples of every round, silently); a batch whose making raised on one rank makes
the others raise at once, naming that rank and its error (they waited in the per-batch
agreement until the timeout, then reported a stalled rank)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from meshfeed.errors import RankError
from meshfeed.queue import Batch, GroupSampler, SampleStore, StoreLoader
from tests.dist_utils import run_distributed

N = 16


def _store(fields: tuple[str, ...] = ("x",), n: int = N, close: bool = True) -> SampleStore:
    """Each rank's own store, with the same puts: the same rounds on every rank."""
    store = SampleStore()
    groups = [i // 2 for i in range(n)]
    store.put("p", {f: list(range(n)) for f in fields}, ids=list(range(n)), groups=groups)
    if close:
        store.close("p")
    return store


def _loader(store: SampleStore, **kwargs: Any) -> StoreLoader:
    options: dict[str, Any] = {"batch_size": 2, "prefetch": 1, "timeout": 10, **kwargs}
    return StoreLoader(store, task="t", fields=["x"], partition="p", mesh={"dp": 2}, **options)


def _first(loader: StoreLoader) -> str:
    try:
        next(loader)
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        loader.shutdown()


def _settings_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "batch_size": ({"batch_size": 2}, {"batch_size": 4}),
        "sampler": ({"sampler": GroupSampler(group_size=2)}, {}),
        "ahead": ({"prefetch": 1}, {"prefetch": 3}),
    }
    for case, (zero, one) in cases.items():
        out[case] = _first(_loader(_store(), **(zero if rank == 0 else one)))
    with _loader(_store(), sampler=GroupSampler(group_size=2), prefetch=2) as loader:
        out["agreed"] = [list(batch.ids) for batch in loader]
    return out


class _SlowOnce:
    """Rank 0's collate_fn takes a second on sample 8 (batch 2), so it waits in that batch's
    agreement after its peer's wait for batch 2 began."""

    def __init__(self, rank: int) -> None:
        self.rank, self.slept = rank, False

    def __call__(self, batch: Batch) -> list:
        if self.rank == 0 and 8 in batch.ids and not self.slept:
            self.slept = True
            time.sleep(1.0)
        return list(batch.ids)


def _raising_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Rank 1's store holds no field "x": its request is refused (ValueError) at batch 0
    for on_error in ("raise", "skip"):
        store = _store() if rank == 0 else _store(fields=("y",))
        loader = _loader(store, on_error=on_error)
        start = time.monotonic()
        try:
            next(loader)
            out[on_error] = ("no error",)
        except Exception as exc:
            out[on_error] = (type(exc).__name__, str(exc), getattr(exc, "rank", None))
        out[f"{on_error}_s"] = time.monotonic() - start
        out[f"{on_error}_state"] = loader.state_dict()["next"], loader.stats()["skipped"]
        loader.shutdown()
    # Rank 1's producers are late for batch 2: its wait times out; every rank raises a
    # TimeoutError there, then both go on once the samples come, every sample once
    store = _store(n=8 if rank == 1 else N, close=rank == 0)
    loader = _loader(store, timeout=2, collate_fn=_SlowOnce(rank))
    got = [next(loader), next(loader)]
    try:
        got.append(next(loader))
        out["late"] = ("no error",)
    except TimeoutError as exc:
        out["late"] = (type(exc).__name__, str(exc), isinstance(exc, RankError))
    if rank == 1:
        store.put("p", {"x": list(range(8, N))}, ids=list(range(8, N)))
        store.close("p")
    got.extend(loader)
    out["got"] = got
    loader.shutdown()
    # Rank 0's partition ends after one round; rank 1's is open and its batch 1 times out.
    # Rank 0 sees the end at batch 1 a second later (a training step) and joins that batch's
    # agreement, so it hears rank 1's error; a rank that saw the end joined none, and rank
    # 1's announcement stayed pending, paired with the next loader's start agreement.
    store = _store(n=4, close=rank == 0)
    loader = _loader(store, timeout=2)
    got = [list(next(loader).ids)]
    if rank == 0:
        time.sleep(1.0)
    try:
        got.extend(list(batch.ids) for batch in loader)
        out["ended"] = ("no error", got)
    except TimeoutError as exc:
        out["ended"] = (type(exc).__name__, got, str(exc))
    # Both go on after the TimeoutError (rank 1's partition closes: it ends there too). The
    # end is recorded only once agreed: rank 0 asks for batch 1 again and joins rank 1's retry.
    if rank == 1:
        store.close("p")
    out["retry"] = [list(batch.ids) for batch in loader]
    loader.shutdown()
    with _loader(_store(n=4)) as loader:  # the next step's loader: agreed as ever
        out["after"] = [list(batch.ids) for batch in loader]
    return out


def _rank(rank: int, world: int) -> dict[str, Any]:
    """Both parts in one job: starting the processes takes longer than either."""
    return {"settings": _settings_rank(rank, world), "raising": _raising_rank(rank, world)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_rank, 2, timeout=120)


@pytest.mark.slow
def test_ranks_built_with_other_settings_are_refused_by_name_on_every_rank(ranks):
    results = [r["settings"] for r in ranks]
    for r in results:
        # With batch_size 2 and 4, rank 0 took samples 0-1 of round [0..3] and rank 1 samples
        # 4-7 of round [0..7]: 2-3 went to neither, and 8-15 to both at later steps
        size, sampler = r["batch_size"], r["sampler"]
        assert size.startswith("StoreLoader of task 't': the ranks' loaders were built with ")
        assert "different settings: batch_size (rank 0 has 2, rank 1 has 4)." in size
        assert "with the same batch_size, sampler" in size
        assert "settings: sampler (rank 0 has RankAwareSampler(replica_size=1, " in sampler
        assert "inner=GroupSampler(group_size=2, " in sampler
        assert "rank 1 has RankAwareSampler(" in sampler
        assert "inner=SequentialSampler(extra_fields=())" in sampler
        assert "settings: batches kept ahead, from prefetch, num_workers or service" in r["ahead"]
        assert "device_prefetch (rank 0 has 1, rank 1 has 3)." in r["ahead"]
    # Built alike (a sampler of the same settings on every rank): agreed, every sample once
    assert results[0]["agreed"] == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert results[1]["agreed"] == [[2, 3], [6, 7], [10, 11], [14, 15]]


@pytest.mark.slow
def test_an_error_on_one_rank_is_raised_at_once_on_every_rank_naming_it(ranks):
    zero, one = (r["raising"] for r in ranks)
    for on_error in ("raise", "skip"):
        # Rank 0 waited in the batch's agreement for its full timeout (10 s), then said a rank
        # had stalled; with "skip" too (it would have dropped the round had it been told)
        assert (
            one[on_error][0] == "ValueError" and "no sample of it has field(s)" in one[on_error][1]
        )
        kind, message, failed = zero[on_error]
        assert (kind, failed) == ("RankError", 1), zero[on_error]
        assert message.startswith("rank 1 raised ValueError: StoreLoader of task 't' asks for ")
        assert "at batch 0 of task 't' (this is rank 0)" in message
        assert zero[f"{on_error}_s"] < 5, zero[f"{on_error}_s"]
        assert zero[f"{on_error}_state"] == (0, 0)  # kept, not skipped
    # Rank 1's TimeoutError is one on rank 0 too (it had its batch): a loop that calls next()
    # again after a TimeoutError goes on on every rank (rank 0 went on alone, before)
    assert one["late"][0] == "TimeoutError" and not one["late"][2]
    assert zero["late"][0] == "RankTimeoutError" and zero["late"][2], zero["late"]
    assert zero["late"][1].startswith("rank 1 raised TimeoutError: ")
    assert zero["got"] == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert one["got"] == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert one["ended"][:2] == ("TimeoutError", [[2, 3]]), one["ended"]
    assert zero["ended"][:2] == ("RankTimeoutError", [[0, 1]]), zero["ended"]
    assert zero["ended"][2].startswith("rank 1 raised TimeoutError: "), zero["ended"]
    assert (zero["retry"], one["retry"]) == ([], [])
    assert (zero["after"], one["after"]) == ([[0, 1]], [[2, 3]])
