"""Open-time validation of a Megatron indexed corpus: the cost of checking every document.

Writes a synthetic ``.idx`` of N one-token documents (and its ``.bin``) once, then times
``TokenCorpus.open`` (which checks every size, pointer and document index, vectorised) against
reading the header and mapping the arrays alone (what opening cost before validation), in
the same run.

    python benchmarks/bench_corpus_open.py            # N = 10**8 (about 2.2 GB on disk)
    python benchmarks/bench_corpus_open.py --quick    # N = 10**6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from meshfeed.sources.tokens.indexed import _HEADER, HEADER_SIZE, MAGIC, VERSION, TokenCorpus


def write(prefix: Path, n: int, chunk: int = 1 << 22) -> None:
    with open(f"{prefix}.idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, 1, n, n + 1))
        for lo in range(0, n, chunk):
            f.write(np.ones(min(chunk, n - lo), "<i4").tobytes())
        for lo in range(0, n, chunk):
            f.write(np.arange(lo, min(lo + chunk, n), dtype="<i8").tobytes())
        for lo in range(0, n + 1, chunk):
            f.write(np.arange(lo, min(lo + chunk, n + 1), dtype="<i8").tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(n)  # n one-byte tokens (sparse file)


def map_only(prefix: Path) -> int:
    raw = np.memmap(f"{prefix}.idx", np.uint8, mode="r")
    n = int(np.frombuffer(raw[:HEADER_SIZE].tobytes()[18:26], "<u8")[0])
    sizes = np.frombuffer(raw, np.int32, n, HEADER_SIZE)
    return int(sizes.shape[0])


def best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10**6 documents")
    parser.add_argument("--documents", type=int, default=None)
    args = parser.parse_args()
    n = args.documents or (10**6 if args.quick else 10**8)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "c"
        write(prefix, n)
        repeats = 3
        validated = best(lambda: TokenCorpus.open(prefix), repeats)
        mapped = best(lambda: map_only(prefix), repeats)
    print(f"documents={n:,}")
    print(f"open with validation: {validated:.3f} s ({validated / n * 1e9:.2f} ns/document)")
    print(f"header + map only:    {mapped:.4f} s")
    print(f"ratio validated/map-only: {validated / max(mapped, 1e-9):.0f}x")


if __name__ == "__main__":
    main()
