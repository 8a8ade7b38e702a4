"""``meshfeed plan``: how balanced would training be on this mesh, these lengths, this budget?

Prints, for meshfeed's balanced schedule and for naive slicing (and token balancing), the
step time over its lower bound, micro-steps per rank and packing efficiency, and saves a plot
of per-rank load averaged over the batches when asked (--plot PATH). The ranks balanced are
DP x CP (--dp times --cp); --tp with --sequence-parallel only changes padding. Lengths come
from a synthetic distribution, a file of document lengths (.npy, or text with one length per
line) or a Megatron-format token corpus (--corpus PREFIX, the sizes of its .idx), read in
order as consecutive global batches. Documents longer than all ranks can hold are split into
pieces by default (--long-documents).

    meshfeed plan --dp 8 --cp 2 --max-tokens 32768 --dist longtail --batches 8
    meshfeed plan --dp 16 --lengths doc_lengths.npy --cost s2 --plot load.png
    meshfeed plan --dp 4 --cp 2 --corpus data/train_text_document
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.balance.baselines import BaselineResult, naive_slicing, token_balancing
from meshfeed.balance.cost import CostModel
from meshfeed.balance.long_documents import LONG_DOCUMENT_POLICIES, fit_lengths, max_document_tokens
from meshfeed.balance.schedule import Placement, schedule_documents
from meshfeed.balance.synthetic import DISTRIBUTIONS, sample_batch
from meshfeed.mesh import DataMesh
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.storage import is_url, local_path_of

__all__ = ["add_subcommand", "run"]


def add_subcommand(subparsers: Any) -> None:
    """Register ``plan`` on an argparse subparsers object (handler in ``func``)."""
    p = subparsers.add_parser(
        "plan",
        help="balance of a DP x CP schedule for a length distribution or corpus",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mesh = p.add_argument_group("mesh")
    mesh.add_argument("--dp", type=int, default=8, help="data-parallel size (default: 8)")
    mesh.add_argument("--cp", type=int, default=1, help="context-parallel size (default: 1)")
    mesh.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    mesh.add_argument(
        "--sequence-parallel", action="store_true", help="pad split documents to 2 x c x tp"
    )
    mesh.add_argument(
        "--cp-sizes",
        choices=("any", "pow2_aligned"),
        default="any",
        help="group sizes a document may span: any, or powers of two on aligned blocks "
        "(default: any)",
    )
    data = p.add_argument_group("lengths")
    src = data.add_mutually_exclusive_group()
    src.add_argument(
        "--dist",
        choices=DISTRIBUTIONS,
        default="longtail",
        help="synthetic length distribution (default: longtail)",
    )
    src.add_argument(
        "--lengths",
        type=_local_path("--lengths", "download it first, or give --corpus URL"),
        metavar="FILE",
        help="document lengths: a .npy integer array, or text with one length per line",
    )
    src.add_argument(
        "--corpus", metavar="PREFIX", help="token corpus PREFIX(.bin/.idx): its document lengths"
    )
    data.add_argument(
        "--batch-tokens",
        type=int,
        metavar="N",
        help="tokens per global batch (default: 4 x ranks x --max-tokens)",
    )
    data.add_argument("--batches", type=int, default=8, help="global batches to plan (default: 8)")
    data.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic lengths (default: 0)"
    )
    data.add_argument(
        "--long-documents",
        choices=LONG_DOCUMENT_POLICIES,
        default="split",
        help="a document longer than all ranks hold is refused, truncated or split into "
        "pieces (default: split)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=32768,
        help="tokens per rank per micro-step (default: 32768)",
    )
    cost = p.add_argument_group("cost model")
    cost.add_argument(
        "--cost",
        choices=("transformer", "s2", "tokens"),
        default="transformer",
        help="transformer FLOPs, s^2 only, or tokens only (default: transformer)",
    )
    cost.add_argument(
        "--per-step",
        type=float,
        default=0.0,
        help="fixed cost of one micro-step, in the cost model's units (default: 0)",
    )
    cost.add_argument("--hidden-size", type=int, default=4096, help="(default: 4096)")
    cost.add_argument("--num-layers", type=int, default=32, help="(default: 32)")
    cost.add_argument("--num-heads", type=int, default=32, help="(default: 32)")
    p.add_argument(
        "--plot",
        "--png",
        dest="plot",
        type=_local_path("--plot", "write it locally, then copy it"),
        default=None,
        metavar="PATH",
        help="write a plot of per-rank load here, as .png, .svg or .pdf (needs matplotlib)",
    )
    p.add_argument("--no-png", action="store_true", help="no plot, even with --plot")
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress (plan shows none; as every command)"
    )
    p.set_defaults(func=run)


def _local_path(flag: str, fix: str) -> Callable[[str], Path]:
    """An argparse type for a local file: a URL is refused by name (never made a local folder)."""

    def parse(text: str) -> Path:
        if is_url(text) and local_path_of(text) is None:
            raise argparse.ArgumentTypeError(f"{text} is a URL; {flag} takes a local file: {fix}")
        return Path(local_path_of(text) or text)

    return parse


PLOT_FORMATS = (".png", ".svg", ".pdf")


def _check_plot(path: Path | None) -> None:
    """Refuse a plot path that cannot be written before any work is done."""
    if path is None:
        return
    if path.suffix.lower() not in PLOT_FORMATS:
        raise ValueError(
            f"--plot {path}: cannot tell the image format from {path.suffix or 'no suffix'!r}; "
            f"end the name in {', '.join(PLOT_FORMATS)}"
        )
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"--plot {path}: folder {parent} does not exist; create it first")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError('--plot needs matplotlib: pip install "meshfeed[plot]"') from None


def run(args: argparse.Namespace) -> int:
    """Handler of ``meshfeed plan``; returns the exit code (2 for bad input)."""
    try:
        mesh, ranks, batches, kw, plans = _plan(args)
    except (ValueError, TypeError, OSError) as e:
        hint = ""
        if "more than" in str(e) and args.long_documents == "refuse":
            hint = " (or pass --long-documents split)"
        print(f"meshfeed plan: error: {e}{hint}", file=sys.stderr)
        return 2
    methods = (("naive slicing", naive_slicing), ("token balancing", token_balancing))
    base = {name: [fn(b, **kw) for b in batches] for name, fn in methods}
    rows = _compare(plans, base)
    docs = sum(b.size for b in batches)
    # What was planned, not what was asked: a short corpus gives fewer, smaller batches.
    per_batch = round(float(np.mean([int(b.sum()) for b in batches])))
    print(
        f"mesh {mesh.sizes} -> {ranks} balanced ranks (DP x CP); budget {args.max_tokens} "
        f"tokens/rank/micro-step; {len(batches)} batches, {docs} documents, "
        f"~{per_batch} tokens each; cost {args.cost}"
    )
    _print_table(rows)
    _print_degrees(plans, ranks, args.cp)
    if args.plot is not None and not args.no_png:
        try:
            _plot(plans, batches, base, args.plot)
        except OSError as e:
            print(f"meshfeed plan: error: cannot write --plot {args.plot} ({e})", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def _plan(
    args: argparse.Namespace,
) -> tuple[DataMesh, int, list[np.ndarray], dict[str, Any], list[Placement]]:
    """Check the arguments and schedule every batch: the mesh, its balanced ranks, the
    batches, the scheduling keywords and one placement per batch."""
    for name in ("dp", "cp", "tp", "max_tokens", "batches"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be a positive integer (got {getattr(args, name)})")
    if not args.no_png:
        _check_plot(args.plot)
    mesh = DataMesh.from_sizes(dp=args.dp, cp=args.cp, tp=args.tp)
    ranks = mesh.data_world_size * mesh.sizes.get("cp", 1)
    cost = _cost(args)
    batch_tokens = args.batch_tokens or 4 * ranks * args.max_tokens
    tp = args.tp if args.sequence_parallel else 1
    limit = max_document_tokens(
        num_ranks=ranks, max_tokens=args.max_tokens, cp_sizes=args.cp_sizes, tp=tp
    )
    batches = [fit_lengths(b, limit, args.long_documents) for b in _batches(args, batch_tokens)]
    kw: dict[str, Any] = {"num_ranks": ranks, "max_tokens": args.max_tokens, "cost": cost}
    plans = [schedule_documents(b, cp_sizes=args.cp_sizes, tp=tp, **kw) for b in batches]
    return mesh, ranks, batches, kw, plans


#: Per baseline method, its result for each batch.
_Baselines = dict[str, list[BaselineResult]]


def _compare(plans: list[Placement], base: _Baselines) -> dict[str, list[tuple[float, int, float]]]:
    """Per method, each batch's (makespan / lower bound, micro-steps, packing efficiency)."""
    methods: dict[str, Sequence[Placement | BaselineResult]] = {"meshfeed": plans, **base}
    return {
        name: [
            (r.makespan / p.lower_bound, r.num_microsteps, r.packing_efficiency)
            for r, p in zip(results, plans, strict=True)
        ]
        for name, results in methods.items()
    }


def _print_table(rows: dict[str, list[tuple[float, int, float]]]) -> None:
    print(f"{'method':<16} {'makespan/LB med':>16} {'p90':>7} {'micro-steps':>12} {'packing':>8}")
    for name, vals in rows.items():
        arr = np.asarray(vals)
        print(
            f"{name:<16} {np.median(arr[:, 0]):>16.3f} {np.percentile(arr[:, 0], 90):>7.3f} "
            f"{np.median(arr[:, 1]):>12.1f} {np.median(arr[:, 2]):>8.1%}"
        )


def _print_degrees(plans: list[Placement], ranks: int, cp: int) -> None:
    cp_size = np.concatenate([p.cp_size for p in plans])
    degrees = ", ".join(
        f"{c}: {n}" for c, n in zip(*np.unique(cp_size, return_counts=True), strict=True)
    )
    # meshfeed groups any of the DP x CP ranks for a long document (hybrid CP), so a document
    # may span more ranks than --cp; say so rather than call it the mesh's CP degree.
    print(
        f"meshfeed split degree (ranks a document spans: documents; groups are formed from "
        f"all {ranks} DP x CP ranks, not only --cp {cp}): {degrees}"
    )


def _cost(args: argparse.Namespace) -> CostModel:
    if args.cost == "s2":
        return CostModel(quadratic=1.0, per_step=args.per_step)
    if args.cost == "tokens":
        return CostModel(linear=1.0, per_step=args.per_step)
    return CostModel.from_transformer(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        per_step=args.per_step,
    )


def _batches(args: argparse.Namespace, batch_tokens: int) -> list[np.ndarray]:
    if args.corpus is not None:
        corpus = TokenCorpus.open(args.corpus).sizes.astype(np.int64)
        if corpus.size == 0:
            raise ValueError(f"corpus {args.corpus} has no documents; nothing to plan")
    elif args.lengths is not None:
        corpus = _read_lengths(args.lengths)
    else:
        return [
            sample_batch(args.dist, tokens=batch_tokens, seed=args.seed * 100_003 + b)
            for b in range(args.batches)
        ]
    ends = np.searchsorted(np.cumsum(corpus), batch_tokens * np.arange(1, args.batches + 1))
    cuts = np.unique(np.minimum(np.concatenate([[0], ends + 1]), corpus.size))
    out = [corpus[a:b] for a, b in itertools.pairwise(cuts.tolist()) if b > a]
    return out or [corpus]


def _read_lengths(path: Path) -> np.ndarray:
    """Document lengths from a .npy array or a text file (whitespace-separated integers)."""
    if not path.is_file():
        raise ValueError(f"--lengths {path}: no such file")
    if path.suffix == ".npy":
        try:
            lengths = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"--lengths {path} is not a numeric .npy array ({e})") from None
        if lengths.ndim != 1:
            raise ValueError(
                f"--lengths {path} holds an array of shape {lengths.shape}; give a 1-D array of "
                "document lengths, one per document (np.save(path, lengths.ravel()) if that is "
                "what it holds)"
            )
    else:
        text = path.read_text(encoding="utf-8", errors="replace").split()
        try:
            lengths = np.asarray([int(v) for v in text], dtype=np.int64)
        except ValueError:
            bad = next(v for v in text if not v.lstrip("-").isdigit())
            raise ValueError(
                f"--lengths {path}: {bad[:20]!r} is not an integer; give one document length "
                "per line (or a .npy integer array)"
            ) from None
    if lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer) or lengths.min() < 0:
        raise ValueError(
            f"--lengths {path} must hold a non-empty list of non-negative integer lengths"
        )
    return lengths.astype(np.int64)


def _plot(plans: list[Placement], batches: list[np.ndarray], base: _Baselines, path: Path) -> None:
    """Per-rank load over the lower bound, averaged over every planned batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = plans[0]
    ranks = np.arange(p.num_ranks)
    naive, tokens = (
        np.mean([r.rank_time / q.lower_bound for r, q in zip(rs, plans, strict=True)], axis=0)
        for rs in base.values()
    )
    mine = np.mean([q.rank_time / q.lower_bound for q in plans], axis=0)
    step = float(np.median([q.makespan / q.lower_bound for q in plans]))
    docs = sum(b.size for b in batches)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.25 * p.num_ranks + 3), 4.5))
    width = 0.28
    ax.bar(ranks - width, naive, width, label="naive slicing", color="#bbbbbb")
    ax.bar(ranks, tokens, width, label="token balancing", color="#7a9cc6")
    ax.bar(ranks + width, mine, width, label="meshfeed", color="#d1495b")
    ax.axhline(1.0, color="black", lw=0.8, ls=":", label="lower bound")
    ax.set_xlabel("rank (DP x CP)")
    ax.set_ylabel("load / lower bound")
    ax.set_xticks(ranks[:: max(1, p.num_ranks // 16)])  # integer ranks, at most ~16 labels
    ax.set_xlim(-0.6, p.num_ranks - 0.4)
    ax.set_title(
        f"Per-rank load, mean of {len(batches)} batches ({docs} documents)\n"
        f"meshfeed step = {step:.3f} x lower bound (median)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
