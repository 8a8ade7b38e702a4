"""Megatron-style hybrid context parallelism on CPU gloo ranks, with meshfeed's drop-in loader.

Run: ``python examples/megatron_hybrid_cp.py --world 4`` (DP 2 x CP 2; ``--world 2`` is DP 1 x
CP 2). Each DP replica's iterator yields lists of packed samples (CP peers of one replica yield
the same ones, as in Megatron). The one line a Megatron training script changes is marked
below; the loop after it is Megatron's ``hybrid_context_parallel_forward_backward`` in
miniature: per group, run each sub-sample with the CP size of the ranks that share it, then a
barrier. Instead of a model, each rank checks its documents and counts the tokens of its CP
share (zigzag split, as Transformer Engine splits a document).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch

# Run from a checkout without installing: put this tree's src/ first.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from meshfeed import dist
from meshfeed.balance.megatron import HybridCPDataLoader
from meshfeed.launch import run_distributed

MAX_SEQLEN_PER_RANK = 256


def packed_samples(replica: int, step: int) -> list[dict[str, torch.Tensor]]:
    """What a Megatron GPT dataset yields for one DP replica and step: packed samples."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    out = []
    for _ in range(2):
        lengths = (torch.rand(4, generator=g) ** 3 * 500).long() + 1  # up to 2 ranks x 256
        total = int(lengths.sum())
        doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        tokens = torch.randint(0, 50_000, (total,), generator=g)
        out.append(
            {
                "tokens": tokens,
                "labels": torch.roll(tokens, -1),
                "loss_mask": torch.ones(total, dtype=torch.float32),
                "position_ids": torch.arange(total)
                - torch.cat([torch.zeros(1), lengths.cumsum(0)])[doc].long(),
                "cu_seqlens": torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32),
            }
        )
    return out


def train_rank(rank: int, world: int, steps: int) -> dict[str, Any]:
    cp = 2
    dp = world // cp
    # Megatron's rank order (tp-cp-dp): CP varies fastest; a DP group holds one rank per replica.
    dp_groups = [dist_new_group([c + cp * d for d in range(dp)]) for c in range(cp)]
    pg_collection = SimpleNamespace(dp_cp=None, dp=dp_groups[rank % cp], tp=None)
    config = SimpleNamespace(max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_RANK)
    replica = rank // cp
    data_iterator = iter([packed_samples(replica, s) for s in range(steps)])

    # Before: data_iterator = HybridCPDataLoaderWrapper(data_iterator, config, pg_collection)
    data_iterator = HybridCPDataLoader(data_iterator, config, pg_collection)  # the one line

    tokens_run, docs_run = 0, []
    for step in range(steps):
        samples, sample_id_groups = next(data_iterator)
        every_doc = [d for r in range(dp) for d in documents(packed_samples(r, step))]
        for group in sample_id_groups:
            for gid in group[rank]:
                sample = samples[gid]
                local_cp_size = sum(gid in ids for ids in group)
                for key, want in every_doc[gid].items():  # the document, unchanged
                    assert torch.equal(sample[key], want), (step, gid, key)
                tokens_run += -(-sample["tokens"].numel() // local_cp_size)  # this rank's share
                docs_run.append((step, gid, local_cp_size))
            dist.barrier(timeout=60.0)  # Megatron's barrier at the end of every group
    return {"tokens": tokens_run, "docs": docs_run, "groups": sample_id_groups}


def documents(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The non-empty documents of packed samples, in order (how Megatron numbers them)."""
    out = []
    for sample in batch:
        cu = sample["cu_seqlens"].tolist()
        for a, b in itertools.pairwise(cu):
            if b > a:
                out.append({k: v[a:b] for k, v in sample.items() if k != "cu_seqlens"})
    return out


def dist_new_group(ranks: list[int]) -> Any:
    import torch.distributed as tdist

    return tdist.new_group(ranks)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, choices=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    results = run_distributed(train_rank, args.world, args.steps, timeout=300.0)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {len(r['docs'])} sub-samples, {r['tokens']} tokens of its CP shares")
    return results


if __name__ == "__main__":
    main()
