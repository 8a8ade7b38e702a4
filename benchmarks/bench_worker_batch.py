"""A worker's cost per batch of cheap samples: what the worker path costs beyond the dataset.

    PYTHONPATH=src python benchmarks/bench_worker_batch.py [--quick]

One worker, samples that cost nothing (rows of an in-memory int64 array, 16 KiB each), the
default collation, batches of 128 KiB, 512 KiB and 4 MiB: batches/s with 1 worker (the
worker is the limit), the main process's CPU per batch, and the same batches made in-process
for reference. Run it on two trees to compare revisions
(``bash scripts/compare_revisions.sh OLD NEW 3 OUT 'python benchmarks/bench_worker_batch.py'``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from meshfeed import DataLoader

ROW = 2048  # int64 tokens per sample: 16 KiB
SIZES = {"128 KiB": 8, "512 KiB": 32, "4 MiB": 256}
BATCHES = {8: 4000, 32: 1500, 256: 200}  # per window; --quick: a fifth


def forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def rate(data: np.ndarray, samples: int, workers: int, n: int, repeats: int) -> tuple[float, float]:
    """Median batches/s over ``repeats`` windows of ``n`` batches, and the main process's CPU
    seconds per batch over them."""
    loader = DataLoader(data, batch_size=samples, num_workers=workers, warn_wait_share=None)
    it = forever(loader)
    for _ in range(max(20, n // 5)):  # workers started, slots made, prefetch drained
        next(it)
    rates, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            next(it)
        rates.append(n / (time.perf_counter() - t0))
        cpu.append((time.process_time() - c0) / n)
    it.close()
    loader.shutdown()
    return statistics.median(rates), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    cfg = parser.parse_args()
    data = np.ones((40_000, ROW), dtype=np.int64)  # touched: no page of it is faulted in later
    print("| batch | 1 worker batches/s | its main-process CPU us/batch | in-process batches/s |")
    print("|---|---|---|---|")
    for label, samples in SIZES.items():
        n = BATCHES[samples] // (5 if cfg.quick else 1)
        repeats = 1 if cfg.quick else 3
        one, cpu = rate(data, samples, 1, n, repeats)
        zero, _ = rate(data, samples, 0, n, repeats)
        print(f"| {label} | {one:,.0f} | {cpu * 1e6:.1f} | {zero:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
