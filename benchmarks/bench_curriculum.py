"""Curriculum benchmark: analyzer throughput, and difficulty changes vs DeepSpeed-style set algebra.

1. Analyzer: ``seqlen`` + ``vocab_rarity`` (two passes) over a synthetic corpus of 10**6
   documents (``--quick``: 10**5), samples/s with 1 vs 2 worker processes.
2. Difficulty changes with two metrics (an int length by value, a float rarity by percentile)
   at 10**7 samples (``--quick``: 10**6): meshfeed's entry-step order (built once, then one
   ``searchsorted`` per change) against a baseline written here that does what DeepSpeed's
   ``DeepSpeedDataSampler`` does per change: the eligible index set per metric, ``intersect1d``
   across metrics and ``setdiff1d`` against the samples already clustered. Time per change and
   peak extra memory (tracemalloc, which sees numpy allocations).
3. Per-batch cost of ``GatedOrder.indices`` for a 1024-sample global batch at growing N.

    PYTHONPATH=src python benchmarks/bench_curriculum.py [--quick]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from meshfeed.curriculum import (
    Curriculum,
    CurriculumMetric,
    MetricIndex,
    analyze,
    fixed_linear,
    fixed_root,
    seqlen,
    vocab_rarity,
)

VOCAB = 32_000
STEPS = 1_000  # total_curriculum_step of both schedules
BATCH = 1024


class SyntheticCorpus:
    """``n`` documents of 8..120 Zipf-ish token ids, stored flat (fork shares it with workers)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        lengths = rng.integers(8, 121, size=n)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        ranks = rng.zipf(1.2, size=int(self.offsets[-1]))
        self.tokens = np.minimum(ranks - 1, VOCAB - 1).astype(np.uint16)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def bench_analyzer(n: int) -> list[tuple[str, float, float]]:
    corpus = SyntheticCorpus(n)
    metrics = [seqlen(), vocab_rarity(VOCAB)]
    rows, outputs = [], []
    for workers in (1, 2):
        t0 = time.perf_counter()
        out = analyze(corpus, metrics, num_workers=workers, chunk_size=8192, progress=False)
        dt = time.perf_counter() - t0
        outputs.append(out)
        rows.append((f"{workers} worker(s)", dt, n / dt))
    a, b = outputs
    assert isinstance(a["vocab_rarity"], MetricIndex) and isinstance(b["vocab_rarity"], MetricIndex)
    assert a["vocab_rarity"].values.tobytes() == b["vocab_rarity"].values.tobytes()
    return rows


def _indexes(n: int) -> tuple[MetricIndex, MetricIndex]:
    rng = np.random.default_rng(1)
    fp = {"length": n, "hash": "synthetic"}
    lengths = MetricIndex.from_values("seqlen", rng.integers(8, 1025, size=n), fingerprint=fp)
    rarity = MetricIndex.from_values("rarity", rng.gamma(2.0, 50.0, size=n), fingerprint=fp)
    return lengths, rarity


def _curriculum(lengths: MetricIndex, rarity: MetricIndex) -> Curriculum:
    return Curriculum(
        [
            CurriculumMetric(index=lengths, schedule=fixed_linear(64, 1024, STEPS, 8)),
            CurriculumMetric(
                index=rarity,
                schedule=fixed_root(10, 100, STEPS, 1, 2),
                difficulty_type="percentile",
            ),
        ]
    )


class DeepSpeedStyleBaseline:
    """What DeepSpeedDataSampler does when a difficulty changes, without its file I/O.

    Per change: the eligible sample ids of each metric (value: ``values <= d``; percentile:
    the first ``p%`` of the sorted order, sorted by id), ``np.intersect1d`` across metrics and
    ``np.setdiff1d`` against the ids already in earlier clusters, giving the new cluster.
    """

    def __init__(self, lengths: MetricIndex, rarity: MetricIndex, cur: Curriculum) -> None:
        self.lengths, self.rarity, self.cur = lengths, rarity, cur
        self.clustered = np.empty(0, dtype=np.int64)

    def change(self, step: int) -> int:
        d = self.cur.difficulties(step)
        by_value = np.flatnonzero(np.asarray(self.lengths.values) <= d["seqlen"])
        count = int(self.rarity.percentile_count(d["rarity"]))
        by_percentile = np.sort(np.asarray(self.rarity.order[:count]))
        pool = np.intersect1d(by_value, by_percentile, assume_unique=True)
        new_cluster = np.setdiff1d(pool, self.clustered, assume_unique=True)
        self.clustered = pool
        return len(new_cluster)


def _measure(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Seconds and peak traced MiB of one call."""
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return dt, peak / 2**20, out


def _change_steps(cur: Curriculum, count: int) -> list[int]:
    """``count`` steps at which some difficulty changes, spread over the schedule."""
    steps = np.arange(1, STEPS + 1)
    table = np.stack([m.schedule.difficulties(steps) for m in cur.metrics])
    prev = np.stack([m.schedule.difficulties(steps - 1) for m in cur.metrics])
    changes = steps[(table != prev).any(axis=0)]
    pick = np.linspace(0, len(changes) - 1, count).astype(int)
    return [int(changes[i]) for i in pick]


def bench_changes(n: int, num_changes: int) -> dict[str, float]:
    lengths, rarity = _indexes(n)
    cur = _curriculum(lengths, rarity)
    build_s, build_mib, order = _measure(
        lambda: cur.make_order(dataset_length=n, global_batch_size=BATCH, seed=0)
    )
    steps = _change_steps(cur, num_changes)
    ours = []
    for s in steps:
        ours.append(_measure(lambda s=s: order.pool_size(s))[:2])
    base = DeepSpeedStyleBaseline(lengths, rarity, cur)
    theirs = []
    for s in steps:
        theirs.append(_measure(lambda s=s: base.change(s))[:2])
        # Same pool both ways: the baseline's pool size equals meshfeed's prefix length.
        assert len(base.clustered) == order.pool_size(s)
    resident = (order.pool_order.nbytes + order.entry_steps.nbytes) / 2**20
    return {
        "build_s": build_s,
        "build_peak_mib": build_mib,
        "resident_mib": resident,
        "ours_change_s": float(np.median([t for t, _ in ours])),
        "ours_change_mib": max(m for _, m in ours),
        "base_change_s": float(np.median([t for t, _ in theirs])),
        "base_change_mib": max(m for _, m in theirs),
        "segments": order.num_segments,
        "changes": len(steps),
    }


def bench_single_metric(n: int, num_changes: int) -> tuple[float, float, float]:
    """One value metric: meshfeed's searchsorted vs DeepSpeed's per-change ``setdiff1d``."""
    lengths, _ = _indexes(n)
    cur = Curriculum([CurriculumMetric(index=lengths, schedule=fixed_linear(64, 1024, STEPS, 8))])
    build_s, _, order = _measure(
        lambda: cur.make_order(dataset_length=n, global_batch_size=BATCH, seed=0)
    )
    steps = _change_steps(cur, num_changes)
    ours = [_measure(lambda s=s: order.pool_size(s))[0] for s in steps]
    clustered = np.empty(0, dtype=np.int64)
    theirs = []
    for s in steps:
        t0 = time.perf_counter()
        pool = np.flatnonzero(np.asarray(lengths.values) <= cur.difficulties(s)["seqlen"])
        np.setdiff1d(pool, clustered, assume_unique=True)
        clustered = pool
        theirs.append(time.perf_counter() - t0)
        assert len(pool) == order.pool_size(s)
    return float(np.median(ours)), float(np.median(theirs)), build_s


def bench_batches(sizes: list[int]) -> list[tuple[int, float]]:
    rows = []
    for n in sizes:
        lengths, rarity = _indexes(n)
        order = _curriculum(lengths, rarity).make_order(
            dataset_length=n, global_batch_size=BATCH, seed=0
        )
        per_epoch = order.samples_per_epoch
        starts = [s * BATCH for s in range(0, 2 * STEPS, 37)]
        t0 = time.perf_counter()
        for g in starts:
            epoch, pos = divmod(g, per_epoch)
            order.indices(epoch, pos + np.arange(BATCH))
        rows.append((n, (time.perf_counter() - t0) / len(starts)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10x smaller corpora")
    args = parser.parse_args()
    docs = 10**5 if args.quick else 10**6
    big = 10**6 if args.quick else 10**7

    print(f"## analyzer: seqlen + vocab_rarity (2 passes), {docs:,} documents, vocab {VOCAB}")
    rows = bench_analyzer(docs)
    print(f"{'workers':<14} {'seconds':>9} {'samples/s':>12}")
    for name, dt, rate in rows:
        print(f"{name:<14} {dt:>9.2f} {rate:>12,.0f}")
    print(f"speed-up 2 vs 1 worker: {rows[1][2] / rows[0][2]:.2f}x (identical output checked)\n")

    print(f"## difficulty change, 2 metrics (value + percentile), N = {big:,}")
    r = bench_changes(big, num_changes=8 if args.quick else 5)
    print(f"{'':<34} {'meshfeed':>14} {'DeepSpeed-style':>16}")
    print(
        f"{'time per change (median)':<34} {r['ours_change_s'] * 1e6:>11.1f} us "
        f"{r['base_change_s'] * 1e3:>13.1f} ms"
    )
    print(
        f"{'peak extra memory per change':<34} {r['ours_change_mib']:>10.3f} MiB "
        f"{r['base_change_mib']:>12.1f} MiB"
    )
    print(
        f"{'one-time build':<34} {r['build_s']:>12.2f} s {'-':>16}\n"
        f"{'build peak memory':<34} {r['build_peak_mib']:>10.1f} MiB {'-':>16}\n"
        f"{'resident order arrays':<34} {r['resident_mib']:>10.1f} MiB {'-':>16}"
    )
    ratio = r["base_change_s"] / max(r["ours_change_s"], 1e-12)
    breakeven = r["build_s"] / max(r["base_change_s"], 1e-12)
    print(
        f"per-change speed-up: {ratio:,.0f}x; the build costs as much as {breakeven:.1f} "
        f"baseline changes ({r['changes']} changes measured, {r['segments']} order segments)\n"
    )

    ours1, base1, build1 = bench_single_metric(big, num_changes=5)
    print(f"## difficulty change, 1 metric (value), N = {big:,}")
    print(
        f"meshfeed {ours1 * 1e6:.1f} us (build {build1:.2f} s, no sort: the index is sorted) vs "
        f"DeepSpeed-style {base1 * 1e3:.1f} ms per change: {base1 / max(ours1, 1e-12):,.0f}x\n"
    )

    sizes = [10**5, 10**6] if args.quick else [10**5, 10**6, 10**7]
    print(f"## per-batch cost of GatedOrder.indices, global batch {BATCH}")
    print(f"{'N':>12} {'us / batch':>12}")
    batch_rows = bench_batches(sizes)
    for n, dt in batch_rows:
        print(f"{n:>12,} {dt * 1e6:>12.1f}")
    print(f"largest / smallest N time ratio: {batch_rows[-1][1] / batch_rows[0][1]:.2f}")


if __name__ == "__main__":
    main()
