"""HybridCPDataLoader on real gloo ranks: a rank whose data iterator raises or ends early is
named on every rank at once, iterators that end together end the loader on every rank, and a
rank that gave up on a stalled peer exits although the caller's group is the default one
(whose timeout is 30 minutes). One spawn of two processes runs every case."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from meshfeed.balance.megatron import HybridCPDataLoader
from meshfeed.errors import CollectiveError, RankError
from tests.dist_utils import exit_order

STALL = 6.0  # seconds rank 1 stays alive, not iterating, after its first global batch


def _batch(rank: int, step: int) -> list[dict[str, torch.Tensor]]:
    """One packed sample of three documents, different on each rank and step."""
    lengths = [40 + 7 * rank + step, 60, 25 + step]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.arange(total, dtype=torch.int64) + 1000 * rank + 100 * step
    return [{"tokens": tokens, "labels": tokens + 1, "cu_seqlens": cu}]


def _batches(rank: int, n: int, *, raise_at: int | None = None) -> Iterator[Any]:
    for step in range(n):
        if step == raise_at:
            raise OSError("disk read failed in the dataset")
        yield _batch(rank, step)


def _loader(data: Iterator[Any], timeout: float) -> HybridCPDataLoader:
    import torch.distributed as dist

    pgs = SimpleNamespace(dp_cp=dist.group.WORLD, dp=dist.group.WORLD)
    return HybridCPDataLoader(
        data, SimpleNamespace(max_seqlen_per_dp_cp_rank=256), pgs, timeout=timeout
    )


def _run(rank: int, out: dict[str, Any], name: str, loader: HybridCPDataLoader) -> None:
    start = time.monotonic()
    steps = 0
    try:
        for _ in loader:
            steps += 1
        out[name] = f"ended after {steps}"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
        out[f"{name}_rank"] = e.rank if isinstance(e, RankError) else None
    out[f"{name}_after"] = time.monotonic() - start


def _entry(rank: int, world: int, port: int, out_dir: str) -> None:
    """Every case on both ranks in this order (each leaves them in step), then the stall: rank
    1 stops iterating; rank 0 raises after HybridCPDataLoader(timeout=1.0) and ends its process
    without tearing the group down, as a failed training script does."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    path = Path(out_dir, f"{rank}.json")
    try:
        raising = _batches(rank, 3, raise_at=1 if rank == 1 else None)
        _run(rank, out, "raised", _loader(raising, 5.0))
        _run(rank, out, "ended", _loader(_batches(rank, 3 if rank == 0 else 1), 5.0))
        _run(rank, out, "together", _loader(_batches(rank, 2), 5.0))
        path.write_text(json.dumps(out))
        it = _loader(_batches(rank, 4), 1.0)
        next(it)
        if rank == 1:
            time.sleep(STALL)
        else:
            try:
                next(it)
                out["stall"] = None
            except CollectiveError as e:
                out["stall"] = str(e)
    except Exception as e:
        out["failed"] = f"{type(e).__name__}: {e}"
    path.write_text(json.dumps(out))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out_dir = tmp_path_factory.mktemp("hybrid_cp_faults")
    # Rank 0 gives up on rank 1 about a second into the stall; with a collective left
    # pending on the default group, its process stayed until rank 1's ended (STALL later).
    first = exit_order(_entry, 2, str(out_dir), STALL + 60, wait_rest=True)
    results = []
    for r in range(2):
        f = out_dir / f"{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {})
    return {"first": first, "results": results}


@pytest.mark.slow
def test_a_rank_whose_data_iterator_raises_is_named_on_every_rank_at_once(job):
    zero, one = job["results"]
    assert one["raised"] == "OSError: disk read failed in the dataset", one
    assert zero["raised"].startswith(
        "RankError: the data iterator of DP rank 1 raised OSError: disk read failed in the dataset"
    ), zero
    assert zero["raised_rank"] == 1
    # at once, not after HybridCPDataLoader(timeout=5.0) as a stalled rank
    assert zero["raised_after"] < 2.5, zero["raised_after"]


@pytest.mark.slow
def test_a_rank_whose_data_iterator_ends_first_is_named_on_every_rank(job):
    for out in job["results"]:
        assert out["ended"].startswith("RankError: rank 1's data iterator ended"), out
        assert out["ended_rank"] == 1
        assert out["ended_after"] < 2.5, out["ended_after"]


@pytest.mark.slow
def test_data_iterators_that_end_together_end_the_loader_on_every_rank(job):
    for out in job["results"]:
        assert out["together"] == "ended after 2", out
        assert out["together_after"] < 2.5, out["together_after"]


@pytest.mark.slow
def test_a_rank_that_gave_up_on_a_stalled_peer_exits_under_the_default_group(job):
    zero = job["results"][0]
    assert "failed" not in zero, zero
    assert zero.get("stall") is not None, zero
    assert job["first"] == [0], f"rank 0 should exit while rank 1 stalls: {job['first']}"
