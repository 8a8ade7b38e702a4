"""Packing any sample: padding share and packed rows/s, meshfeed vs Grain's packers, and resume cost.

Two length distributions, the same samples for every packer (dicts of ``input_ids`` and
``labels``, int32 numpy):

- chat: Q&A conversations built from the docstrings of the Python standard library (question:
  the function's name, answer: its docstring), rendered with a ChatML template and tokenized by a
  byte-level BPE trained here with ``tokenizers`` (nothing downloaded);
- lognormal: a long-tailed synthetic distribution (median 512 tokens, sigma 1, capped at a row).

Per distribution it packs ``--window`` samples at a time into rows of ``max_tokens``:

- meshfeed ``PackedSamples`` best fit decreasing and first fit (plan from lengths, then every row
  read and concatenated: the time counts both);
- Grain 0.2's ``BestFitPackIterDataset`` and ``FirstFitPackIterDataset`` with as many bins as the
  window's samples fill (``ceil(window * mean / max_tokens)``), over ``MapDataset.source(samples)``
  (its recommended pipeline; the faster of its default read options and ``num_threads=0`` is
  kept; ``--quick`` runs ``num_threads=0`` only, the faster one in every full run here);
- TRL's packing where ``trl`` is installed (it is not here: reported as skipped).

Each packer runs ``--repeat`` times in turns (3 for a full run) and its fastest run is kept.
Padding share is ``1 - tokens / (rows * max_tokens)`` (the padding a fixed-shape row would carry;
Grain pads its rows to ``max_tokens``). The resume rows give the checkpoint's size in JSON
bytes and the time from a checkpoint to the first row again: a loader over ``PackedSamples``
(its state is a position) and Grain's packing iterator (``get_state`` / ``set_state``).

    PYTHONPATH=src python benchmarks/bench_packing.py [--quick] [--out DIR]

Writes packing.txt into ``--out`` (default benchmarks/results; a temporary folder for --quick).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed import DataLoader
from meshfeed.balance import PackedSamples, SampleFields, merge_rows
from meshfeed.balance.synthetic import sample_lengths
from meshfeed.sources import ChatSamples, JinjaChatTemplate

RESULTS = Path(__file__).parent / "results"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FIELDS = SampleFields(token_fields=("input_ids", "labels"))


def stdlib_conversations(limit: int) -> list[list[dict[str, str]]]:
    """Q&A pairs from the standard library's docstrings, in a fixed order."""
    chats: list[list[dict[str, str]]] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    question = f"What does {path.stem}.{node.name} do?"
                    chats.append(
                        [
                            {"role": "user", "content": question},
                            {"role": "assistant", "content": doc},
                        ]
                    )
                    if len(chats) >= limit:
                        return chats
    return chats


def chat_lengths(n: int) -> np.ndarray:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    chats = stdlib_conversations(n)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((m["content"] for c in chats for m in c), trainer)
    return ChatSamples(chats, tok, template=JinjaChatTemplate(CHATML)).lengths


def make_samples(lengths: np.ndarray) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for n in lengths.tolist():
        ids = rng.integers(0, 32_000, n, dtype=np.int32)
        out.append({"input_ids": ids, "labels": ids.copy()})
    return out


def run_meshfeed(samples: list, lengths: np.ndarray, max_tokens: int, window: int, method: str):
    t0 = time.perf_counter()
    rows = PackedSamples(
        samples, max_tokens=max_tokens, fields=FIELDS, lengths=lengths, window=window, method=method
    )
    plan = time.perf_counter() - t0
    tokens = 0
    for lo in range(0, len(rows), 32):
        for row in rows.__getitems__(list(range(lo, min(lo + 32, len(rows))))):
            tokens += int(row["cu_seqlens"][-1])
    total = time.perf_counter() - t0
    assert tokens == int(lengths.sum())
    return {"rows": len(rows), "seconds": total, "plan_seconds": plan}


def _grain_pipeline(samples: list, max_tokens: int, bins: int, kind: str, threads: int | None):
    import grain
    import grain.experimental as ge

    source = grain.MapDataset.source(samples)
    ds = (
        source.to_iter_dataset()
        if threads is None
        else source.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=0))
    )
    cls = ge.BestFitPackIterDataset if kind == "best_fit" else ge.FirstFitPackIterDataset
    length = {"input_ids": max_tokens, "labels": max_tokens}
    return cls(ds, length_struct=length, num_packing_bins=bins, shuffle_bins=False)


def run_grain(
    samples: list, lengths: np.ndarray, max_tokens: int, bins: int, kind: str, quick: bool
):
    best: dict[str, Any] | None = None
    for threads in (0,) if quick else (None, 0):
        t0 = time.perf_counter()
        rows = tokens = 0
        for row in _grain_pipeline(samples, max_tokens, bins, kind, threads):
            rows += 1
            tokens += int((row["input_ids_segment_ids"] > 0).sum())
        seconds = time.perf_counter() - t0
        assert tokens == int(lengths.sum())
        if best is None or seconds < best["seconds"]:
            best = {"rows": rows, "seconds": seconds, "threads": threads}
    assert best is not None
    return best


def resume_meshfeed(samples: list, lengths: np.ndarray, max_tokens: int, window: int):
    rows = PackedSamples(
        samples, max_tokens=max_tokens, fields=FIELDS, lengths=lengths, window=window
    )
    loader = DataLoader(rows, batch_size=4, collate_fn=merge_rows)
    it = iter(loader)
    for _ in range(len(loader) // 2):
        next(it)
    state = json.dumps(loader.state_dict())
    t0 = time.perf_counter()
    again = DataLoader(
        PackedSamples(
            samples, max_tokens=max_tokens, fields=FIELDS, lengths=lengths, window=window
        ),
        batch_size=4,
        collate_fn=merge_rows,
    )
    again.load_state_dict(json.loads(state))
    first = next(iter(again))
    seconds = time.perf_counter() - t0
    assert first["cu_seqlens"][-1] > 0
    return {"bytes": len(state), "seconds": seconds}


def resume_grain(samples: list, max_tokens: int, bins: int, rows: int):
    it = iter(_grain_pipeline(samples, max_tokens, bins, "best_fit", 0))
    for _ in range(rows // 2):
        next(it)
    state = json.dumps(it.get_state())
    t0 = time.perf_counter()
    again = iter(_grain_pipeline(samples, max_tokens, bins, "best_fit", 0))
    again.set_state(json.loads(state))
    next(again)
    return {"bytes": len(state), "seconds": time.perf_counter() - t0}


def _keep_fastest(results: dict[str, dict[str, Any]], label: str, run: dict[str, Any]) -> None:
    if label not in results or run["seconds"] < results[label]["seconds"]:
        results[label] = run


def bench(
    name: str,
    lengths: np.ndarray,
    max_tokens: int,
    window: int,
    report: list[str],
    quick: bool,
    repeat: int,
) -> None:
    samples = make_samples(lengths)
    bins = max(1, math.ceil(window * float(lengths.mean()) / max_tokens))
    total = int(lengths.sum())
    report.append(
        f"\n{name}: {lengths.size} samples, {total} tokens, mean {lengths.mean():.0f}, "
        f"p50 {int(np.median(lengths))}, p99 {int(np.percentile(lengths, 99))}, max "
        f"{int(lengths.max())}; rows of {max_tokens}, window {window} samples "
        f"(Grain: {bins} bins)"
    )
    report.append(f"  {'packer':<26} {'rows':>6} {'padding':>8} {'rows/s':>9}  note")
    results: dict[str, dict[str, Any]] = {}
    for _ in range(repeat):  # in turns, keeping each packer's fastest run
        for method in ("best_fit", "first_fit"):
            r = run_meshfeed(samples, lengths, max_tokens, window, method)
            _keep_fastest(results, f"meshfeed {method}", r)
        for kind in ("best_fit", "first_fit"):
            r = run_grain(samples, lengths, max_tokens, bins, kind, quick)
            _keep_fastest(results, f"grain {kind}", r)
    for label, r in results.items():
        pad = 1 - total / (r["rows"] * max_tokens)
        note = (
            f"plan {1000 * r['plan_seconds']:.0f} ms of it"
            if "plan_seconds" in r
            else f"read threads {'default' if r['threads'] is None else r['threads']}"
        )
        report.append(
            f"  {label:<26} {r['rows']:>6} {100 * pad:>7.2f}% {r['rows'] / r['seconds']:>9.0f}  {note}"
        )
    ours, grain = results["meshfeed best_fit"], results["grain best_fit"]
    report.append(
        f"  meshfeed best fit / Grain best fit: padding {(1 - total / (ours['rows'] * max_tokens)) / max(1e-12, 1 - total / (grain['rows'] * max_tokens)):.2f}x, "
        f"rows/s {(ours['rows'] / ours['seconds']) / (grain['rows'] / grain['seconds']):.1f}x; first fit rows/s "
        f"{(results['meshfeed first_fit']['rows'] / results['meshfeed first_fit']['seconds']) / (results['grain first_fit']['rows'] / results['grain first_fit']['seconds']):.1f}x"
    )
    mr = resume_meshfeed(samples, lengths, max_tokens, window)
    gr = resume_grain(samples, max_tokens, bins, grain["rows"])
    report.append(
        f"  resume at half an epoch: meshfeed state {mr['bytes']} B, first row again in "
        f"{1000 * mr['seconds']:.1f} ms (plan included); Grain state {gr['bytes']} B, "
        f"{1000 * gr['seconds']:.1f} ms"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=None, help="runs per packer (best kept)")
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    n = 1_500 if args.quick else 20_000
    args.repeat = args.repeat or (1 if args.quick else 3)
    report = [
        f"bench_packing ({'--quick' if args.quick else 'full'}), python {sys.version.split()[0]}, "
        f"fastest of {args.repeat} runs in turns; a shared 2-core machine: compare ratios "
        "within this run"
    ]
    if importlib.util.find_spec("trl") is None:
        report.append("TRL: not installed, skipped")
    chat = chat_lengths(n)
    bench(
        "chat (stdlib docstrings, BPE 4k)", chat, 2048, args.window, report, args.quick, args.repeat
    )
    synthetic = np.minimum(sample_lengths("lognormal", n, median=512, sigma=1.0), 4096)
    bench(
        "lognormal (median 512, sigma 1)",
        synthetic,
        4096,
        args.window,
        report,
        args.quick,
        args.repeat,
    )
    text = "\n".join(report)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
