"""The training loop's wait per 512 KiB batch with ``pin_memory=True`` (and ``device="cuda"``)
when the data is ready: what pinning costs the loop's thread (CUDA only).

    PYTHONPATH=src:. python benchmarks/bench_pinned_wait.py [--quick]

A step of 4 ms (a sleep: the GIL is free, as in a GPU step's kernel launches and syncs) is
longer than making a batch, so every wait is the loader's own cost on the loop's thread.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from meshfeed import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    cfg = parser.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA on this machine (pinning needs it)")
        return
    data = np.zeros((8192, 2048), dtype=np.int64)  # 16 KiB samples: 512 KiB batches of 32
    steps = 60 if cfg.quick else 240
    print("| workers | device | batches pinned | wait per batch p50 / p99 us |")
    print("|---|---|---|---|")
    for workers in (0, 2, 8):
        for device in (None, "cuda"):
            loader = DataLoader(
                data, batch_size=32, num_workers=workers, pin_memory=True, device=device,
                warn_wait_share=None,
            )  # fmt: skip
            it = iter(loader)
            waits, pinned = [], 0
            for _ in range(steps):
                asked = time.perf_counter()
                batch = next(it)
                waits.append(time.perf_counter() - asked)
                pinned += batch.is_cuda or batch.is_pinned()
                time.sleep(0.004)
            loader.shutdown()
            waits = sorted(waits[20:])
            p50, p99 = waits[len(waits) // 2] * 1e6, waits[int(len(waits) * 0.99)] * 1e6
            print(f"| {workers} | {device} | {pinned}/{steps} | {p50:,.0f} / {p99:,.0f} |")


if __name__ == "__main__":
    main()
