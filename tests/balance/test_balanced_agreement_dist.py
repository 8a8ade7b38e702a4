"""BalancedBatches on real gloo ranks: every rank refuses ranks built differently (naming the
setting), names a rank whose inner iterator raised, and a rank that gave up on a stalled peer
can exit although the caller's group is the default one (whose timeout is 30 minutes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from meshfeed.balance import BalancedBatches, CostModel
from meshfeed.errors import CollectiveError, RankError
from tests.dist_utils import exit_order, run_distributed

from .checks import Samples

S2 = CostModel(quadratic=1.0)


def _balanced(rank: int, *, seed: int = 1, **settings: Any) -> BalancedBatches:
    import torch.distributed as dist

    inner = Samples(rank, seed=seed, batches=2, max_len=250, docs=8)
    given = {"max_tokens": 256, "cost": S2, "group": dist.group.WORLD, "timeout": 30.0}
    return BalancedBatches(inner, **{**given, **settings})


class _Raising:
    """Samples whose second ``next`` raises, as a dataset whose read failed."""

    def __init__(self, rank: int) -> None:
        self.inner, self.n = Samples(rank, seed=2, batches=4, max_len=250, docs=8), 0

    def __iter__(self) -> _Raising:
        return self

    def __next__(self) -> dict:
        self.n += 1
        if self.n == 2:
            raise OSError("disk read failed in the dataset")
        return next(self.inner)


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    """Each scenario on both ranks, in this order (each leaves the ranks in step)."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    apart = {
        "max_tokens": {"max_tokens": 256 if rank == 0 else 512},
        # sizes the header's buffer: a mismatch there aborted the process in gloo
        "max_docs_per_rank": {"max_docs_per_rank": 4096 if rank == 0 else 64},
        "cost": {"cost": S2 if rank == 0 else CostModel(linear=1.0)},
    }
    for name, settings in apart.items():
        try:
            with _balanced(rank, **settings) as it:
                out[name] = len(list(it))
        except ValueError as e:
            out[name] = str(e)
    # Instances built differently that each agreed with their peer: rank 0 goes on with one,
    # rank 1 with the other, so their headers meet.
    with _balanced(rank, plan_ahead=False) as a, _balanced(rank, plan_ahead=False, tp=2) as b:
        next(a), next(b)
        try:
            out["mixed"] = len(list(a if rank == 0 else b))
        except ValueError as e:
            out["mixed"] = str(e)
    inner = _Raising(rank) if rank == 1 else Samples(rank, seed=2, batches=4, max_len=250, docs=8)
    start = time.monotonic()
    try:
        with BalancedBatches(
            inner, max_tokens=256, cost=S2, group=dist.group.WORLD, timeout=10.0
        ) as it:
            out["raised"] = len(list(it))
    except Exception as e:
        out["raised"] = f"{type(e).__name__}: {e}"
        out["rank"] = e.rank if isinstance(e, RankError) else None
    out["raised_after"] = time.monotonic() - start
    return out


@pytest.fixture(scope="module")
def scenarios() -> list[dict[str, Any]]:
    return run_distributed(_scenarios, 2, timeout=120.0)


@pytest.mark.slow
def test_balanced_batches_with_different_max_tokens_refuse_on_every_rank(scenarios):
    for out in scenarios:  # 17 micro-steps on one rank and 8 on the other went unnoticed
        assert out["max_tokens"].startswith(
            "ranks built BalancedBatches with different max_tokens: rank i holds [256, 512]"
        ), out["max_tokens"]


@pytest.mark.slow
def test_balanced_batches_with_different_gather_buffers_refuse_instead_of_aborting(scenarios):
    for out in scenarios:  # the header's all-gather had two sizes: gloo aborted the process
        assert out["max_docs_per_rank"].startswith(
            "ranks built BalancedBatches with different max_docs_per_rank: rank i holds [4096, 64]"
        ), out["max_docs_per_rank"]
        want = "rank i holds [CostModel(linear=0.0, quadratic=1.0, per_step=0.0), CostModel("
        assert want in out["cost"], out["cost"]


@pytest.mark.slow
def test_balanced_batches_refuse_headers_of_instances_built_differently(scenarios):
    for out in scenarios:
        assert "come from BalancedBatches built differently" in out["mixed"], out["mixed"]


@pytest.mark.slow
def test_a_rank_whose_inner_iterator_raises_is_named_on_every_rank_at_once(scenarios):
    zero, one = scenarios
    assert one["raised"] == "OSError: disk read failed in the dataset", one["raised"]
    assert zero["raised"].startswith(
        "RankError: the inner iterator of rank 1 raised OSError: disk read failed in the dataset"
    ), zero["raised"]
    assert zero["rank"] == 1
    # at once, not after BalancedBatches(timeout=10.0) as a stalled rank
    assert zero["raised_after"] < 5.0, zero["raised_after"]


STALL = 30.0  # seconds rank 1 stays alive, not iterating, after its second micro-step


def _stall_entry(rank: int, world: int, port: int, out_dir: str) -> None:
    """A rank of a job whose default group has torch's default timeout (30 minutes), as a
    user's: rank 1 stops iterating; rank 0 raises after BalancedBatches(timeout=1.0) and ends
    its process without tearing the group down, as a failed training script does."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    error = None
    inner = Samples(rank, seed=3, batches=8, max_len=250, docs=8)
    try:
        with BalancedBatches(
            inner, max_tokens=256, cost=S2, group=dist.group.WORLD, timeout=1.0
        ) as it:
            for n, _ in enumerate(it, 1):
                if rank == 1 and n == 2:
                    time.sleep(STALL)
                    break
    except CollectiveError as e:
        error = str(e)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"error": error}))


@pytest.mark.slow
def test_a_rank_that_gave_up_on_a_stalled_peer_exits_under_the_default_group(tmp_path):
    # Rank 0 gives up after about a second; with a collective left pending on the default
    # group, its process stayed until rank 1's ended (STALL later).
    first = exit_order(_stall_entry, 2, str(tmp_path), STALL + 30)
    assert first == [0], f"rank 0 should exit while rank 1 stalls; exited first: {first}"
    error = json.loads((tmp_path / "0.json").read_text())["error"]
    assert error is not None and "BalancedBatches(timeout=1.0)" in error, error
    assert "raise BalancedBatches(timeout=)" in error, error
