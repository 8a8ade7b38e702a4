"""The store door on a real gloo group: ranks that loaded different StoreLoader states (one
stale) raise ValueError on every rank at their first batch, as DataLoader's walk-start
agreement makes them, and a damaged file on one rank makes the others raise RankError at the
same batch instead of waiting for it."""

from __future__ import annotations

from typing import Any

import pytest

from meshfeed.errors import RankError, SourceError
from meshfeed.queue import Batch, SampleStore, StoreLoader
from tests.dist_utils import run_distributed

N = 64


def _store() -> SampleStore:
    store = SampleStore()
    store.put("p", {"x": list(range(N))}, ids=list(range(N)))
    store.close("p")
    return store


def _loader(store: SampleStore, rank: int, **kwargs: Any) -> StoreLoader:
    return StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=4,
                       mesh={"dp": 2}, rank=rank, prefetch=1, timeout=30, **kwargs)  # fmt: skip


def _checkpoints() -> dict[str, Any]:
    """Two ranks simulated in this process (no process group): their loader state after 2
    and after 4 steps, and the store's after 4."""
    store = _store()
    loaders = [_loader(store, r) for r in (0, 1)]
    out: dict[str, Any] = {}
    for step in range(1, 5):
        for loader in loaders:
            next(loader)
        if step in (2, 4):
            out[f"S{step}"] = loaders[0].state_dict()
            assert out[f"S{step}"] == loaders[1].state_dict()
    out["store"] = store.state_dict()
    for loader in loaders:
        loader.shutdown()
    return out


def _restored(rank: int, checkpoint: dict[str, Any], state: str) -> StoreLoader:
    store = _store()
    store.load_state_dict(checkpoint["store"])
    loader = _loader(store, rank, collate_fn=_FailsOnce(rank))
    loader.load_state_dict(checkpoint[state])
    return loader


class _FailsOnce:
    """Rank 0's collate_fn raises SourceError the first time it sees sample 40 (batch 5)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.fired = rank, False

    def __call__(self, batch: Batch) -> list:
        if self.rank == 0 and 40 in batch.ids and not self.fired:
            self.fired = True
            raise SourceError("truncated shard holding sample 40")
        return list(batch.ids)


def _ranks(rank: int, world: int, checkpoint: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Rank 1 loads a stale state (S2) where rank 0 loads the one saved with the store (S4)
    stale = _restored(rank, checkpoint, "S4" if rank == 0 else "S2")
    try:
        next(stale)
        out["stale"] = "no error"
    except ValueError as exc:
        out["stale"] = str(exc)
    stale.shutdown()
    # Both load S4: agreed; rank 0's collate_fn hits a damaged file at batch 5
    loader = _restored(rank, checkpoint, "S4")
    batches, errors = [], []
    while True:
        try:
            batches.append(next(loader))
        except StopIteration:
            break
        except (SourceError, RankError) as exc:
            errors.append(type(exc).__name__)
            if len(errors) > 2:
                break
    out["batches"], out["errors"] = batches, errors
    loader.shutdown()
    return out


@pytest.mark.slow
def test_ranks_that_load_different_states_or_hit_a_damaged_file_fail_together():
    checkpoint = _checkpoints()
    results = run_distributed(_ranks, 2, checkpoint, timeout=120)
    for r in results:
        # Rank 1 read batches 2 and 3 again (samples served twice) and its peer's round was
        # never read by it, silently
        assert "StoreLoader of task 't'" in r["stale"]
        assert "rank 0: next=4 requested=4, rank 1: next=2 requested=2" in r["stale"]
        assert "they differ in next, requested" in r["stale"]
    # Rank 0 raised the SourceError itself (was a CollateError); rank 1 a RankError at the
    # same batch (it waited in the per-batch agreement); then both went on, every sample once
    assert results[0]["errors"] == ["SourceError"] and results[1]["errors"] == ["RankError"]
    seen = [i for r in results for b in r["batches"] for i in b]
    assert sorted(seen) == list(range(32, N))
    assert len(results[0]["batches"]) == len(results[1]["batches"]) == 4
