"""The per-step agreement of ``on_error="raise"`` with a delivery thread (``device=`` or
pinning) and a process group: made on the loop's thread, once per batch taken.

It ran on the delivery thread, which runs ahead of the loop by a number of batches that
differs between ranks when a walk ends: one rank was left in an agreement its peers never
made, and the next collective (the next walk's start) mismatched, hanging both ranks until
the timeout (seen in the suite under load). Here rank 1's delivery thread is held up preparing
a batch while rank 0's goes on to the next agreement, and then the walk is superseded."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from meshfeed import DataLoader
from meshfeed.delivery import _Copier
from tests.dist_utils import run_distributed


class _Items:
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _hold_up_rank_1(rank: int) -> threading.Event:
    """Rank 1's delivery thread is held up 1 s preparing its 4th batch; the event is set once
    that is under way (rank 1), or once this rank's thread prepares its 5th batch (rank 0: past
    the 5th batch's agreement where the thread made it), so the walk ends with rank 0's thread
    ahead of rank 1's."""
    prepared, ready = {"n": 0}, threading.Event()
    real = _Copier.prepare

    def prepare(self, batch):
        prepared["n"] += 1
        if prepared["n"] == (4 if rank == 1 else 5):
            ready.set()
            if rank == 1:
                time.sleep(1.0)
        return real(self, batch)

    _Copier.prepare = prepare  # type: ignore[method-assign]
    return ready


def _superseded_while_one_rank_lags(rank: int, world: int) -> list[list[int]]:
    ready = _hold_up_rank_1(rank)
    loader = DataLoader(
        _Items(), batch_size=2, seed=1, on_error="raise", device="cpu", device_prefetch=1,
        timeout=20,
    )  # fmt: skip
    it = iter(loader)
    first = [next(it).view(-1).tolist() for _ in range(3)]
    assert ready.wait(20)  # rank 1's thread is held up; rank 0's went on past the 4th batch
    rest = [b.view(-1).tolist() for b in loader]  # a new walk supersedes the first
    return first + rest


@pytest.mark.slow
def test_a_walk_superseded_while_one_ranks_delivery_thread_lags_agrees_on_every_rank():
    started = time.monotonic()
    results = run_distributed(_superseded_while_one_rank_lags, 2, timeout=120)
    assert time.monotonic() - started < 60  # no collective waited out its timeout
    assert [len(r) for r in results] == [10, 10]
    assert sorted(v for r in results for b in r for v in b) == list(range(40))


def _store_then_map_loader(rank: int, world: int) -> dict[str, list[int]]:
    from meshfeed.queue import SampleStore, StoreLoader

    ready = _hold_up_rank_1(rank)
    store = SampleStore()
    store.put("p", {"x": list(range(64))}, ids=list(range(64)))
    store.close("p")
    loader = StoreLoader(
        store, task="t", fields=["x"], partition="p", batch_size=2, mesh={"dp": 2}, rank=rank,
        collate_fn=lambda b: list(b.ids), device="cpu", device_prefetch=1, timeout=60,
    )  # fmt: skip
    took = [v for _ in range(3) for v in next(loader)]
    assert ready.wait(20)  # rank 1's thread is held up; rank 0's went on past the 4th batch
    loader.shutdown()
    # The next collectives on meshfeed's group (a map loader's walk and steps) still pair up.
    after = DataLoader(_Items(), batch_size=2, seed=1, on_error="raise")
    return {"store": took, "map": [v for b in after for v in b.view(-1).tolist()]}


@pytest.mark.slow
def test_a_store_loader_shut_down_while_one_ranks_delivery_thread_lags_leaves_no_collective():
    started = time.monotonic()
    results = run_distributed(_store_then_map_loader, 2, timeout=180)
    assert time.monotonic() - started < 40  # no collective waited out its 60 s timeout
    assert sorted(v for r in results for v in r["store"]) == list(range(12))
    assert sorted(v for r in results for v in r["map"]) == list(range(40))
