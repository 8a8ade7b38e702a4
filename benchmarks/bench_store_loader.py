"""StoreLoader throughput over an embedded store: batches per second, first batch apart.

The store is filled before the loader starts (the loader's own cost, not the producers'),
then ``StoreLoader`` reads every batch, collating with a small function (the ids as a tensor)
in each configuration: fetched in the loop (``prefetch=1``), one batch ahead on a thread
(``prefetch=2``), and 2 worker processes (``num_workers=2``; they fetch through the loader's
process). The ``tensor`` rows read a tensor column instead (32 rows of 2,048 int64, 512 KiB
per batch, the default collation): a batch the store keeps for a retry is the reader's own
copy. Every configuration runs in every round, in turns; the median of the rounds is
reported. Runs unchanged on older revisions, so ``scripts/compare_revisions.sh`` can compare.

    python benchmarks/bench_store_loader.py            # 4,000 batches of 32, 5 rounds
    python benchmarks/bench_store_loader.py --quick    # 600 batches, 2 rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from meshfeed.queue import SampleStore, StoreLoader

CONFIGS: dict[str, dict[str, Any]] = {
    "prefetch=1": {"prefetch": 1},
    "prefetch=2": {"prefetch": 2},
    "num_workers=2": {"num_workers": 2, "prefetch": 2},
    "tensor prefetch=1": {"prefetch": 1, "width": 2048},
    "tensor prefetch=2": {"prefetch": 2, "width": 2048},
}


def ids(batch: Any) -> torch.Tensor:
    return torch.as_tensor(batch.ids)


def run(batches: int, batch_size: int, config: dict[str, Any]) -> tuple[float, float]:
    """(batches per second after the first, seconds to the first batch)."""
    config = dict(config)
    width = config.pop("width", None)
    store = SampleStore()
    n = batches * batch_size
    column: Any = list(range(n))
    if width is not None:
        column = torch.arange(n * width, dtype=torch.int64).reshape(n, width)
    store.put("p", {"x": column})
    store.close("p")
    start = time.perf_counter()
    collate = {} if width is not None else {"collate_fn": ids}
    with StoreLoader(
        store, task="t", fields=["x"], partition="p", batch_size=batch_size, mesh={"dp": 1},
        rank=0, **collate, **config,
    ) as loader:  # fmt: skip
        it = iter(loader)
        next(it)
        first = time.perf_counter()
        count = sum(1 for _ in it)
        end = time.perf_counter()
    if count != batches - 1:
        raise RuntimeError(f"read {count + 1} batches, expected {batches}")
    return count / (end - first), first - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 batches, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    batches = 600 if args.quick else 4000
    rounds = args.rounds or (2 if args.quick else 5)
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    firsts: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(rounds):
        for name, config in CONFIGS.items():
            rate, first = run(batches, 32, config)
            rates[name].append(rate)
            firsts[name].append(first)
    print(f"StoreLoader, embedded store, {batches:,} batches of 32, median of {rounds} rounds")
    for name in CONFIGS:
        rate, first = statistics.median(rates[name]), statistics.median(firsts[name])
        print(f"{name:18s} {rate:9,.0f} batches/s   first batch {first * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
