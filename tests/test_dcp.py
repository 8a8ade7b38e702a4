"""The loader as a ``torch.distributed.checkpoint`` (DCP) ``Stateful`` in a training state.

A training state ``{"model": ..., "optim": ..., "data": loader}`` is saved with DCP at step k,
loaded into fresh objects (a differently initialised model, a new optimizer, a new loader) and
training goes on: the batches and the losses after the resume equal those of the uninterrupted
run. Once on two real gloo ranks, once with both ranks simulated in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from meshfeed import DataLoader, DataMesh
from tests.dist_utils import run_distributed

N, BATCH, STEPS, SAVE_AT = 96, 4, 8, 3


class ModelAndOptim(Stateful):
    """The DCP tutorial's wrapper: model and optimizer state through DCP's state_dict helpers."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def _build(
    rank: int, dp: int, init_seed: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    data = np.arange(N, dtype=np.float32)
    loader = DataLoader(data, batch_size=BATCH, mesh=DataMesh.from_sizes(dp=dp), rank=rank, seed=7)
    return model, optim, loader


def _step(
    model: torch.nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor, dp: int
) -> float:
    x = torch.stack([batch, batch.sin(), batch.cos(), batch / N], dim=1)
    loss = ((model(x).squeeze(1) - batch / N) ** 2).mean()
    optim.zero_grad()
    loss.backward()
    if dist.is_initialized():  # data parallel: average the gradients over the data ranks
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= dp
    optim.step()
    return float(loss.detach())


def _train(
    rank: int, dp: int, path: str, *, resume: bool, init_seed: int = 0
) -> tuple[list[list[float]], list[float]]:
    """Run to STEPS; save at SAVE_AT (first run) or load there and go on (resume)."""
    model, optim, loader = _build(rank, dp, init_seed)
    state = {"app": ModelAndOptim(model, optim), "data": loader}
    batches: list[list[float]] = []
    losses: list[float] = []
    if resume:
        dcp.load(state, checkpoint_id=path)
        assert loader.position == SAVE_AT * BATCH * dp
    steps = STEPS - SAVE_AT if resume else STEPS
    for batch in loader:
        batches.append(batch.tolist())
        losses.append(_step(model, optim, batch, dp))
        if not resume and len(batches) == SAVE_AT:
            dcp.save(state, checkpoint_id=path)
        if len(batches) == steps:
            break
    return batches, losses


def _rank(rank: int, world: int, path: str) -> dict[str, Any]:
    full_batches, full_losses = _train(rank, world, path, resume=False)
    dist.barrier()
    # Fresh objects: another initialisation, so only the checkpoint can make them agree.
    batches, losses = _train(rank, world, path, resume=True, init_seed=123)
    return {"full": (full_batches, full_losses), "resumed": (batches, losses)}


@pytest.mark.slow
def test_dcp_training_state_with_the_loader_resumes_exactly_on_two_gloo_ranks(tmp_path: Path):
    results = run_distributed(_rank, 2, str(tmp_path / "ckpt"), timeout=240.0)
    for r in results:
        full_batches, full_losses = r["full"]
        batches, losses = r["resumed"]
        assert len(batches) == STEPS - SAVE_AT
        assert batches == full_batches[SAVE_AT:]
        assert losses == full_losses[SAVE_AT:]  # bit-identical: same data, same model state
    # The two data ranks read disjoint slices of every global batch.
    seen = [set(map(int, sum(r["full"][0], []))) for r in results]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 2 * STEPS * BATCH
    # Both ranks took the same steps with all-reduced gradients: one loss curve per rank.
    assert len(results[0]["full"][1]) == len(results[1]["full"][1]) == STEPS


@pytest.mark.parametrize("rank", [0, 1])
def test_dcp_loader_state_resumes_exactly_for_each_simulated_rank(rank: int, tmp_path: Path):
    # No process group: DCP saves and loads one rank's state; each rank of dp=2 in turn.
    path = str(tmp_path / f"ckpt{rank}")
    full_batches, full_losses = _train(rank, 2, path, resume=False)
    batches, losses = _train(rank, 2, path, resume=True, init_seed=123)
    assert batches == full_batches[SAVE_AT:]
    assert losses == full_losses[SAVE_AT:]


def _dcp_round_trip(obj: Stateful, fresh: Stateful, path: Path) -> None:
    """Save ``{"data": obj}`` with DCP (one process) and load it into ``{"data": fresh}``."""
    dcp.save({"data": obj}, checkpoint_id=str(path), no_dist=True)
    dcp.load({"data": fresh}, checkpoint_id=str(path), no_dist=True)


def test_dcp_store_loader_state_resumes_exactly(tmp_path: Path):
    import math

    from meshfeed.queue import SampleStore, StoreLoader

    def make(store: SampleStore) -> StoreLoader:
        return StoreLoader(
            store,
            task="t",
            fields=["x"],
            batch_size=2,
            partition="p",
            mesh={"dp": 1},
            rank=0,
            prefetch=4,
            timeout=math.inf,
        )

    store = SampleStore(tasks=["t"])
    store.put("p", {"x": list(range(20))})
    store.close("p")
    loader = make(store)
    first = [next(loader).ids for _ in range(2)]
    state = loader.state_dict()
    assert state["requested"] > state["next"], "the test needs batches fetched ahead"
    store.save(tmp_path / "store.pt")
    rest = [b.ids for b in loader]
    again = make(SampleStore.load(tmp_path / "store.pt"))
    _dcp_round_trip(HeldState(state), again, tmp_path / "ckpt")
    assert again.state_dict() == state
    assert [b.ids for b in again] == rest
    assert [k for ids in first + rest for k in ids] == list(range(20))
    loader.shutdown()
    again.shutdown()


def test_dcp_balanced_batches_state_resumes_exactly(tmp_path: Path):
    from meshfeed.balance import BalancedBatches, CostModel
    from meshfeed.testing import assert_same, take
    from tests.balance.checks import Samples

    def make() -> BalancedBatches:
        inner = Samples(0, seed=3, batches=4, max_len=64, docs=8)
        return BalancedBatches(inner, max_tokens=256, cost=CostModel(quadratic=1.0))

    with make() as it:
        full = list(it)
    with make() as it:
        head = take(it, 3)
        fresh = make()
        _dcp_round_trip(it, fresh, tmp_path / "ckpt")
    with fresh:
        tail = list(fresh)
    assert len(tail) == len(full) - len(head) > 0
    assert_same(head + tail, full)


class HeldState(Stateful):
    """A ``Stateful`` holding one state dict, as a training script's checkpoint object would."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_dcp_refuses_a_ramp_or_order_the_loading_loader_lacks(tmp_path: Path):
    # DCP loads into the keys of the loading loader's own state: the rampup_* fields of a
    # ramp's checkpoint were dropped for a loader built without the ramp, and it resumed
    # with other batch sizes. Every state now says whether it has a ramp (ramped) and order
    # facts (order_facts).
    from meshfeed.curriculum import Curriculum, CurriculumMetric, MetricIndex, fixed_linear

    data = np.arange(200)
    ramped = DataLoader(data, batch_size=8, seed=0, rampup=(4, 4, 40))
    it = iter(ramped)
    for _ in range(7):
        next(it)
    with pytest.raises(ValueError, match=r"taken with a batch-size ramp whose fields are missing"):
        _dcp_round_trip(ramped, DataLoader(data, batch_size=8, seed=0), tmp_path / "a")
    vals = np.arange(200) % 50
    index = MetricIndex.from_values("m", vals, fingerprint={"length": 200})
    schedule = fixed_linear(10, 49, 20, 1)
    curriculum = Curriculum(
        [CurriculumMetric(index=index, schedule=schedule, difficulty_type="value")]
    )
    gated = DataLoader(data, batch_size=8, seed=0, curriculum=curriculum)
    next(iter(gated))
    with pytest.raises(ValueError, match=r"order has facts, but they are missing"):
        _dcp_round_trip(gated, DataLoader(data, batch_size=8, seed=0), tmp_path / "b")
    same = DataLoader(data, batch_size=8, seed=0, rampup=(4, 4, 40))
    _dcp_round_trip(ramped, same, tmp_path / "c")  # the same ramp: resumes exactly
    assert [len(b) for b in same][:4] == [4, 4, 4, 8] and same.epoch == 1
