"""Token-window throughput from a Megatron-format corpus (issue 3, section 8, benchmarks 1-2).

1. ``TokenWindows.fetch_batch`` on shuffled windows (batch 8 x 2048 tokens) against numpy
   copies of the same windows into a fresh array of the same output dtype per batch (the
   target: >= 80 %), and against the physical limit: a plain numpy copy of the same number of
   bytes out of the same memory map.
   Then the cost of one call on a tiny batch (4 windows of 17 tokens), against a numpy gather
   of the same rows from a strided view made once: the per-call checks and view lookup (#32).
2. The same windows through ``meshfeed.DataLoader`` (which calls ``fetch_batch``: one vectorised
   read per batch) against ``torch.utils.data.DataLoader`` + ``DistributedSampler`` over a
   typical per-sample memmap dataset (``__getitem__`` returns one window, default collate), at
   0 and 2 workers. Both loaders run as data rank 0 of 2 and read the same number of batches;
   rates are measured after a few warm-up batches (worker start-up excluded for both).

The corpus (random uint16 tokens; >= 1 GB, ~100 MB with ``--quick``) is generated in a
temporary directory with ``write_indexed`` and deleted afterwards. The page cache is warm.

    PYTHONPATH=src python benchmarks/bench_tokens.py            # ~1 GB corpus
    PYTHONPATH=src python benchmarks/bench_tokens.py --quick    # ~100 MB corpus
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, DistributedSampler

from meshfeed.loader import DataLoader
from meshfeed.order.permutation import Permutation
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenWindows

SEQ_LEN = 2048
BATCH = 8


def random_documents(total_tokens: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Documents of 100..8000 random uint16 tokens, generated in 16M-token chunks."""
    rng = np.random.default_rng(seed)
    left = total_tokens
    while left > 0:
        chunk = rng.integers(0, 65535, min(left, 1 << 24), dtype=np.uint16)
        left -= chunk.size
        cuts = np.cumsum(rng.integers(100, 8000, chunk.size // 100 + 1))
        cuts = cuts[cuts < chunk.size]
        yield from np.split(chunk, cuts)


class MemmapWindows(Dataset):  # type: ignore[type-arg]
    """The usual per-sample dataset: one memmap slice per ``__getitem__``, collated by torch."""

    def __init__(self, bin_path: str, num_tokens: int, seq_len: int) -> None:
        self.bin_path, self.num_tokens, self.seq_len = bin_path, num_tokens, seq_len
        self.data: np.ndarray | None = None

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.data is None:  # opened lazily so each worker maps the file itself
            self.data = np.memmap(self.bin_path, dtype=np.uint16, mode="r")
        start = i * self.seq_len
        return torch.from_numpy(self.data[start : start + self.seq_len + 1].astype(np.int64))


def timed(batches: Iterator[Any], n: int, warmup: int) -> float:
    """Seconds for ``n`` batches after ``warmup`` batches have been taken."""
    for _ in range(warmup):
        next(batches)
    t0 = time.perf_counter()
    for _ in range(n):
        next(batches)
    return time.perf_counter() - t0


def _interleaved_times(paths: list[tuple[str, Any]], reps: int) -> dict[str, list[float]]:
    """``reps`` timed runs of every path, interleaved (every path once per round) so that load
    drifting on a shared machine hits all paths alike; one untimed warm-up round first."""
    times: dict[str, list[float]] = {name: [] for name, _ in paths}
    for r in range(reps + 1):
        for name, fn in paths:
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return times


def bench_fetch(
    corpus: TokenCorpus, n_batches: int, reps: int
) -> list[tuple[str, float, float, float, float]]:
    """(name, windows/s, GB/s, slowest and fastest windows/s) per path, median of ``reps``.

    Every path runs ``reps`` times over the same bytes after one warm-up round that also maps
    the pages; the median run counts, for the copies and for meshfeed alike.
    """
    window_bytes = (SEQ_LEN + 1) * corpus.dtype.itemsize
    stream = corpus.tokens
    n_windows = n_batches * BATCH

    # the same number of bytes as n_batches batches, copied contiguously, batch-sized
    small = np.empty(BATCH * (SEQ_LEN + 1), dtype=corpus.dtype)
    starts = (
        (np.arange(n_batches, dtype=np.int64) * small.shape[0]) % (stream.shape[0] - small.shape[0])
    ).tolist()

    def copy_small() -> None:
        for s in starts:
            np.copyto(small, stream[s : s + small.shape[0]])

    # ... and in 64 MB chunks: the memory-bandwidth limit of one core
    big = np.empty(min(1 << 25, stream.shape[0]), dtype=corpus.dtype)
    total = n_windows * (SEQ_LEN + 1)

    def copy_big() -> None:
        done = 0
        while done < total:
            lo = done % (stream.shape[0] - big.shape[0] + 1)
            np.copyto(big, stream[lo : lo + big.shape[0]])
            done += big.shape[0]

    # ... and window by window, at the same shuffled positions meshfeed reads, into one reused
    # row of the corpus dtype (no batching, no validation, no tensor): the floor for random
    # 4 KB reads from the page cache. It was the reference of earlier rounds; it writes a
    # quarter of the bytes an int64 batch holds and never allocates, so it is shown, not
    # compared against.
    perm0 = Permutation((stream.shape[0] - 1) // SEQ_LEN, seed=0)
    shuffled = (perm0[np.arange(n_windows, dtype=np.int64) % perm0.n] * SEQ_LEN).tolist()
    row = np.empty(SEQ_LEN + 1, dtype=corpus.dtype)

    def copy_windows() -> None:
        for s in shuffled:
            row[:] = stream[s : s + SEQ_LEN + 1]

    paths: list[tuple[str, Any]] = [
        ("numpy copy, batch-sized chunks", copy_small),
        ("numpy copy, 64 MB chunks", copy_big),
        ("numpy copy, same windows, one row", copy_windows),
    ]
    # The references fetch_batch is held to: the same shuffled windows, batch by batch, into a
    # fresh array of the same output dtype per batch, handed to torch (fetch_batch returns a
    # new tensor each call), written the two ways a numpy user would: a slice copy per window
    # (casting on the fly), or one fancy-index gather of a strided window view then astype.
    # The faster one counts. No bounds checks (fetch_batch checks every index).
    n_tok = (stream.shape[0] - 1) // SEQ_LEN
    rows_view = np.lib.stride_tricks.as_strided(
        stream, (n_tok, SEQ_LEN + 1), (SEQ_LEN * stream.itemsize, stream.itemsize), writeable=False
    )
    batch_starts = [shuffled[k : k + BATCH] for k in range(0, n_windows, BATCH)]
    batch_idx = [np.asarray(b, dtype=np.int64) // SEQ_LEN for b in batch_starts]
    for dtype in (torch.int64, torch.uint16):
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype

        def copy_slices(np_dtype: np.dtype[Any] = np_dtype) -> None:
            for b in batch_starts:
                out = np.empty((BATCH, SEQ_LEN + 1), np_dtype)
                for k, s in enumerate(b):
                    out[k] = stream[s : s + SEQ_LEN + 1]
                torch.from_numpy(out)

        def copy_fancy(np_dtype: np.dtype[Any] = np_dtype) -> None:
            for b in batch_idx:
                torch.from_numpy(rows_view[b].astype(np_dtype, copy=False))

        short = str(dtype).removeprefix("torch.")
        paths.append((f"numpy slices, same windows -> {short}", copy_slices))
        paths.append((f"numpy gather, same windows -> {short}", copy_fancy))
    for dtype in (torch.int64, torch.uint16):
        windows = TokenWindows(corpus, seq_len=SEQ_LEN, dtype=dtype)
        perm = Permutation(len(windows), seed=0)
        idx = perm[np.arange(n_windows, dtype=np.int64) % len(windows)].reshape(-1, BATCH)
        if (idx.reshape(-1) * SEQ_LEN).tolist() != shuffled:
            raise RuntimeError("the numpy references must read the windows fetch_batch reads")

        def fetch(windows: TokenWindows = windows, idx: np.ndarray = idx) -> None:
            for b in idx:
                windows.fetch_batch(b)

        paths.append((f"meshfeed fetch_batch -> {str(dtype).removeprefix('torch.')}", fetch))
    rows = []
    for name, ts in _interleaved_times(paths, reps).items():
        dt = statistics.median(ts)
        rows.append(
            (
                name,
                n_windows / dt,
                n_windows * window_bytes / dt / 1e9,
                n_windows / max(ts),
                n_windows / min(ts),
            )
        )
    return rows


def bench_call_cost(corpus: TokenCorpus, calls: int, reps: int) -> tuple[float, float]:
    """Microseconds per ``fetch_batch`` of a tiny batch (4 windows of 17 tokens: the per-call
    work, checks and view lookup, not the copy) and per numpy gather of the same rows from a
    strided view made once, into a tensor; the fastest of ``reps`` interleaved runs."""
    windows = TokenWindows(corpus, seq_len=16, dtype=torch.uint16)
    stream = corpus.tokens
    view = np.lib.stride_tricks.as_strided(
        stream, (len(windows), 17), (16 * stream.itemsize, stream.itemsize), writeable=False
    )
    idx = np.array([5, 9, 1, 7])

    def ours() -> None:
        for _ in range(calls):
            windows.fetch_batch(idx)

    def gather() -> None:
        for _ in range(calls):
            torch.from_numpy(view[idx])

    times = _interleaved_times([("ours", ours), ("numpy", gather)], reps)
    return min(times["ours"]) / calls * 1e6, min(times["numpy"]) / calls * 1e6


def loader_iter(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def bench_loaders(corpus: TokenCorpus, n_batches: int, warmup: int) -> list[tuple[str, int, float]]:
    """(name, workers, windows/s) for meshfeed.DataLoader and torch DataLoader + DistributedSampler."""
    rows = []
    windows = TokenWindows(corpus, seq_len=SEQ_LEN)
    baseline = MemmapWindows(str(corpus.bin_path), corpus.num_tokens, SEQ_LEN)
    for workers in (0, 2):
        mf = DataLoader(
            windows, batch_size=BATCH, mesh={"dp": 2}, rank=0, seed=0, num_workers=workers
        )
        try:
            dt = timed(loader_iter(mf), n_batches, warmup)
        finally:
            mf.shutdown()
        rows.append(("meshfeed DataLoader (fetch_batch)", workers, n_batches * BATCH / dt))
        sampler = DistributedSampler(baseline, num_replicas=2, rank=0, shuffle=True, seed=0)
        tl = TorchDataLoader(
            baseline,
            batch_size=BATCH,
            sampler=sampler,
            num_workers=workers,
            drop_last=True,
            persistent_workers=workers > 0,
        )
        dt = timed(loader_iter(tl), n_batches, warmup)
        rows.append(("torch DataLoader + DistributedSampler", workers, n_batches * BATCH / dt))
        del tl
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="~100 MB corpus, fewer batches")
    parser.add_argument("--gb", type=float, default=None, help="corpus size in GB (default 1.05)")
    parser.add_argument("--dir", default=None, help="where to write the temporary corpus")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per path (median)")
    parser.add_argument(
        "--fetch-only", action="store_true", help="only section 1 (fetch_batch vs numpy copies)"
    )
    args = parser.parse_args()
    gb = args.gb if args.gb is not None else (0.1 if args.quick else 1.05)
    fetch_batches = 3_000 if args.quick else 20_000
    loader_batches = 500 if args.quick else 2_000
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="meshfeed-bench-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        corpus = write_indexed(tmp / "corpus", random_documents(int(gb * 1e9) // 2), np.uint16)
        size = corpus.bin_path.stat().st_size
        print(
            f"corpus: {size / 1e9:.2f} GB, {corpus.num_documents} documents, "
            f"{corpus.num_tokens} uint16 tokens (written in {time.perf_counter() - t0:.1f}s); "
            f"batch {BATCH} x {SEQ_LEN + 1} tokens"
        )
        print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        reps = args.reps or (5 if args.quick else 7)
        print(
            f"\n1. windows from the memory map ({fetch_batches} shuffled batches, median of "
            f"{reps} interleaved runs; range = slowest..fastest run)"
        )
        rows = bench_fetch(corpus, fetch_batches, reps=reps)
        by_name = {r[0]: r for r in rows}
        limit = max(rows[0][2], rows[1][2])  # the faster sequential copy: the physical limit
        floor = rows[2][1]
        print(
            f"{'path':<36} {'windows/s':>12} {'range':>19} {'GB/s':>6} {'vs copy':>8} "
            f"{'vs one row':>11} {'vs same dtype':>14}"
        )
        for name, wps, gbs, lo, hi in rows:
            same = ""
            if name.startswith("meshfeed"):
                short = name.rsplit(" ", 1)[-1]
                ref = max(
                    by_name[f"numpy {how}, same windows -> {short}"][1]
                    for how in ("slices", "gather")
                )
                same = f"{wps / ref:.0%}"
            print(
                f"{name:<36} {wps:>12,.0f} {lo / 1e3:>8,.0f}k..{hi / 1e3:>6,.0f}k {gbs:>6.2f} "
                f"{gbs / limit:>7.0%} {wps / floor:>11.0%} {same:>14}"
            )
        print(
            "GB/s counts the corpus bytes read; 'vs same dtype' is against the faster numpy "
            "reference writing the same output dtype into a fresh array (as a tensor) per batch"
        )
        ours, gather = bench_call_cost(corpus, 2_000 if args.quick else 20_000, reps)
        print(
            f"per call, 4 windows of 17 tokens (fastest of {reps}): meshfeed fetch_batch "
            f"{ours:.1f} us, numpy gather from a view made once {gather:.1f} us "
            f"(+{ours - gather:.1f} us: checks and the map's view)"
        )
        if args.fetch_only:
            return
        print(f"\n2. loaders, data rank 0 of 2 ({loader_batches} batches after 20 warm-up)")
        lrows = bench_loaders(corpus, loader_batches, warmup=20)
        print(f"{'loader':<38} {'workers':>7} {'windows/s':>12} {'speed-up':>9}")
        for k in range(0, len(lrows), 2):
            (mname, w, mrate), (tname, _, trate) = lrows[k], lrows[k + 1]
            print(f"{tname:<38} {w:>7} {trate:>12,.0f} {1.0:>8.2f}x")
            print(f"{mname:<38} {w:>7} {mrate:>12,.0f} {mrate / trate:>8.2f}x")
        print(f"\nload average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
