"""Curriculum benchmark: analyzer throughput, and meshfeed's gated order against DeepSpeed's own
``DeepSpeedDataSampler`` on the same inputs, in the same run.

1. Analyzer: ``seqlen`` + ``vocab_rarity`` (two passes) over a synthetic corpus of 10**6
   documents (``--quick``: 10**5), samples/s with 1 vs 2 worker processes.
2. Curriculum sampling, meshfeed vs DeepSpeed's ``DeepSpeedDataSampler`` (its code, not a model
   of it), on one DeepSpeed config that both read (meshfeed through ``from_deepspeed_config``):
   two integer metrics over ``--n`` samples (``seqlen`` 8..1024 by value, ``fixed_linear(64,
   1024, T, 8)``; ``rarity`` by percentile, ``fixed_root(10, 100, T, 1, 2)``), global batch
   1024, ``T + 50`` global batches; T = 1000 and N = 3 * 10**6 (the largest N with which the
   whole script stays under 5 minutes on a shared 2-core machine), ``--quick``: T = 200 and
   N = 10**5. Inputs, built
   before the clock and not compared: DeepSpeed reads its ``index_to_sample`` /
   ``index_to_metric`` files (one row per distinct value, written with DeepSpeed's mmap builder;
   the percentile metric reads the ``_percentile_merged`` file that DeepSpeed's
   ``DataAnalyzer.output_index_to_sample_percentile`` writes from them, as DeepSpeed's docs
   say), meshfeed two in-memory ``MetricIndex``es of the same values. Both run batch by batch
   in turns; measured for each:

   - setup: ``Curriculum.make_order`` / the sampler's constructor (it opens the index files;
     its first cluster is built at the first batch, reported next to it);
   - a difficulty change: the first batch at a step whose difficulty changed. DeepSpeed pays
     the change there (``get_next_global_batch`` calls ``get_new_cluster``: the eligible ids
     per metric, ``intersect1d``, ``setdiff1d`` against every earlier cluster, a shuffle and
     the cluster written to ``data_cluster_path``); meshfeed draws that batch with
     ``GatedOrder.indices`` as at any other step;
   - steady batches between changes;
   - bytes written (``wchar`` of ``/proc/self/io`` around each call; DeepSpeed writes every
     cluster, and rewrites a cluster each time it reshuffles one);
   - peak traced memory (tracemalloc: numpy and Python allocations; memory-mapped files and
     torch tensors are not seen) of setup and of each batch, in a second, untimed pass.

   Every batch of both is checked to hold only samples eligible at its step (computed here from
   the raw values), and at every change DeepSpeed's clusters add up to meshfeed's pool size.
3. Per-batch cost of ``GatedOrder.indices`` for a 1024-sample global batch at growing N
   (meshfeed alone).

    PYTHONPATH=src python benchmarks/bench_curriculum.py [--quick] [--n N]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import math
import os
import socket
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.curriculum import (
    Curriculum,
    MetricIndex,
    analyze,
    from_deepspeed_config,
    seqlen,
    vocab_rarity,
)
from meshfeed.curriculum.order import GatedOrder

VOCAB = 32_000
BATCH = 1024
TAIL = 50  # batches run after the schedules saturate (steady, full pool)


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


# ------------------------------------------------------------------ inputs and config
def _values(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample ``seqlen`` (8..1024) and ``rarity`` (integers: DeepSpeed's index files hold
    integer metrics) values."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(8, 1025, size=n)
    rarity = (rng.gamma(2.0, 50.0, size=n) * 10).astype(np.int64)
    return lengths, rarity


def _metrics_config(steps: int) -> dict[str, dict[str, Any]]:
    """The two curriculum metrics, as a DeepSpeed ``curriculum_metrics`` section."""
    return {
        "seqlen": {
            "difficulty_type": "value",
            "clustering_type": "schedule_based",
            "min_difficulty": 64,
            "max_difficulty": 1024,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": steps, "difficulty_step": 8},
        },
        "rarity": {
            "difficulty_type": "percentile",
            "clustering_type": "schedule_based",
            "min_difficulty": 10,
            "max_difficulty": 100,
            "schedule_type": "fixed_root",
            "schedule_config": {
                "total_curriculum_step": steps,
                "difficulty_step": 1,
                "root_degree": 2,
            },
        },
    }


def _config(metrics: dict[str, Any], clusters: Path | None, epochs: int) -> dict[str, Any]:
    return {
        "data_efficiency": {
            "enabled": True,
            "seed": 1234,
            "data_sampling": {
                "enabled": True,
                "num_epochs": epochs,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": str(clusters),
                    "curriculum_metrics": metrics,
                },
            },
        }
    }


def _curriculum(lengths: np.ndarray, rarity: np.ndarray, steps: int) -> Curriculum:
    """meshfeed's curriculum from the same DeepSpeed config (``first_step=1``, percentile pools
    of ``(N // 100) * p`` samples, as DeepSpeed's sampler)."""
    fp = {"length": len(lengths), "hash": "synthetic"}
    indexes = {
        "seqlen": MetricIndex.from_values("seqlen", lengths, fingerprint=fp),
        "rarity": MetricIndex.from_values("rarity", rarity, fingerprint=fp),
    }
    return from_deepspeed_config(_config(_metrics_config(steps), None, 1), indexes=indexes)


class Eligibility:
    """Which samples the schedules admit at given difficulties, from the raw values alone."""

    def __init__(self, lengths: np.ndarray, rarity: np.ndarray) -> None:
        self.lengths = lengths
        self.rank = np.empty(len(rarity), dtype=np.int64)  # rank by (value, id)
        self.rank[np.argsort(rarity, kind="stable")] = np.arange(len(rarity))

    def _count(self, percent: float) -> int:  # DeepSpeed's rule: (N // max) * p, all N at max
        n = len(self.rank)
        return n if percent >= 100 else (n // 100) * int(percent)

    def check(self, ids: np.ndarray, d: dict[str, Any], who: str, step: int) -> None:
        ok = (self.lengths[ids] <= d["seqlen"]) & (self.rank[ids] < self._count(d["rarity"]))
        assert ok.all(), f"{who}: {np.count_nonzero(~ok)} ineligible samples at step {step} ({d})"

    def pool(self, d: dict[str, Any]) -> int:
        return int(
            np.count_nonzero((self.lengths <= d["seqlen"]) & (self.rank < self._count(d["rarity"])))
        )


# ------------------------------------------------------------------ DeepSpeed
def _deepspeed_missing() -> str | None:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"{type(e).__name__}: {e}"
    return None


def _metric_files(folder: Path, values: np.ndarray, name: str, *, merged: bool) -> dict[str, str]:
    """DeepSpeed's index_to_sample / index_to_metric files, written with DeepSpeed's builder.

    As DeepSpeed's analyzer lays them out: one row per distinct value (ascending) holding its
    sample ids (ascending), the smallest integer dtypes that fit; ``merged`` also writes
    DeepSpeed's ``_percentile_merged`` file (with DeepSpeed's own function) and points
    ``index_to_sample_path`` at it, as DeepSpeed's docs say for a percentile metric.
    """
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
    from deepspeed.runtime.data_pipeline.data_sampling.utils import (
        close_mmap_dataset_builder,
        create_mmap_dataset_builder,
        find_fit_int_dtype,
    )

    n = len(values)
    order = np.argsort(values, kind="stable")
    distinct, counts = np.unique(values, return_counts=True)
    sample_dtype = find_fit_int_dtype(0, n - 1)
    metric_dtype = find_fit_int_dtype(int(distinct[0]), int(distinct[-1]))
    i2s, i2m = str(folder / f"{name}_index_to_sample"), str(folder / f"{name}_index_to_metric")
    builder = create_mmap_dataset_builder(i2s, sample_dtype)
    for ids in np.split(order, np.cumsum(counts)[:-1]):
        builder.add_item_numpy(ids)
    close_mmap_dataset_builder(builder, i2s)
    builder = create_mmap_dataset_builder(i2m, metric_dtype)
    for v in distinct:
        builder.add_item_numpy(np.array([v], dtype=metric_dtype))
    close_mmap_dataset_builder(builder, i2m)
    if merged:
        DataAnalyzer.output_index_to_sample_percentile(i2s, i2m, name, str(folder), n, sample_dtype)
        i2s = str(folder / f"{name}_index_to_sample_percentile_merged")
    return {"index_to_sample_path": i2s, "index_to_metric_path": i2m}


@contextlib.contextmanager
def _process_group() -> Iterator[Any]:
    """A one-process gloo group: DeepSpeed's sampler calls a barrier and a broadcast on it."""
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch.distributed as torch_dist
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)  # a line per cluster and reshuffle otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    env["LOCAL_RANK"] = "0"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    try:
        yield ds_comm.new_group([0])
    finally:
        torch_dist.destroy_process_group()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sampler(cfg: dict[str, Any], n: int, group: Any) -> Any:
    from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

    # micro batch = global batch (1 data rank, no accumulation): one yield per global batch
    return DeepSpeedDataSampler(cfg["data_efficiency"], n, BATCH, 0, 1, group, 1, 0)


class _Discard(io.TextIOBase):
    """A stdout that drops what is printed (no write syscall, no buffer growing in memory)."""

    def write(self, s: str) -> int:
        return len(s)


def _wchar() -> int:
    """Bytes this process has passed to write() so far (0 where /proc is missing)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return 0
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("wchar"))


def _folder_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


class Side:
    """One system's measurements over the run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.setup_s = 0.0
        self.first_s = 0.0
        self.change_s: list[float] = []
        self.steady_s: list[float] = []
        self.written = 0
        self.setup_mib = 0.0
        self.first_mib = 0.0
        self.change_mib = 0.0
        self.steady_mib = 0.0
        self.after_mib = 0.0

    def add(self, dt: float, b: int, changed: bool) -> None:
        if b == 0:
            self.first_s = dt
        elif changed:
            self.change_s.append(dt)
        else:
            self.steady_s.append(dt)

    @property
    def total_s(self) -> float:
        return self.setup_s + self.first_s + sum(self.change_s) + sum(self.steady_s)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    w0 = _wchar()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return out, dt, _wchar() - w0


def _batches(n: int, steps: int) -> tuple[int, int]:
    """Global batches run, and DeepSpeed's ``num_epochs`` so that its sampler does not stop."""
    num = steps + TAIL
    return num, math.ceil(num * BATCH / n) + 1


def _change_flags(cur: Curriculum, num: int) -> list[bool]:
    """Per global batch ``b`` (curriculum step ``b + 1``): did a difficulty change at it."""
    ds = [cur.difficulties(b + 1) for b in range(num)]
    return [b == 0 or ds[b] != ds[b - 1] for b in range(num)]


def bench_versus_deepspeed(n: int, steps: int, root: Path) -> dict[str, Any]:
    """Timed pass: both systems batch by batch in turns, every batch checked eligible."""
    lengths, rarity = _values(n)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(_Discard()):  # DeepSpeed prints a line per file opened
        files = {
            "seqlen": _metric_files(root, lengths, "seqlen", merged=False),
            "rarity": _metric_files(root, rarity, "rarity", merged=True),
        }
    ds_files_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cur = _curriculum(lengths, rarity, steps)
    index_s = time.perf_counter() - t0
    metrics = _metrics_config(steps)
    for name, paths in files.items():
        metrics[name] |= paths
    num, epochs = _batches(n, steps)
    changed = _change_flags(cur, num)
    elig = Eligibility(lengths, rarity)
    ours, theirs = Side("meshfeed"), Side("DeepSpeed")

    # DeepSpeed's MMapIndexedDataset prints progress lines on every open: kept off stdout
    with contextlib.redirect_stdout(_Discard()), _process_group() as group:
        clusters = root / "clusters"
        cfg = _config(metrics, clusters, epochs)
        order, ours.setup_s, ours.written = _timed(
            lambda: cur.make_order(dataset_length=n, global_batch_size=BATCH, seed=0)
        )
        sampler, theirs.setup_s, theirs.written = _timed(lambda: _sampler(cfg, n, group))
        it = iter(sampler)
        per_epoch = order.samples_per_epoch
        arange = np.arange(BATCH)
        for b in range(num):
            step = b + 1
            d = cur.difficulties(step)
            epoch, pos = divmod(b * BATCH, per_epoch)
            positions = pos + arange
            calls = [
                (ours, functools.partial(order.indices, epoch, positions)),
                (theirs, it.__next__),
            ]
            out: dict[str, Any] = {}
            for side, call in calls[:: 1 if b % 2 else -1]:  # who goes first alternates
                out[side.name], dt, w = _timed(call)
                side.add(dt, b, changed[b])
                side.written += w
            mine, batch = out[ours.name], out[theirs.name]
            # like for like: the same difficulties, only eligible samples, the same pool
            assert dict(sampler.current_difficulties) == d, (step, sampler.current_difficulties)
            got = np.asarray(batch, dtype=np.int64)
            assert len(got) == len(mine) == BATCH
            elig.check(mine, d, "meshfeed", step)
            elig.check(got, d, "DeepSpeed", step)
            if changed[b]:
                pool = order.pool_size(step)
                assert sum(sampler.data_cluster_sizes) == pool == elig.pool(d), step
        cluster_files, cluster_bytes = _folder_bytes(clusters)
        del sampler, it  # its memory maps
    return {
        "ours": ours,
        "theirs": theirs,
        "num": num,
        "changes": sum(changed) - 1,
        "segments": order.num_segments,
        "resident_mib": (order.pool_order.nbytes + order.entry_steps.nbytes) / 2**20,
        "cluster_files": cluster_files,
        "cluster_bytes": cluster_bytes,
        "clusters": len(list(clusters.glob("*.bin"))),
        "ds_files_s": ds_files_s,
        "index_s": index_s,
        "cfg_metrics": metrics,
        "epochs": epochs,
        "lengths": lengths,
        "rarity": rarity,
        "cur": cur,
        "changed": changed,
    }


def _traced(side: Side, setup: Callable[[], Any], draw: Callable[[Any, int], Any], r: dict) -> None:
    """Peak traced MiB above what was live before: setup, first batch, changes, steady."""
    num, changed = r["num"], r["changed"]
    tracemalloc.start()
    try:
        state = setup()
        side.setup_mib = tracemalloc.get_traced_memory()[1] / 2**20
        for b in range(num):
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            draw(state, b)
            peak = (tracemalloc.get_traced_memory()[1] - base) / 2**20
            if b == 0:
                side.first_mib = peak
            elif changed[b]:
                side.change_mib = max(side.change_mib, peak)
            else:
                side.steady_mib = max(side.steady_mib, peak)
        side.after_mib = tracemalloc.get_traced_memory()[0] / 2**20
        del state
    finally:
        tracemalloc.stop()


def memory_pass(n: int, r: dict[str, Any], root: Path) -> None:
    """Untimed: each system alone under tracemalloc, same inputs and batches as the timed pass."""
    cur: Curriculum = r["cur"]

    def our_setup() -> tuple[GatedOrder, np.ndarray]:
        return cur.make_order(dataset_length=n, global_batch_size=BATCH, seed=0), np.arange(BATCH)

    def our_draw(state: tuple[GatedOrder, np.ndarray], b: int) -> Any:
        order, arange = state
        epoch, pos = divmod(b * BATCH, order.samples_per_epoch)
        return order.indices(epoch, pos + arange)

    _traced(r["ours"], our_setup, our_draw, r)
    cfg = _config(r["cfg_metrics"], root / "clusters_traced", r["epochs"])
    with contextlib.redirect_stdout(_Discard()), _process_group() as group:
        _traced(r["theirs"], lambda: iter(_sampler(cfg, n, group)), lambda it, b: next(it), r)


# ------------------------------------------------------------------ report
def _ms(x: float) -> str:
    return f"{x * 1e3:,.3f}" if x < 0.01 else f"{x * 1e3:,.1f}"


def report(n: int, steps: int, r: dict[str, Any]) -> None:
    ours, theirs = r["ours"], r["theirs"]
    rows: list[tuple[str, str, str, str]] = []

    def row(what: str, unit: str, a: str, b: str) -> None:
        rows.append((what, unit, a, b))

    def ratio(a: float, b: float) -> str:
        if a <= 0:
            return "-"
        return f"{b / a:,.1f}x" if b >= a else f"{b / a:.3f}x"

    row("setup (make_order / constructor)", "ms", _ms(ours.setup_s), _ms(theirs.setup_s))
    row(
        "first batch (step 1; DeepSpeed: 1st cluster)", "ms", _ms(ours.first_s), _ms(theirs.first_s)
    )
    a, b = ours.setup_s + ours.first_s, theirs.setup_s + theirs.first_s
    row("time to first batch (the two above)", "ms", _ms(a), _ms(b))
    stat: dict[str, Callable[[list[float]], Any]] = {
        "median": np.median,
        "mean": np.mean,
        "max": np.max,
    }
    for label in ("median", "max"):
        a, b = float(stat[label](ours.change_s)), float(stat[label](theirs.change_s))
        row(f"batch at a difficulty change, {label}", "ms", _ms(a), _ms(b))
    a, b = sum(ours.change_s), sum(theirs.change_s)
    row(f"all {len(ours.change_s)} change batches", "s", f"{a:.3f}", f"{b:.3f}")
    for label in ("median", "mean", "max"):
        a, b = float(stat[label](ours.steady_s)), float(stat[label](theirs.steady_s))
        row(f"steady batch, {label}", "ms", _ms(a), _ms(b))
    last = ours.steady_s[-TAIL:], theirs.steady_s[-TAIL:]
    row(
        f"steady batch, median of last {TAIL} (full pool)",
        "ms",
        _ms(float(np.median(last[0]))),
        _ms(float(np.median(last[1]))),
    )
    row(
        f"whole run: setup + {r['num']} batches",
        "s",
        f"{ours.total_s:.2f}",
        f"{theirs.total_s:.2f}",
    )
    row(
        "bytes written (wchar)",
        "MiB",
        f"{ours.written / 2**20:.1f}",
        f"{theirs.written / 2**20:.1f}",
    )
    row("peak traced memory, setup", "MiB", f"{ours.setup_mib:.1f}", f"{theirs.setup_mib:.1f}")
    row("peak traced, first batch", "MiB", f"{ours.first_mib:.2f}", f"{theirs.first_mib:.1f}")
    row(
        "peak traced, a change batch (max)",
        "MiB",
        f"{ours.change_mib:.2f}",
        f"{theirs.change_mib:.1f}",
    )
    row(
        "peak traced, a steady batch (max)",
        "MiB",
        f"{ours.steady_mib:.2f}",
        f"{theirs.steady_mib:.2f}",
    )
    row(
        "traced memory held after the run",
        "MiB",
        f"{ours.after_mib:.1f}",
        f"{theirs.after_mib:.1f}",
    )

    print(
        f"## curriculum sampling, N = {n:,}, global batch {BATCH}, schedules over {steps} steps, "
        f"{r['num']} batches ({r['changes']} difficulty changes after step 1)"
    )
    print(
        f"inputs (not timed against each other): DeepSpeed index files written with DeepSpeed's "
        f"builder in {r['ds_files_s']:.2f} s; meshfeed MetricIndex.from_values x2 in "
        f"{r['index_s']:.2f} s"
    )
    w = max(len(x[0]) for x in rows)
    print("DS / mf: DeepSpeed's time over meshfeed's (above 1: meshfeed is faster)")
    print(f"{'':<{w}} {'unit':>5} {'meshfeed':>12} {'DeepSpeed':>12} {'DS / mf':>9}")
    for what, unit, a, b in rows:
        try:
            q = ratio(float(a.replace(",", "")), float(b.replace(",", "")))
        except ValueError:
            q = "-"
        if unit == "MiB" or what.startswith("bytes"):
            q = ""
        print(f"{what:<{w}} {unit:>5} {a:>12} {b:>12} {q:>9}")
    print(
        f"DeepSpeed wrote {r['clusters']} cluster files ({r['cluster_files']} .bin/.idx, "
        f"{r['cluster_bytes'] / 2**20:.1f} MiB on disk at the end; reshuffles rewrite them in "
        f"place); meshfeed's order holds {r['resident_mib']:.1f} MiB ({r['segments']} round-table "
        "rows) and writes nothing"
    )
    print(
        "every batch of both held only samples eligible at its step; at every change "
        "DeepSpeed's clusters added up to meshfeed's pool size\n"
    )


def bench_batches(sizes: list[int], steps: int) -> list[tuple[int, float]]:
    rows = []
    for n in sizes:
        lengths, rarity = _values(n)
        order = _curriculum(lengths, rarity, steps).make_order(
            dataset_length=n, global_batch_size=BATCH, seed=0
        )
        per_epoch = order.samples_per_epoch
        starts = [s * BATCH for s in range(0, 2 * steps, 37)]
        t0 = time.perf_counter()
        for g in starts:
            epoch, pos = divmod(g, per_epoch)
            order.indices(epoch, pos + np.arange(BATCH))
        rows.append((n, (time.perf_counter() - t0) / len(starts)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small N, short schedules")
    parser.add_argument("--n", type=int, default=None, help="samples in the DeepSpeed comparison")
    parser.add_argument("--skip-analyzer", action="store_true", help="skip section 1")
    args = parser.parse_args()
    docs = 10**5 if args.quick else 10**6
    steps = 200 if args.quick else 1_000
    n = args.n or (10**5 if args.quick else 3 * 10**6)

    if not args.skip_analyzer:
        print(f"## analyzer: seqlen + vocab_rarity (2 passes), {docs:,} documents, vocab {VOCAB}")
        rows = bench_analyzer(docs)
        print(f"{'workers':<14} {'seconds':>9} {'samples/s':>12}")
        for name, dt, rate in rows:
            print(f"{name:<14} {dt:>9.2f} {rate:>12,.0f}")
        print(
            f"speed-up 2 vs 1 worker: {rows[1][2] / rows[0][2]:.2f}x (identical output checked)\n"
        )

    missing = _deepspeed_missing()
    if missing:
        print(
            f"## curriculum sampling vs DeepSpeed: skipped, DeepSpeed is not importable ({missing})"
        )
        print("   pip install deepspeed (or '.[peers]') to run DeepSpeedDataSampler here\n")
    else:
        with tempfile.TemporaryDirectory(prefix="bench_curriculum_") as tmp:
            r = bench_versus_deepspeed(n, steps, Path(tmp))
            memory_pass(n, r, Path(tmp))
            report(n, steps, r)

    sizes = [10**5, 10**6] if args.quick else [10**5, 10**6, 10**7]
    print(f"## per-batch cost of GatedOrder.indices, global batch {BATCH} (meshfeed alone)")
    print(f"{'N':>12} {'us / batch':>12}")
    batch_rows = bench_batches(sizes, steps)
    for size, dt in batch_rows:
        print(f"{size:>12,} {dt * 1e6:>12.1f}")
    print(f"largest / smallest N time ratio: {batch_rows[-1][1] / batch_rows[0][1]:.2f}")


if __name__ == "__main__":
    main()
