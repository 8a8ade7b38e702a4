"""``meshfeed analyze``: build curriculum metric indexes for a token corpus or any dataset.

The dataset is a Megatron/DeepSpeed ``.bin/.idx`` token corpus (give its prefix) or
``module:callable`` returning a map-style dataset. Metrics are ``seqlen``, ``vocab_rarity``
(two passes; ``--vocab-size`` defaults to the largest token id + 1) or ``module:attr`` naming a
``SampleMetric`` / ``AccumulatedMetric`` (or a no-argument callable returning one). Each metric
is written to ``OUTPUT/<name>/``; under torchrun every rank takes a share of the work. ``-j``
defaults to the cores this process may use (more workers than cores only adds overhead).

    meshfeed analyze data/corpus_text_document -o data/metrics -m seqlen -m vocab_rarity
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from typing import Any

import numpy as np

from meshfeed.curriculum.analyzer import analyze
from meshfeed.curriculum.index import MetricIndex
from meshfeed.curriculum.metrics import AccumulatedMetric, SampleMetric, seqlen, vocab_rarity

__all__ = ["add_subcommand", "available_cores"]

log = logging.getLogger("meshfeed")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _resolve(spec: str, what: str) -> Any:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'package.module:name'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {what} {spec!r}: {exc}") from exc


def _dataset(spec: str) -> Any:
    if ":" in spec:
        made = _resolve(spec, "dataset")
        # The spec names either a dataset object or a zero-argument factory (a class or a
        # function); a map-style dataset is recognised by __getitem__ (meshfeed.protocols.Source).
        return made() if callable(made) and not hasattr(made, "__getitem__") else made
    from meshfeed.sources.indexed import TokenCorpus

    corpus = TokenCorpus(spec)
    if not np.issubdtype(corpus.dtype, np.integer):
        raise ValueError(
            f"corpus {spec} holds {corpus.dtype} values, not token ids; a token corpus is an "
            "integer corpus: rewrite it with `meshfeed convert --dtype uint16` (or int32 / int64)"
        )
    return corpus


def _metric(spec: str, dataset: Any, vocab_size: int | None) -> SampleMetric | AccumulatedMetric:
    if spec == "seqlen":
        return seqlen()
    if spec == "vocab_rarity":
        if vocab_size is None:
            vocab_size = int(max(int(np.max(dataset[i])) for i in range(len(dataset)))) + 1
        return vocab_rarity(vocab_size)
    if ":" not in spec:
        raise ValueError(
            f"unknown metric {spec!r}; use seqlen, vocab_rarity or 'module:attr' naming a "
            "SampleMetric / AccumulatedMetric"
        )
    made = _resolve(spec, "metric")
    if callable(made) and not isinstance(made, (SampleMetric, AccumulatedMetric)):
        made = made()
    if not isinstance(made, (SampleMetric, AccumulatedMetric)):
        raise ValueError(f"metric {spec!r} is a {type(made).__name__}, not a SampleMetric")
    return made


def _handler(args: argparse.Namespace) -> int:
    try:
        dataset = _dataset(args.dataset)
        metrics = [_metric(m, dataset, args.vocab_size) for m in args.metric or ["seqlen"]]
        result = analyze(
            dataset,
            metrics,
            output_dir=args.output,
            num_workers=args.num_workers,
            chunk_size=args.chunk_size,
            progress=not args.quiet,
        )
    except (ValueError, TypeError, OSError) as exc:
        log.error("meshfeed analyze: error: %s", exc)
        return 2
    print(f"{'metric':<20} {'dtype':<8} {'min':>12} {'p50':>12} {'p90':>12} {'max':>12}")
    for name, item in result.items():
        if isinstance(item, MetricIndex):
            p = item.percentiles
            print(
                f"{name:<20} {item.values.dtype!s:<8} {p[0]:>12.6g} {p[50]:>12.6g} "
                f"{p[90]:>12.6g} {p[100]:>12.6g}"
            )
        else:
            print(f"{name:<20} {item.dtype!s:<8} (accumulated, {item.size} entries)")
    indexes = [name for name, item in result.items() if isinstance(item, MetricIndex)]
    arrays = [name for name, item in result.items() if not isinstance(item, MetricIndex)]
    written = f"{len(indexes)} metric index(es) ({', '.join(indexes)})"
    if arrays:
        written += f" and {len(arrays)} accumulated array(s) ({', '.join(arrays)})"
    print(f"wrote {written} for {len(dataset)} samples to {args.output}")
    return 0


def add_subcommand(subparsers: Any) -> None:
    """Register ``analyze`` on an ``argparse`` subparsers object (``set_defaults(func=...)``)."""
    p = subparsers.add_parser(
        "analyze",
        help="compute curriculum metric indexes (seqlen, vocab_rarity, custom) for a dataset",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("dataset", help="token corpus prefix (PREFIX.bin/.idx) or 'module:callable'")
    p.add_argument("-o", "--output", required=True, help="output directory (one subdir per metric)")
    p.add_argument(
        "-m",
        "--metric",
        action="append",
        help="seqlen | vocab_rarity | module:attr (repeatable; default: seqlen)",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for vocab_rarity")
    cores = available_cores()
    p.add_argument(
        "-j",
        "--num-workers",
        type=int,
        default=cores,
        help=f"worker processes; 0 runs in this process (default: the {cores} core(s) available)",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="samples per work item (default: about 64 items per pass, 256..4096 samples each)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_handler)
