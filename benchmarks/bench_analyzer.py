"""The metric analyzer's scaling with worker processes: ``-j 0, 1, 2`` and beyond the cores.

    PYTHONPATH=src python benchmarks/bench_analyzer.py            # 200k documents
    PYTHONPATH=src python benchmarks/bench_analyzer.py --quick    # 40k documents, < 1 minute

A token corpus in memory (memmap of uint16 tokens, documents of 50-1,000 tokens) and the
metrics ``meshfeed analyze`` computes by default for curricula: ``seqlen`` and
``vocab_rarity`` (two passes: the token histogram, then the rarity). Every ``-j`` is run
``--repeats`` times in turns (0, 1, 2, ..., 0, 1, 2, ...) so that machine noise hits each alike;
the median wall time is reported, with the ratio to ``-j 1`` (targets: ``-j 2`` >= 1.6x ``-j 1``
on 2 cores; ``-j`` beyond the cores never slower than ``-j`` = cores, since the analyzer never
starts more workers than :func:`meshfeed.runtime.available_cores`: see
:func:`meshfeed.curriculum.analyzer.worker_count`). The values are checked to
be bit-identical across every ``-j``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from meshfeed.curriculum import analyze, seqlen, vocab_rarity
from meshfeed.curriculum.analyzer import default_chunk_size, worker_count
from meshfeed.runtime import available_cores

VOCAB = 50_000


class Corpus:
    """Documents as slices of one uint16 memmap (like a Megatron ``.bin``); picklable."""

    def __init__(self, path: str, offsets: np.ndarray) -> None:
        self.path, self.offsets = path, offsets
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "offsets": self.offsets}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["offsets"])  # type: ignore[misc]


def _cpu() -> float:
    """CPU seconds of this process and of its joined children so far."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _runnable() -> int:
    """Runnable processes on the machine other than this one (``procs_running``)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running"):
                return int(line.split()[1]) - 1
    return 0


def wait_idle(limit: float, *, settle: float = 2.0) -> bool:
    """Wait (at most ``limit`` s) until no other process has been runnable for ``settle`` s,
    sampled every 0.1 s; whether that happened. Not on Linux: returns False at once."""
    if not os.path.exists("/proc/stat"):
        return False
    deadline = time.monotonic() + limit
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        if _runnable() > 0:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settle:
            return True
        time.sleep(0.1)
    return False


def make_corpus(directory: str, documents: int) -> Corpus:
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 1000, size=documents)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    path = os.path.join(directory, "tokens.u16")
    tokens = np.memmap(path, dtype=np.uint16, mode="w+", shape=(int(offsets[-1]),))
    tokens[:] = rng.zipf(1.3, size=tokens.size).clip(max=VOCAB - 1)
    tokens.flush()
    return Corpus(path, offsets)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40k documents, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--jobs", type=int, nargs="*", default=None, help="the -j values")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each round, wait up to S seconds for no other runnable process (Linux; "
        "a shared machine's other load otherwise decides the speed-up)",
    )
    args = parser.parse_args(argv)
    documents = 40_000 if args.quick else 200_000
    repeats = args.repeats or (3 if args.quick else 5)
    cores = available_cores()
    jobs = args.jobs or sorted({0, 1, cores, 2 * cores, 8})
    metrics = [seqlen(), vocab_rarity(VOCAB)]
    times: dict[int, list[float]] = {j: [] for j in jobs}
    cpus: dict[int, list[float]] = {j: [] for j in jobs}
    reference: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="meshfeed-bench-") as tmp:
        corpus = make_corpus(tmp, documents)
        load_before = os.getloadavg()[0]
        waited = []
        for _ in range(repeats):
            if args.wait_idle > 0:
                waited.append(wait_idle(args.wait_idle))
            for j in jobs:
                c0 = _cpu()
                t0 = time.perf_counter()
                out = analyze(corpus, metrics, num_workers=j, progress=False)
                times[j].append(time.perf_counter() - t0)
                cpus[j].append(_cpu() - c0)
                got = {k: np.asarray(getattr(v, "values", v)).tobytes() for k, v in out.items()}
                if reference and got != reference:
                    raise AssertionError(f"-j {j} gave different values than -j {jobs[0]}")
                reference = reference or got
                print(f"  -j {j}: {times[j][-1]:.2f}s", file=sys.stderr)
    base = statistics.median(times[1]) if 1 in times else None
    print("# meshfeed analyze: scaling with -j")
    print()
    print(
        f"Command: `PYTHONPATH={os.environ.get('PYTHONPATH', '')} python {' '.join(sys.argv)}`; "
        f"{documents:,} documents, metrics seqlen + vocab_rarity; {cores} cores available "
        f"(os.sched_getaffinity), load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} at the end; median of "
        f"{repeats} runs in turns. Values bit-identical across every -j (checked)."
        + (
            f" Each round waited up to {args.wait_idle:g}s for an idle machine: "
            f"{sum(waited)} of {len(waited)} rounds started idle."
            if waited
            else ""
        )
    )
    print()
    best1 = min(times[1]) if 1 in times else None
    print(
        "| -j | workers started | median s | runs s | speed-up vs -j 1 (medians) "
        "| speed-up vs -j 1 (fastest runs) | CPU s, this process + workers (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    chunks = -(-documents // default_chunk_size(documents))
    for j in jobs:
        m = statistics.median(times[j])
        ratio = f"{base / m:.2f}" if base else "-"
        best = f"{best1 / min(times[j]):.2f}" if best1 else "-"
        runs = ", ".join(f"{t:.2f}" for t in times[j])
        cpu = statistics.median(cpus[j])
        started = worker_count(j, cores=cores, chunks=chunks)
        print(f"| {j} | {started} | {m:.2f} | {runs} | {ratio} | {best} | {cpu:.2f} |")
    print()
    print(
        "CPU seconds show the work itself: equal CPU at every -j means the chunks parallelise "
        "without extra work, and the wall-time speed-up is then bounded by the cores the "
        "machine actually gives this run (shared machines give fewer). The fastest run of "
        "each -j is the one least disturbed by other load; the medians are the headline."
    )


if __name__ == "__main__":
    main()
