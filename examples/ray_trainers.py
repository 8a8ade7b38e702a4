"""Ray mode with four trainer actors: each resolves only its own slice of every global batch.

The layout of RL post-training and Ray-driven trainers: a driver iterates the DataLoader, the
dataset is built and read inside loader actors (``RayService``), and every global batch reaches
the trainers as a ``RemoteBatch`` with one object reference per data rank. Each trainer picks its
own reference with ``remote_batch.for_rank(rank)`` and resolves it in its own process, so the
driver never holds sample bytes and no trainer pulls the whole global batch. Tensor-parallel
peers (ranks 0/1 and 2/3 of the dp=2 x tp=2 mesh) share one reference.

Run:  PYTHONPATH=src python examples/ray_trainers.py [--steps 6]
"""

from __future__ import annotations

import argparse
import functools
import os
import zlib
from typing import Any

import numpy as np
import ray
import torch

from meshfeed import DataLoader, DataMesh
from meshfeed.services.ray import RayService, RemoteBatch


class TokenDataset:
    """Synthetic token sequences, "preprocessed" once in ``__init__`` (inside the loader actor)."""

    def __init__(self, num_samples: int, seq_len: int) -> None:
        rng = np.random.default_rng(1234)
        self.tokens = rng.integers(0, 50_000, size=(num_samples, seq_len), dtype=np.int64)
        self.built_in = os.getpid()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.from_numpy(self.tokens[i]), "index": torch.tensor(i)}


def checksum(batch: dict[str, torch.Tensor]) -> int:
    return zlib.crc32(batch["input_ids"].numpy().tobytes())


class Trainer:
    """One global rank of the training job."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def train_step(self, remote_batch: RemoteBatch) -> dict[str, int]:
        batch = ray.get(remote_batch.for_rank(self.rank))  # only this rank's slice moves here
        return {
            "rank": self.rank,
            "step": remote_batch.step,
            "rows": int(batch["input_ids"].shape[0]),
            "bytes": sum(v.numel() * v.element_size() for v in batch.values()),
            "crc": checksum(batch),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="global batches to run (>= 2)")
    args = parser.parse_args()
    if args.steps < 2:
        # The demo resumes from a checkpoint at the step after it, which the trainers must
        # have run: checkpoint after step (steps - 1) // 2, check step (steps - 1) // 2 + 1.
        parser.error(
            f"--steps must be >= 2 (got {args.steps}): the demo resumes from a checkpoint "
            "taken half-way and compares the next step with the one the trainers ran"
        )
    halfway = (args.steps - 1) // 2
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)

    mesh = DataMesh.from_sizes(dp=2, tp=2)
    make_dataset = functools.partial(TokenDataset, num_samples=256, seq_len=512)
    service = RayService(num_actors=2, actor_options={"max_restarts": 1}, prefetch=2)
    loader = DataLoader(make_dataset, batch_size=4, mesh=mesh, seed=0, service=service)
    trainer_cls = ray.remote(Trainer).options(num_cpus=0)
    trainers: list[Any] = [trainer_cls.remote(rank) for rank in range(mesh.world_size)]

    print(f"{'step':>4} {'rank':>4} {'data rank':>9} {'rows':>4} {'bytes':>7} {'crc32':>10}")
    results: list[dict[str, int]] = []
    checkpoint = None
    for k, remote_batch in enumerate(loader):
        if k == args.steps:
            break
        if k == halfway:
            checkpoint = loader.state_dict()  # the position of the last batch handed out
        for r in ray.get([t.train_step.remote(remote_batch) for t in trainers]):
            results.append(r)
            print(
                f"{r['step']:>4} {r['rank']:>4} {mesh.data_rank(r['rank']):>9} {r['rows']:>4} "
                f"{r['bytes']:>7} {r['crc']:>10}"
            )
    loader.shutdown()

    # Every trainer saw exactly what the in-process DataLoader gives its rank.
    for rank in range(mesh.world_size):
        local = DataLoader(make_dataset(), batch_size=4, mesh=mesh, rank=rank, seed=0)
        want = [checksum(b) for _, b in zip(range(args.steps), local, strict=False)]
        assert [r["crc"] for r in results if r["rank"] == rank] == want, f"rank {rank} differs"
    print("every rank's slice equals the in-process DataLoader's batch for that rank")

    # A checkpoint taken in the driver resumes a fresh Ray loader exactly.
    assert checkpoint is not None
    resumed_service = RayService(num_actors=1)
    resumed = DataLoader(make_dataset, batch_size=4, mesh=mesh, seed=0, service=resumed_service)
    resumed.load_state_dict(checkpoint)
    first = next(iter(resumed))
    got = ray.get(trainers[3].train_step.remote(first))
    want_crc = next(r["crc"] for r in results if r["rank"] == 3 and r["step"] == first.step)
    assert got["crc"] == want_crc
    print(
        f"a fresh Ray loader resumed from the checkpoint taken after step {halfway} "
        f"continues at step {first.step}: rank 3 gets the same batch"
    )
    resumed.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
