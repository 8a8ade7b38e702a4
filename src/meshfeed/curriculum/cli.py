"""``meshfeed analyze``: build curriculum metric indexes for a token corpus or any dataset.

The dataset is a Megatron/DeepSpeed .bin/.idx token corpus (give its prefix), its windows
(--windows SEQ_LEN: one value per window of TokenWindows(PREFIX, seq_len=SEQ_LEN), in the
order of its indices, for a curriculum over windows), or module:callable returning a
map-style dataset. Metrics are seqlen, vocab_rarity (two passes; --vocab-size defaults to the
largest token id + 1) or module:attr naming a SampleMetric / AccumulatedMetric (or a
no-argument callable returning one). Each metric is written to OUTPUT/<name>/; under torchrun
every rank takes a share of the work. -j defaults to the cores this process may use (more
workers than cores only add overhead).

The corpus PREFIX and OUTPUT may be URLs (s3://bucket/corpus, any fsspec protocol; credentials
and endpoint from the client's environment variables, e.g. AWS_ENDPOINT_URL): the corpus is
read through the shard cache (--cache-dir), the output written locally and then uploaded, each
metric's meta.json last; the output URL is checked before the analysis starts.

    meshfeed analyze data/corpus_text_document -o data/metrics -m seqlen -m vocab_rarity
    meshfeed analyze data/corpus_text_document --windows 2048 -o data/window_metrics -m vocab_rarity
    meshfeed analyze s3://bucket/corpus --windows 2048 -o s3://bucket/window_metrics -m seqlen
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from typing import Any

import numpy as np

from meshfeed.curriculum.analyzer import analyze
from meshfeed.curriculum.index import MetricIndex
from meshfeed.curriculum.metrics import AccumulatedMetric, SampleMetric, seqlen, vocab_rarity
from meshfeed.protocols import Source
from meshfeed.runtime import available_cores
from meshfeed.storage import is_url
from meshfeed.storage.urls import local_only

__all__ = ["add_subcommand"]

log = logging.getLogger("meshfeed")


def _resolve(spec: str, what: str) -> Any:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'package.module:name'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module in the current folder, as python -m finds it
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {what} {spec!r}: {exc}") from exc


def _dataset(spec: str, windows: int | None = None, cache_dir: str | None = None) -> Any:
    factory = ":" in spec and not is_url(spec)
    if windows is not None:
        if windows < 1:
            raise ValueError(f"--windows must be a positive window length (got {windows})")
        if factory:
            raise ValueError(
                f"--windows takes a token corpus prefix, not {spec!r}; give PREFIX of "
                "PREFIX.bin/.idx (or leave --windows out for a module:callable dataset)"
            )
    if factory:
        made = _resolve(spec, "dataset")
        # The spec names either a dataset object or a zero-argument factory (a class or a
        # function); a map-style dataset is a meshfeed.protocols.Source.
        return made() if callable(made) and not isinstance(made, Source) else made
    from meshfeed.sources.tokens.indexed import TokenCorpus

    if cache_dir is not None:
        local_only(cache_dir, what="--cache-dir", fix="give a local folder for the shard cache")
    corpus = TokenCorpus(spec, cache_dir=cache_dir)
    if not np.issubdtype(corpus.dtype, np.integer):
        raise ValueError(
            f"corpus {spec} holds {corpus.dtype} values, not token ids; a token corpus is an "
            "integer corpus: rewrite it with meshfeed convert --dtype uint16 (or int32 / int64)"
        )
    if windows is not None:
        from meshfeed.sources.tokens.windows import TokenWindows

        return TokenWindows(corpus, seq_len=windows)
    return corpus


#: The most ids ``vocab_rarity`` counts by default (the largest id + 1): its histogram is 8
#: bytes an id in every worker, 1 GiB here; more takes an explicit ``--vocab-size``.
MAX_DERIVED_VOCAB = 2**27


def _vocab_size(dataset: Any) -> int:
    """The largest token id + 1 of a token corpus, its windows, or any dataset of token ids."""
    from meshfeed.sources.tokens.indexed import TokenCorpus
    from meshfeed.sources.tokens.windows import TokenWindows

    corpus = dataset.corpus if isinstance(dataset, TokenWindows) else dataset
    if isinstance(corpus, TokenCorpus):
        return int(np.max(corpus.tokens, initial=0)) + 1
    tops = (int(np.max(np.asarray(dataset[i]), initial=0)) for i in range(len(dataset)))
    return max(tops, default=0) + 1


def _metric(spec: str, dataset: Any, vocab_size: int | None) -> SampleMetric | AccumulatedMetric:
    from meshfeed.sources.tokens.windows import TokenWindows

    if spec == "seqlen" and isinstance(dataset, TokenWindows):
        raise ValueError(
            f"-m seqlen with --windows {dataset.seq_len} gives every window the same value (the "
            "windows are fixed-length), which orders nothing; use -m vocab_rarity or a "
            "module:attr metric over windows, or leave out --windows to index document lengths"
        )
    if spec == "seqlen":
        return seqlen()
    if spec == "vocab_rarity":
        if vocab_size is None:
            vocab_size = _vocab_size(dataset)
            if vocab_size > MAX_DERIVED_VOCAB:
                raise ValueError(
                    f"the largest token id is {vocab_size - 1}, so vocab_rarity would count "
                    f"{vocab_size:,} ids ({8 * vocab_size / 2**30:.1f} GiB per worker); token "
                    "ids this large are no vocabulary (hashes, or a corpus of another dtype?): "
                    "check the corpus, or pass --vocab-size to count that many"
                )
        elif vocab_size < 1:
            raise ValueError(f"--vocab-size must be positive (got {vocab_size})")
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


_LIBRARY_ADVICE = re.compile(r"pass vocab_size > (\d+) to token_histogram\(\) / vocab_rarity\(\)")


def _cli_message(exc: BaseException) -> str:
    """An analyzer error in the command's terms: its first part, with the CLI flag to pass."""
    text = str(exc).split("\n\n(raised in", 1)[0]  # no worker traceback for a CLI user
    text = _LIBRARY_ADVICE.sub(
        lambda m: (
            f"pass --vocab-size {int(m.group(1)) + 1} or more, or leave it out "
            "(the largest token id + 1)"
        ),
        text,
    )
    return " ".join(text.split())


def _handler(args: argparse.Namespace) -> int:
    try:
        dataset = _dataset(args.dataset, args.windows, args.cache_dir)
        default = ["vocab_rarity" if args.windows is not None else "seqlen"]
        metrics = [_metric(m, dataset, args.vocab_size) for m in args.metric or default]
        result = analyze(
            dataset,
            metrics,
            output_dir=args.output,
            num_workers=args.num_workers,
            chunk_size=args.chunk_size,
            progress=not args.quiet,
        )
    except (ValueError, TypeError, OSError, ImportError, MemoryError) as exc:
        log.error("meshfeed analyze: error: %s", _cli_message(exc))
        return 2
    _report(result, len(dataset), args.output)
    return 0


def _report(result: dict[str, MetricIndex | np.ndarray], n: int, output: str) -> None:
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
    print(f"wrote {written} for {n} samples to {output}")


def add_subcommand(subparsers: Any) -> None:
    """Register ``analyze`` on an ``argparse`` subparsers object (``set_defaults(func=...)``)."""
    p = subparsers.add_parser(
        "analyze",
        help="compute curriculum metric indexes (seqlen, vocab_rarity, custom) for a dataset",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "dataset",
        help="token corpus prefix (PREFIX.bin/.idx, or a URL such as s3://bucket/corpus) or "
        "module:callable",
    )
    p.add_argument(
        "--windows",
        type=int,
        metavar="SEQ_LEN",
        help="index the windows of TokenWindows(PREFIX, seq_len=SEQ_LEN), not the documents",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="output folder or URL (s3://bucket/metrics: written locally, then uploaded); one "
        "subfolder per metric",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="shard cache for a URL corpus (default: $MESHFEED_CACHE_DIR or ~/.cache/meshfeed)",
    )
    p.add_argument(
        "-m",
        "--metric",
        action="append",
        help="seqlen | vocab_rarity | module:attr (repeatable; default: seqlen, or vocab_rarity "
        "with --windows, where seqlen is the same for every window)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size for vocab_rarity (default: the largest token id + 1)",
    )
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
