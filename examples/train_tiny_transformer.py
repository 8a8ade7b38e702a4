"""Train a tiny transformer on 2 gloo ranks, checkpoint with DCP, stop, resume: same loss curve.

What it shows, end to end, in plain PyTorch on CPU:

1. A small Megatron-format corpus (``.bin/.idx``) written with ``meshfeed.sources.write_indexed``;
   documents end with an end-of-document token and are packed into GPT windows that cross
   document boundaries (``TokenWindows``).
2. A dp x tp mesh (default dp=1 x tp=2, two processes): tensor-parallel peers receive identical
   batches (checked every step with an all-gather); the tensor split of the model is simulated
   by replicating it on the tp peers; gradients are averaged over the data ranks.
3. The training state ``{"model", "optim", "data": loader}`` is saved with
   ``torch.distributed.checkpoint`` at step ``--save-at`` of the uninterrupted run; its
   processes run on to ``--steps`` and exit (what they did after the checkpoint is lost, as in
   a crash); new processes load the checkpoint into fresh objects and train to ``--steps``.
4. The losses of the resumed run equal those of an uninterrupted run, step for step (printed
   side by side; the exit code is 1 if any differs).

    python examples/train_tiny_transformer.py                   # about half a minute on 2 cores
    python examples/train_tiny_transformer.py --steps 6 --save-at 3 --d-model 16
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from meshfeed import DataLoader, DataMesh
from meshfeed.launch import run_distributed
from meshfeed.sources import TokenWindows, write_indexed

VOCAB, EOD = 256, 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    corpus: str
    checkpoint: str
    dp: int
    tp: int
    steps: int
    save_at: int
    batch_size: int
    seq_len: int
    d_model: int
    layers: int
    lr: float


class TinyTransformer(nn.Module):
    """A causal decoder: embeddings, ``layers`` pre-norm blocks, a tied LM head."""

    def __init__(self, d_model: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        block = nn.TransformerEncoderLayer(
            d_model,
            nhead=2,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        nn.init.normal_(self.embed.weight, std=0.02)  # small logits from the tied head
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n))
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.norm(x) @ self.embed.weight.T


class TrainState(Stateful):
    """Model and optimizer through DCP's state_dict helpers (handles optimizer state init)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def _dp_group(rank: int, mesh: DataMesh) -> Any:
    """The process group of this rank's data-parallel peers (same tp index)."""
    mine = None
    for tp_index in range(mesh.sizes["tp"]):
        ranks = [r for r in range(mesh.world_size) if r % mesh.sizes["tp"] == tp_index]
        group = dist.new_group(ranks)  # every rank creates every group, in the same order
        if rank in ranks:
            mine = group
    return mine


def train(rank: int, world: int, cfg: Config, phase: str) -> list[float]:
    """One rank: ``phase`` is "full" (to the end, saving at ``save_at``) or "resume"."""
    mesh = DataMesh.from_sizes(world_size=world, dp=cfg.dp, tp=cfg.tp)
    dp_group = _dp_group(rank, mesh)
    torch.manual_seed(0)  # the same initial model on every rank (replicated tp)
    model = TinyTransformer(cfg.d_model, cfg.layers, cfg.seq_len)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    loader = DataLoader(
        TokenWindows(cfg.corpus, seq_len=cfg.seq_len), batch_size=cfg.batch_size, mesh=mesh, seed=1
    )
    state = {"train": TrainState(model, optim), "data": loader}
    step = 0
    if phase == "resume":
        dcp.load(state, checkpoint_id=cfg.checkpoint)
        step = cfg.save_at
    losses: list[float] = []
    batches = iter(loader)
    while step < cfg.steps:
        try:
            tokens = next(batches)
        except StopIteration:  # end of an epoch: the loader moves on to the next
            batches = iter(loader)
            continue
        _check_tp_peers_agree(tokens, mesh, rank)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            if p.grad is not None and cfg.dp > 1:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= cfg.dp
        optim.step()
        # The loss of the global batch: average over the data ranks.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss) / world)
        step += 1
        if phase == "full" and step == cfg.save_at:
            dcp.save(state, checkpoint_id=cfg.checkpoint)
    return losses


def _check_tp_peers_agree(tokens: torch.Tensor, mesh: DataMesh, rank: int) -> None:
    digest = torch.tensor([int(tokens.sum()), int((tokens * torch.arange(tokens.shape[1])).sum())])
    every = [torch.zeros_like(digest) for _ in range(mesh.world_size)]
    dist.all_gather(every, digest)
    for group in mesh.replica_groups():
        if any(not every[r].equal(every[group[0]]) for r in group):
            raise RuntimeError(f"tensor-parallel peers {group} got different batches (rank {rank})")


def _write_corpus(prefix: str, documents: int) -> None:
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(documents):  # short "words" of repeated patterns: something to learn
        period = int(rng.integers(2, 6))
        pattern = rng.integers(1, VOCAB, size=period)
        doc = np.tile(pattern, int(rng.integers(4, 40)))
        docs.append(np.concatenate([doc, [EOD]]))
    write_indexed(prefix, docs, np.uint16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    parser.add_argument("--save-at", type=int, default=10, help="checkpoint step (default 10)")
    parser.add_argument("--batch-size", type=int, default=4, help="per data rank (default 4)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per window (default 64)")
    parser.add_argument("--d-model", type=int, default=32, help="model width (default 32)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--documents", type=int, default=400, help="corpus size (default 400)")
    args = parser.parse_args(argv)
    for name in ("dp", "tp", "steps", "batch_size", "seq_len", "d_model", "layers", "documents"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})"
            )
    if not 0 < args.save_at < args.steps:
        parser.error(
            f"--save-at must lie inside the run (got save_at={args.save_at}, steps={args.steps}); "
            f"use e.g. --save-at {max(1, args.steps // 2)}"
        )
    if args.d_model % 2:
        parser.error(f"--d-model must be even (two attention heads; got {args.d_model})")
    world = args.dp * args.tp
    with tempfile.TemporaryDirectory(prefix="meshfeed-tiny-") as tmp:
        _write_corpus(os.path.join(tmp, "corpus"), args.documents)
        cfg = Config(
            corpus=os.path.join(tmp, "corpus"),
            checkpoint=os.path.join(tmp, "checkpoint"),
            dp=args.dp,
            tp=args.tp,
            steps=args.steps,
            save_at=args.save_at,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            d_model=args.d_model,
            layers=args.layers,
            lr=3e-3,
        )
        print(
            f"uninterrupted run on {world} gloo ranks, mesh dp={args.dp} x tp={args.tp}, "
            f"checkpoint at step {args.save_at}; then its processes exit",
            flush=True,
        )
        full = run_distributed(train, world, cfg, "full")[0]
        print("new processes resume from the DCP checkpoint", flush=True)
        resumed = run_distributed(train, world, cfg, "resume")[0]
    print(f"{'step':>4}  {'uninterrupted':>13}  {'resumed':>13}")
    for step, loss in enumerate(full):
        other = resumed[step - args.save_at] if step >= args.save_at else math.nan
        print(f"{step:>4}  {loss:>13.6f}  {other:>13.6f}")
    same = resumed == full[args.save_at :]
    print(
        f"resumed loss curve {'identical to' if same else 'DIFFERS from'} the uninterrupted run "
        f"({len(resumed)} steps after the checkpoint); loss {full[0]:.3f} -> {full[-1]:.3f}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
