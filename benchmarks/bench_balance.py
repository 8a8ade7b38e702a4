"""Balance of DP x CP schedules on heavy-tailed batches: meshfeed vs naive slicing vs tokens.

For each length distribution (log-normal; long-tail mix of 512-4k documents with ~1% of
32k-128k), number of ranks N and cost model (s**2 only; linear + quadratic FLOPs of a 7B-class
transformer), draw many global batches of about ``4 * N * max_tokens`` tokens and report the
step time (makespan) over the lower bound (max of total cost / N and the largest single-document
bound) for

- naive: equal-count contiguous slices per rank (every DP sampler's default),
- tokens: longest document first to the rank with the fewest tokens,
- meshfeed: ``meshfeed.balance.schedule_documents`` (CP degree chosen for balance and memory),
- meshfeed-pow2: the same restricted to ``cp_sizes="pow2_aligned"`` (Megatron / TE layouts).

The baselines are priced generously: documents over the budget run on one rank as if memory
allowed. It also times ``plan`` on 4,096 documents over 64 ranks (target: <= 50 ms).

    PYTHONPATH=src python benchmarks/bench_balance.py [--quick] [--out DIR]

Writes balance_results.md and balance_ratios.png into ``--out`` (default: benchmarks/results
for a full run; a fresh temporary folder for ``--quick``, so a smoke run leaves the checkout
clean).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from meshfeed.balance import CostModel, naive_slicing, schedule_documents, token_balancing
from meshfeed.balance.synthetic import DISTRIBUTIONS, sample_batch, sample_lengths
from meshfeed.progress import Progress

RESULTS = Path(__file__).parent / "results"
MAX_TOKENS = 32_768
COSTS = {
    "s^2 only": CostModel(quadratic=1.0),
    "linear+s^2 (7B)": CostModel.from_transformer(hidden_size=4096, num_layers=32, num_heads=32),
}
METHODS = ("naive", "tokens", "meshfeed", "meshfeed-pow2")


def ratios(kind: str, n_ranks: int, cost: CostModel, batches: int, seed: int) -> dict[str, list]:
    out: dict[str, list] = {m: [] for m in METHODS}
    out["ms"] = []
    for b in range(batches):
        lengths = sample_batch(kind, tokens=4 * n_ranks * MAX_TOKENS, seed=seed * 1000 + b)
        t0 = time.perf_counter()
        p = schedule_documents(lengths, num_ranks=n_ranks, max_tokens=MAX_TOKENS, cost=cost)
        out["ms"].append(1000 * (time.perf_counter() - t0))
        p2 = schedule_documents(
            lengths, num_ranks=n_ranks, max_tokens=MAX_TOKENS, cost=cost, cp_sizes="pow2_aligned"
        )
        kw = {"num_ranks": n_ranks, "max_tokens": MAX_TOKENS, "cost": cost}
        lb = p.lower_bound
        out["naive"].append(naive_slicing(lengths, **kw).makespan / lb)
        out["tokens"].append(token_balancing(lengths, **kw).makespan / lb)
        out["meshfeed"].append(p.makespan / lb)
        out["meshfeed-pow2"].append(p2.makespan / p2.lower_bound)
    return out


def planning_time(repeats: int) -> list[tuple[str, str, float, float, float, float]]:
    """Wall and CPU (process) time of schedule_documents() on 4,096 documents over 64 ranks, in ms."""
    rows = []
    for kind in DISTRIBUTIONS:
        lengths = sample_lengths(kind, 4096, seed=7)
        for cname, cost in COSTS.items():
            schedule_documents(lengths, num_ranks=64, max_tokens=MAX_TOKENS, cost=cost)  # warm up
            wall, cpu = [], []
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                schedule_documents(lengths, num_ranks=64, max_tokens=MAX_TOKENS, cost=cost)
                wall.append(1000 * (time.perf_counter() - t0))
                cpu.append(1000 * (time.process_time() - c0))
            rows.append(
                (
                    kind,
                    cname,
                    float(np.median(wall)),
                    float(np.percentile(wall, 90)),
                    float(np.median(cpu)),
                    float(np.percentile(cpu, 90)),
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few batches, N <= 16")
    parser.add_argument("--batches", type=int, default=None, help="batches per configuration")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the report and plot (default: benchmarks/results; --quick: a temp dir)",
    )
    args = parser.parse_args()
    out = args.out
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="meshfeed-bench-balance-")) if args.quick else RESULTS
    batches = args.batches or (6 if args.quick else 40)
    ranks = (8, 16) if args.quick else (8, 16, 32, 64)
    configs = [(k, n, c) for k in DISTRIBUTIONS for c in COSTS for n in ranks]

    results = {}
    with Progress(total=len(configs), desc="bench_balance", unit="config") as bar:
        for kind, n, cname in configs:
            results[kind, n, cname] = ratios(kind, n, COSTS[cname], batches, seed=n)
            bar.update()

    lines = [
        f"# meshfeed balance benchmark ({batches} batches per row, max_tokens={MAX_TOKENS}, "
        "batch = 4 x N x max_tokens tokens)",
        "",
        "makespan / lower bound, median (p90); lower is better, 1.00 is optimal.",
        "",
        "| lengths | cost | N | docs/batch | naive | tokens | meshfeed | meshfeed-pow2 | plan ms (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (kind, n, cname), r in results.items():
        docs = sample_batch(kind, tokens=4 * n * MAX_TOKENS, seed=n * 1000).size
        cells = [f"{np.median(r[m]):.3f} ({np.percentile(r[m], 90):.3f})" for m in METHODS]
        lines.append(
            f"| {kind} | {cname} | {n} | {docs} | "
            + " | ".join(cells)
            + f" | {np.median(r['ms']):.1f} |"
        )
    timing = planning_time(5 if args.quick else 30)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines += [
        "",
        f"schedule_documents() on 4,096 documents over 64 ranks (ms): target <= 50. {os.cpu_count()} CPUs, "
        f"load average {load:.1f} while measuring: wall time includes waiting for a CPU, "
        "CPU time is the work itself.",
        "",
        "| lengths | cost | wall median | wall p90 | CPU median | CPU p90 |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {c} | {wm:.1f} | {wp:.1f} | {cm:.1f} | {cp:.1f} |"
        for k, c, wm, wp, cm, cp in timing
    ]
    worst_med = max(np.median(r["meshfeed"]) for r in results.values())
    worst_p90 = max(np.percentile(r["meshfeed"], 90) for r in results.values())
    worst_ms = max(row[2] for row in timing)
    worst_cpu = max(row[4] for row in timing)
    lines += [
        "",
        f"targets: meshfeed median <= 1.03 (worst {worst_med:.3f}: "
        f"{'met' if worst_med <= 1.03 else 'NOT met'}), p90 <= 1.10 (worst {worst_p90:.3f}: "
        f"{'met' if worst_p90 <= 1.10 else 'NOT met'}), planning <= 50 ms (worst median wall "
        f"{worst_ms:.1f}: {'met' if worst_ms <= 50 else 'NOT met'}; worst median CPU "
        f"{worst_cpu:.1f}: {'met' if worst_cpu <= 50 else 'NOT met'})",
    ]
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "balance_results.md"
    report.write_text(text + "\n")
    print(f"\nwrote {report}")
    png = _plot(results, ranks, out / "balance_ratios.png")
    if png:
        print(f"wrote {png}")


def _plot(results: dict, ranks: tuple[int, ...], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the PNG")
        return None
    fig, axes = plt.subplots(len(DISTRIBUTIONS), len(COSTS), figsize=(13, 8), squeeze=False)
    colors = dict(zip(METHODS, ("#bbbbbb", "#7a9cc6", "#d1495b", "#edae49"), strict=True))
    for i, kind in enumerate(DISTRIBUTIONS):
        for j, cname in enumerate(COSTS):
            ax = axes[i][j]
            width = 0.8 / len(METHODS)
            for m_i, m in enumerate(METHODS):
                data = [results[kind, n, cname][m] for n in ranks]
                pos = np.arange(len(ranks)) + (m_i - (len(METHODS) - 1) / 2) * width
                bp = ax.boxplot(
                    data, positions=pos, widths=width * 0.9, patch_artist=True, showfliers=False
                )
                for box in bp["boxes"]:
                    box.set_facecolor(colors[m])
            ax.set_xticks(np.arange(len(ranks)), [f"N={n}" for n in ranks])
            ax.set_yscale("log")
            ax.axhline(1.0, color="black", lw=0.8, ls=":")
            ax.set_title(f"{kind} lengths, {cname} cost")
            ax.set_ylabel("makespan / lower bound")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[m]) for m in METHODS]
    fig.legend(handles, METHODS, loc="upper center", ncol=len(METHODS))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
