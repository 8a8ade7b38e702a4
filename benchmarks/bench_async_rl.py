"""Asynchronous RL on the sample store: samples/s trained and staleness, against the synchronous loop.

A trainer (this thread) takes ``--steps`` steps of ``--batch`` samples; each step costs
``--train`` seconds. Two producer threads generate rollouts with the weights of the version
they last read; a round of ``--batch`` samples costs ``--train * speed`` seconds of generation
(``speed`` 2: producers 2x slower than the trainer, 0.5: 2x faster), spent in ``time.sleep`` as
a remote model server's latency would be. Both put into an embedded ``SampleStore`` with their
version; the trainer reads with ``version=step`` and ``max_staleness`` 0, 1, 2. The baseline
is the synchronous loop with nothing of ours in it: generate a round with the current weights,
then train on it. Reported: samples trained per second, its ratio to the synchronous loop of
the same speed (in the same run), the staleness histogram (trainer version minus sample
version over every trained sample), and the samples dropped as stale. Put+get against
TransferQueue: ``bench_queue.py`` (its TransferQueue rows).

Run:  PYTHONPATH=src python benchmarks/bench_async_rl.py [--quick]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from pathlib import Path

from meshfeed.queue import SampleStore, StaleVersion

RESULTS = Path(__file__).resolve().parent / "results" / "async_rl.txt"


def synchronous(steps: int, batch: int, train: float, gen: float) -> float:
    """Samples/s of generate-then-train: the loop without a store."""
    start = time.perf_counter()
    for _ in range(steps):
        time.sleep(gen)  # a round with the current weights
        time.sleep(train)
    return steps * batch / (time.perf_counter() - start)


def asynchronous(
    steps: int, batch: int, train: float, gen: float, staleness: int
) -> tuple[float, Counter[int], int]:
    """Samples/s, staleness histogram and stale drops of the store-based loop."""
    store = SampleStore()
    version = [0]  # the weights producers read (published by the trainer)
    stop = threading.Event()
    per_put = max(1, batch // 4)  # 2 producers, each a quarter of a round at a time

    def produce(me: int) -> None:
        k = me
        while not stop.is_set():
            mine = version[0]
            time.sleep(gen * per_put / batch * 2)  # two producers share a round's work
            try:
                store.put("p", {"x": list(range(k, k + per_put))}, version=mine, timeout=0.5)
            except (StaleVersion, TimeoutError):
                continue
            except ValueError:  # closed: the run is over
                return
            k += 2 * per_put

    producers = [threading.Thread(target=produce, args=(i,)) for i in range(2)]
    for t in producers:
        t.start()
    lags: Counter[int] = Counter()
    try:
        got = store.get("t", ["x"], batch, "p", version=0, max_staleness=staleness, timeout=60)
        start = time.perf_counter()
        for step in range(steps):
            if step:
                got = store.get(
                    "t", ["x"], batch, "p", version=step, max_staleness=staleness, timeout=60
                )
            lags.update(step - v for v in got.versions)  # type: ignore[union-attr]
            time.sleep(train)
            version[0] = step + 1
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        store.close("p")
        for t in producers:
            t.join(10)
    return steps * batch / elapsed, lags, store.stats()["stale"].get("t", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small, fast version")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run")
    parser.add_argument("--batch", type=int, default=16, help="samples per training step")
    parser.add_argument("--train", type=float, default=None, help="seconds per step")
    args = parser.parse_args()
    steps = args.steps or (8 if args.quick else 30)
    train = args.train or (0.02 if args.quick else 0.05)
    if steps < 1 or args.batch < 4 or train <= 0:
        raise ValueError(
            f"need --steps >= 1, --batch >= 4 and --train > 0 (got {steps=}, "
            f"batch={args.batch}, {train=})"
        )
    lines = [
        f"{'producers':>18} {'max_staleness':>13} {'samples/s':>10} {'vs sync':>8} "
        f"{'stale dropped':>13}  staleness histogram"
    ]
    for speed, label in ((2.0, "2x slower"), (1.0, "as fast"), (0.5, "2x faster")):
        gen = train * speed
        base = synchronous(steps, args.batch, train, gen)
        lines.append(f"{label:>18} {'sync loop':>13} {base:>10.1f} {1.0:>8.2f} {0:>13}  {{0: all}}")
        for staleness in (0, 1, 2):
            rate, lags, stale = asynchronous(steps, args.batch, train, gen, staleness)
            hist = dict(sorted(lags.items()))
            lines.append(
                f"{label:>18} {staleness:>13} {rate:>10.1f} {rate / base:>8.2f} {stale:>13}  {hist}"
            )
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        RESULTS.write_text(
            f"# PYTHONPATH=src python benchmarks/bench_async_rl.py (steps={steps}, "
            f"batch={args.batch}, train={train}s)\n{text}\n"
        )


if __name__ == "__main__":
    main()
