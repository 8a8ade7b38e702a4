"""Ray mode: driver memory and bytes moved per step, one reference per data rank vs the baseline.

Three ways to feed ``D`` consumer actors (one per data rank) the same data:

* ``meshfeed RayService``: the dataset is built in a loader actor; each global batch is one
  ``ObjectRef`` per data rank and each consumer resolves only ``for_rank(rank)``.
* ``baseline: full global batch``: the same loader actor, but a global batch is one reference
  (data-parallel size forced to 1, as in Twinkle's Ray mode) and every consumer resolves the whole
  global batch and slices its part.
* ``in-process in the driver``: the driver builds the dataset and every batch (no consumers);
  shown for driver memory only.

Bytes moved are the sizes of the objects each consumer resolves (tensor ``nbytes``); driver
memory is the growth of the driver's RSS (max over the run) and the ``tracemalloc`` peak. The
consumers' slices are checked to be identical in both Ray layouts.

Run:  PYTHONPATH=src python benchmarks/bench_ray.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import tracemalloc
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from meshfeed import DataLoader, DataMesh
from meshfeed.services.ray import RayService, RemoteBatch


class Tokens:
    """Synthetic token rows, built ("preprocessed") in ``__init__``."""

    def __init__(self, num_samples: int, seq_len: int) -> None:
        rng = np.random.default_rng(0)
        self.tokens = rng.integers(0, 50_000, size=(num_samples, seq_len), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[i])


class Consumer:
    """One data rank's trainer: resolves what it is given and reports the bytes it pulled."""

    def __init__(self, rank: int, batch_size: int) -> None:
        self.rank, self.batch_size = rank, batch_size

    def own_slice(self, remote_batch: RemoteBatch) -> tuple[int, int]:
        batch = ray.get(remote_batch.for_rank(self.rank))
        return batch.numel() * batch.element_size(), _crc(batch)

    def full_then_slice(self, remote_batch: RemoteBatch) -> tuple[int, int]:
        full = ray.get(remote_batch.for_data_rank(0))
        mine = full[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return full.numel() * full.element_size(), _crc(mine)


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().numpy().tobytes())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(slots=True)
class Result:
    name: str
    rss_mb: float
    traced_mb: float
    per_consumer_mb: float
    per_step_mb: float
    ms_per_step: float
    crcs: list[list[int]]


def run_ray(
    name: str, create: Any, consumers: list[Any], *, d: int, b: int, steps: int, full: bool
) -> Result:
    mesh = DataMesh.from_sizes(dp=1 if full else d)
    service = RayService(num_actors=1, prefetch=2)
    rss0 = _rss()
    tracemalloc.start()
    loader = DataLoader(create, batch_size=b * d if full else b, mesh=mesh, seed=0, service=service)
    rss_max, moved, crcs = rss0, 0, []
    it = iter(loader)
    first = next(it)  # warm-up: actor configuration and first batch are not timed
    ray.get([(c.full_then_slice if full else c.own_slice).remote(first) for c in consumers])
    start = time.perf_counter()
    for _ in range(steps):
        rb = next(it)
        out = ray.get([(c.full_then_slice if full else c.own_slice).remote(rb) for c in consumers])
        moved += sum(n for n, _ in out)
        crcs.append([crc for _, crc in out])
        rss_max = max(rss_max, _rss())
    elapsed = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    loader.shutdown()
    return Result(
        name,
        (rss_max - rss0) / 2**20,
        traced / 2**20,
        moved / steps / d / 2**20,
        moved / steps / 2**20,
        1000 * elapsed / steps,
        crcs,
    )


def run_in_process(create: Any, *, d: int, b: int, steps: int) -> Result:
    rss0 = _rss()
    tracemalloc.start()
    loader = DataLoader(create(), batch_size=b * d, mesh={"dp": 1}, seed=0)
    rss_max = rss0
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
        rss_max = max(rss_max, _rss())
    elapsed = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return Result(
        "in-process in the driver",
        (rss_max - rss0) / 2**20,
        traced / 2**20,
        float("nan"),
        float("nan"),
        1000 * elapsed / steps,
        [],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small, fast version")
    parser.add_argument("--consumers", type=int, default=4, help="data ranks / consumer actors")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per data rank")
    args = parser.parse_args()
    d, b = args.consumers, args.batch_size
    if d < 1 or b < 1:
        raise ValueError(f"--consumers and --batch-size must be >= 1 (got {d=}, {b=})")
    num_samples, seq_len, steps = (1024, 2048, 8) if args.quick else (4096, 4096, 40)
    num_samples = max(num_samples, (steps + 1) * d * b)  # warm-up + timed steps in one epoch
    create = functools.partial(Tokens, num_samples=num_samples, seq_len=seq_len)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    consumer_cls = ray.remote(Consumer).options(num_cpus=0)
    consumers: list[Any] = [consumer_cls.remote(rank, b) for rank in range(d)]
    ray.get([c.__ray_ready__.remote() for c in consumers])

    sample_kb = seq_len * 8 / 1024
    print(
        f"{d} consumers, {b} samples of {sample_kb:.0f} KiB per data rank "
        f"(global batch {d * b * sample_kb / 1024:.1f} MiB), dataset "
        f"{num_samples * seq_len * 8 / 2**20:.0f} MiB, {steps} timed steps"
    )
    for full in (False, True):  # warm both layouts (worker imports, Ray's first transfers)
        run_ray("warm-up", create, consumers, d=d, b=b, steps=2, full=full)
    ours = run_ray("meshfeed RayService", create, consumers, d=d, b=b, steps=steps, full=False)
    base = run_ray(
        "baseline: full global batch", create, consumers, d=d, b=b, steps=steps, full=True
    )
    local = run_in_process(create, d=d, b=b, steps=steps)
    assert ours.crcs == base.crcs, "the two Ray layouts delivered different slices"

    header = (
        f"{'layout':<30} {'driver RSS +MiB':>15} {'tracemalloc MiB':>15} "
        f"{'MiB/consumer/step':>17} {'MiB moved/step':>14} {'ms/step':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in (ours, base, local):
        print(
            f"{r.name:<30} {r.rss_mb:>15.1f} {r.traced_mb:>15.2f} {r.per_consumer_mb:>17.2f} "
            f"{r.per_step_mb:>14.2f} {r.ms_per_step:>8.1f}"
        )
    print(
        f"\nbytes moved per step, baseline / meshfeed: {base.per_step_mb / ours.per_step_mb:.2f}x"
        f"  (expected {d}x: every consumer pulls the whole global batch)"
    )
    print(f"step time, baseline / meshfeed: {base.ms_per_step / ours.ms_per_step:.2f}x")
    print("slices identical in both Ray layouts: yes")
    ray.shutdown()


if __name__ == "__main__":
    main()
