"""``meshfeed convert -j N``: tokenizing in worker processes against one process, same run.

Trains a small byte-level BPE with HF ``tokenizers`` on Python's standard library source (real
text nobody here wrote), writes a few MB of it as JSONL, and times ``convert`` with that
``tokenizer.json`` and ``--append-eod`` at ``-j 1`` and ``-j 2`` (medians of ``--repeat``
runs), checking that both write the same bytes. Prints the speedup of 2 workers over 1, and
beside it the speedup the machine gives pure CPU work in 2 processes in the same run (on a
shared machine the second core is not always free: read the first against the second), and
the CPU seconds each run spent (this process and its workers), which do not depend on how busy
the machine is: with both cores free, -j 2 takes about the larger of (workers' CPU / 2) and
this process's CPU.

    python benchmarks/bench_convert.py            # about 8 MB of text
    python benchmarks/bench_convert.py --quick    # about 3 MB
"""

from __future__ import annotations

import argparse
import filecmp
import json
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
from pathlib import Path

from meshfeed.sources.converters.convert import convert


def stdlib_texts(piece: int = 4000) -> list[str]:
    """The standard library's modules, cut at line ends into documents of about ``piece`` chars."""
    lib = Path(json.__file__).parent.parent
    docs: list[str] = []
    for f in sorted(lib.glob("*.py")) + sorted(lib.glob("*/*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        start = 0
        while start < len(text):
            cut = text.find("\n", start + piece)
            stop = len(text) if cut < 0 else cut + 1
            docs.append(text[start:stop])
            start = stop
    return docs


def train_bpe(texts: list[str], path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts[::7], trainer)
    tok.save(str(path))


def write_jsonl(texts: list[str], path: Path, megabytes: float) -> int:
    size, n = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            line = json.dumps({"text": texts[n % len(texts)]}) + "\n"
            f.write(line)
            size += len(line)
            n += 1
    return n


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def cpu_ceiling(n: int = 3_000_000) -> float:
    """Wall time of two CPU-bound tasks one after the other over the same in 2 processes."""
    start = time.perf_counter()
    _spin(n), _spin(n)
    serial = time.perf_counter() - start
    with mp.get_context("fork").Pool(2) as pool:
        pool.map(_spin, [10, 10])  # workers started before the clock
        start = time.perf_counter()
        pool.map(_spin, [n, n], chunksize=1)
        parallel = time.perf_counter() - start
    return serial / parallel


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def timed(src: Path, out: Path, tokenizer: Path, workers: int) -> tuple[float, float, float]:
    """Wall seconds, this process's CPU seconds, its (finished) workers' CPU seconds."""
    own, children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    convert(
        src, out, tokenizer=str(tokenizer), append_eod=True, num_workers=workers, progress=False
    )
    wall = time.perf_counter() - start
    return (
        wall,
        _cpu(resource.RUSAGE_SELF) - own,
        _cpu(resource.RUSAGE_CHILDREN) - children,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 3 MB of text, 3 repeats")
    parser.add_argument("--megabytes", type=float, default=None, help="text to convert")
    parser.add_argument("--repeat", type=int, default=None, help="runs per worker count")
    args = parser.parse_args()
    megabytes = args.megabytes or (3.0 if args.quick else 8.0)
    repeat = args.repeat or (3 if args.quick else 5)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        texts = stdlib_texts()
        train_bpe(texts, folder / "tokenizer.json", vocab_size=8000)
        docs = write_jsonl(texts, folder / "d.jsonl", megabytes)
        times: dict[int, list[tuple[float, float, float]]] = {1: [], 2: []}
        ceilings = []
        for _ in range(repeat):  # interleaved, so load from others hits both alike
            ceilings.append(cpu_ceiling())
            for workers in times:
                times[workers].append(
                    timed(
                        folder / "d.jsonl",
                        folder / f"j{workers}",
                        folder / "tokenizer.json",
                        workers,
                    )
                )
        same = all(
            filecmp.cmp(folder / f"j1.{ext}", folder / f"j2.{ext}", shallow=False)
            for ext in ("bin", "idx")
        )
        one, two = (statistics.median(t[0] for t in times[w]) for w in (1, 2))
        cpu = {w: [statistics.median(t[k] for t in times[w]) for k in (1, 2)] for w in times}
        print(
            f"convert {megabytes:.1f} MB ({docs} documents) with a BPE tokenizer.json, "
            f"--append-eod, medians of {repeat}:"
        )
        print(f"  -j 1: {one:.2f} s   -j 2: {two:.2f} s   speedup {one / two:.2f}x")
        print(
            f"  pure CPU work in 2 processes on this machine now: "
            f"{statistics.median(ceilings):.2f}x (the most -j 2 can reach)"
        )
        print(
            f"  CPU seconds: -j 1 {cpu[1][0]:.2f} in this process; -j 2 {cpu[2][1]:.2f} in 2 "
            f"workers + {cpu[2][0]:.2f} here -> on 2 free cores about "
            f"{cpu[1][0] / max(cpu[2][1] / 2, cpu[2][0]):.2f}x"
        )
        print(f"  same .bin/.idx bytes for -j 1 and -j 2: {same}")
        if not same:
            raise SystemExit("-j 1 and -j 2 wrote different bytes")


if __name__ == "__main__":
    main()
