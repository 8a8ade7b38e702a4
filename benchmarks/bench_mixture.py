"""Mixture interleave cost per 1024-position global batch, and the cost of resuming far ahead.

Weights of five sources whose best rounding tree cannot prove +-1 use Tijdeman's sequential
earliest-deadline interleave (:mod:`meshfeed.order.interleave`); this measures what that costs
against the alternatives in the same run:

- ``period``: simple-fraction weights (one table, O(1) per position);
- ``tree``: five float weights the rounding tree proves (pure arithmetic, O(K) per position);
- ``deadline``: five float weights that need the earliest-deadline walk (sequential);
- ``greedy``: Megatron-style greedy blending in plain Python (at each position the source
  furthest below its share; the rule Megatron's C++ helper runs), the per-position alternative.

Each row draws consecutive 1024-position batches (as a loader does) and reports microseconds
per batch (median of the rounds; range = fastest..slowest round) and the ratio to ``tree``.
Then the resume rows: ``MixtureOrder.validate`` of a checkpoint at stream position ``P`` and
the next batch, on a fresh mixture (O(1) in ``P``: the carried counts seed the walk), against
walking from position 0 to ``P`` (what a checkpoint without counts would cost).

    PYTHONPATH=src python benchmarks/bench_mixture.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from fractions import Fraction

import numpy as np

from meshfeed.sources.mixture import Mixture

BATCH = 1024
WEIGHTS = {
    "period": [0.3, 0.2, 0.1, 0.25, 0.15],
    "tree": [1 / 3.1, 1 / 7.3, 0.5, 0.011, 0.2345678],
    "deadline": [12.190981666243244, 72.69509302318598, 1.300300876779305, 51.6338960582451,
                 0.0136384434451],
}  # fmt: skip


def _mixture(weights: list[float]) -> Mixture:
    names = [f"s{i}" for i in range(len(weights))]
    return Mixture({n: [0] for n in names}, dict(zip(names, weights, strict=True)))


def _greedy(weights: list[float]) -> Callable[[int], np.ndarray]:
    shares = [w / sum(weights) for w in weights]
    counts = [0] * len(shares)
    done = [0]

    def batch(size: int) -> np.ndarray:
        out = np.empty(size, dtype=np.int64)
        for j in range(size):
            n = done[0] + j + 1
            best = max(range(len(shares)), key=lambda i: shares[i] * n - counts[i])
            counts[best] += 1
            out[j] = best
        done[0] += size
        return out

    return batch


def _consecutive(mix: Mixture) -> Callable[[int], object]:
    def draw(b: int) -> object:
        return mix.draws(np.arange(b * BATCH, (b + 1) * BATCH))

    return draw


def _per_batch(draw: Callable[[int], object], batches: int) -> float:
    t0 = time.perf_counter()
    for b in range(batches):
        draw(b)
    return (time.perf_counter() - t0) / batches * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches and rounds (smoke run)")
    args = ap.parse_args()
    batches, rounds = (20, 3) if args.quick else (200, 5)
    far = 1_000_000 if args.quick else 4_000_000

    print(f"per {BATCH}-position global batch, {batches} consecutive batches, {rounds} rounds")
    rows: dict[str, list[float]] = {k: [] for k in (*WEIGHTS, "greedy")}
    for _ in range(rounds):  # interleaved rounds: machine noise hits every row alike
        for kind, w in WEIGHTS.items():
            mix = _mixture(w)
            assert mix._segments[0].kind == kind, (kind, mix._segments[0].kind)
            rows[kind].append(_per_batch(_consecutive(mix), batches))
        greedy = _greedy(WEIGHTS["deadline"])
        rows["greedy"].append(_per_batch(lambda b: greedy(BATCH), batches))  # noqa: B023
    base = statistics.median(rows["tree"])
    for kind, ts in rows.items():
        med = statistics.median(ts)
        print(
            f"  {kind:9s} {med:10.0f} us/batch  ({min(ts):.0f}..{max(ts):.0f})"
            f"  x{med / base:7.1f} vs tree"
        )

    # Resume far ahead: carried counts (validate + next batch) vs a walk from 0.
    mix = _mixture(WEIGHTS["deadline"])
    order = mix.make_order(dataset_length=len(mix), global_batch_size=BATCH, seed=0)
    t0 = time.perf_counter()
    described = order.describe(0, far)  # the writer walked here while serving the batches
    walk = time.perf_counter() - t0
    fresh = _mixture(WEIGHTS["deadline"])
    fresh_order = fresh.make_order(dataset_length=len(fresh), global_batch_size=BATCH, seed=0)
    t0 = time.perf_counter()
    fresh_order.validate(described)
    src, _ = fresh.draws(np.arange(far, far + BATCH))
    seeded = time.perf_counter() - t0
    expect, _ = mix.draws(np.arange(far, far + BATCH))
    assert np.array_equal(src, expect)
    exact = [Fraction(w) for w in WEIGHTS["deadline"]]
    dev = max(
        abs(c - far * e / sum(exact))
        for c, e in zip(described["consumed"].values(), exact, strict=True)
    )
    print(
        f"resume at stream position {far:,}: validate + next batch {seeded * 1e3:.1f} ms, "
        f"walk from 0 {walk * 1e3:.0f} ms (x{walk / seeded:.0f}); "
        f"max |count - n*share| there {float(dev):.3f}"
    )


if __name__ == "__main__":
    main()
