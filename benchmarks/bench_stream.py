"""Streaming throughput: meshfeed's StreamLoader vs a plain Python loop over the same shards.

Two shard formats, written once to a temp directory:

- ``npy``: token rows (``int32[seq_len]``) in ``.npy`` shards, read through a memory map (cheap
  per row: the loop measures per-row and per-batch overhead); meshfeed reads them with a
  reader of a dozen lines that has ``take`` (rows by index: one gather per batch);
- ``jsonl``: JSON lines ``{"id": ..., "tokens": [...]}`` (parsing dominates: CPU-bound);
  meshfeed reads them with its default reader (no user code: rows by index through a
  line-offset table), the plain loop line by line; both collate with the same function.

For each format it measures, in the same run:

- ``plain loop``: the physical limit: the same reader over every shard, rows grouped into
  lists of ``batch_size`` and collated with meshfeed's ``default_collate``, in one process;
- ``plain loop +shuffle``: the same with the shuffle buffer a user would write (1,024 rows,
  ``random.Random`` draws, swap-in-place, drained at the end): what a buffer costs on this
  reader whoever writes it (rows kept alive for a thousand draws are slower to make, free and
  collate than rows dropped at once);
- ``meshfeed w=0``: ``StreamLoader(num_workers=0)``;
- ``meshfeed w=0 +shuffle``: the same with 1,024-row shuffle windows (an arithmetic
  permutation per window: the counterpart of a 1,024-row shuffle buffer, with no rows held);
- ``meshfeed w=2``: ``StreamLoader(num_workers=2)`` (worker start-up included);

then, per format, the cost of a checkpoint: the state's size in bytes and the time from a new
loader to its first batch after ``load_state_dict`` of a state taken half-way through the
epoch (0 and 2 workers; median of the rounds).

and prints samples/s, batches/s, the main process's CPU time per batch, the cores the run
used (CPU seconds of the main process and its finished workers per wall second), the ratio to
the plain loop and, for the shuffled rows, the cost of the shuffle buffer against the same path without
it (median of 5 interleaved rounds, 3 with ``--quick``; the range is the slowest..fastest
round, since the machine may be shared). The header reports how many cores two busy processes
actually got just before (``effective cores``): worker rows can beat the plain loop only by
that much, and on a shared machine it may be far below the core count.

    PYTHONPATH=src python benchmarks/bench_stream.py [--quick] [--jsonl-rows N]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshfeed.collate import default_collate
from meshfeed.sources.stream import ShardedStream
from meshfeed.sources.stream_readers import DefaultReader
from meshfeed.stream_loader import StreamLoader


class NpyReader:
    """``.npy`` shards through a memory map kept per file: rows by index (``take``) or by range."""

    def __init__(self) -> None:
        self._maps: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._maps = {}

    def _map(self, path: str) -> np.ndarray:
        if path not in self._maps:
            self._maps[path] = np.load(path, mmap_mode="r")
        return self._maps[path]

    def __call__(self, path: str, start: int, stop: int | None) -> Iterator[np.ndarray]:
        arr = self._map(path)
        for i in range(start, len(arr) if stop is None else stop):
            yield np.asarray(arr[i])

    def take(self, path: str, rows: np.ndarray) -> list[np.ndarray]:
        return list(self._map(path)[np.sort(rows)][np.argsort(np.argsort(rows))])

    def count(self, path: str) -> int:
        return len(self._map(path))


def npy_rows(path: str) -> Iterator[np.ndarray]:
    arr = np.load(path, mmap_mode="r")
    for i in range(len(arr)):
        yield np.asarray(arr[i])


def jsonl_rows(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def collate_jsonl(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {
        "id": torch.tensor([r["id"] for r in rows]),
        "tokens": torch.tensor(np.array([r["tokens"] for r in rows], dtype=np.int32)),
    }


def write_shards(root: Path, fmt: str, shards: int, rows: int, seq_len: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for s in range(shards):
        data = rng.integers(0, 50_000, size=(rows, seq_len), dtype=np.int32)
        if fmt == "npy":
            path = root / f"shard-{s:03d}.npy"
            np.save(path, data)
        else:
            path = root / f"shard-{s:03d}.jsonl"
            with open(path, "w", encoding="utf-8") as f:
                for i, row in enumerate(data):
                    f.write(json.dumps({"id": s * rows + i, "tokens": row.tolist()}) + "\n")
        paths.append(str(path))
    return paths


def plain_loop(
    paths: list[str],
    rows: Callable[[str], Iterator[Any]],
    collate: Callable[..., Any],
    batch_size: int,
) -> int:
    batches = 0
    batch: list[Any] = []
    for path in paths:
        for row in rows(path):
            batch.append(row)
            if len(batch) == batch_size:
                collate(batch)
                batches += 1
                batch = []
    return batches


def plain_shuffled_loop(
    paths: list[str],
    rows: Callable[[str], Iterator[Any]],
    collate: Callable[..., Any],
    batch_size: int,
    size: int,
) -> int:
    rng = random.Random(1)
    buffer: list[Any] = []
    batches = 0
    batch: list[Any] = []

    def emit(row: Any) -> None:
        nonlocal batch, batches
        batch.append(row)
        if len(batch) == batch_size:
            collate(batch)
            batches += 1
            batch = []

    for path in paths:
        for row in rows(path):
            if len(buffer) < size:
                buffer.append(row)
                continue
            j = rng.randrange(size)
            emit(buffer[j])
            buffer[j] = row
    rng.shuffle(buffer)
    for row in buffer:
        emit(row)
    return batches


def _spin(seconds: float) -> float:
    end, x = time.perf_counter() + seconds, 0
    t0 = time.process_time()
    while time.perf_counter() < end:
        x += 1
    return time.process_time() - t0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def effective_cores(seconds: float = 0.3) -> float:
    """CPU seconds two busy processes got per wall second (2.0 on two idle cores)."""
    with mp.get_context("fork").Pool(2) as pool:
        t0 = time.perf_counter()
        cpu = sum(pool.map(_spin, [seconds, seconds]))
        return cpu / (time.perf_counter() - t0)


def meshfeed_loop(stream: ShardedStream, batch_size: int, workers: int, collate: Any) -> int:
    with StreamLoader(
        stream, batch_size=batch_size, num_workers=workers, seed=1, collate_fn=collate
    ) as lo:
        return sum(1 for _ in lo)


def resume_cost(
    stream: ShardedStream, batch_size: int, workers: int, collate: Any
) -> tuple[float, int]:
    """(seconds from a new loader to its first batch after loading a half-epoch state,
    bytes of that state as JSON)."""
    lo = StreamLoader(stream, batch_size=batch_size, seed=1, collate_fn=collate)
    half = len(lo) // 2
    state = json.loads(json.dumps(lo.state_dict()))
    state["position"] = half * batch_size
    t0 = time.perf_counter()
    with StreamLoader(
        stream, batch_size=batch_size, num_workers=workers, seed=1, collate_fn=collate
    ) as again:
        again.load_state_dict(state)
        next(iter(again))
        took = time.perf_counter() - t0
    return took, len(json.dumps(state))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, one repeat")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--jsonl-rows",
        type=int,
        default=2_500,
        help="rows per jsonl shard (more: the workers' start-up weighs less)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Every loader made here drops the same short tail batches the plain loop drops, and would
    # say so once per loader (the unread-rows warning); the table is the output here.
    logging.getLogger("meshfeed").setLevel(logging.ERROR)
    shards, seq_len, repeats = (4, 128, 3) if args.quick else (8, 512, 5)
    # jsonl: enough rows that two workers' start (a fork each, ~10-40 ms) is not the whole run
    rows = {"npy": 2_000 if args.quick else 12_000, "jsonl": args.jsonl_rows}
    row_fns = {"npy": npy_rows, "jsonl": jsonl_rows}
    collates: dict[str, Any] = {"npy": default_collate, "jsonl": collate_jsonl}
    print(
        f"streaming throughput: {shards} shards, seq_len {seq_len}, batch {args.batch_size}, "
        f"median of {repeats}; {torch.get_num_threads()} torch thread(s); effective cores "
        f"for 2 processes: {effective_cores():.2f} of {len(os.sched_getaffinity(0))}"
    )
    header = (
        f"{'format':6} {'loader':24} {'samples/s':>11} {'range':>17} {'batches/s':>10} "
        f"{'main us/b':>10} {'cores':>6} {'vs plain':>9} {'buffer cost':>12}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("npy", "jsonl"):
            root = Path(tmp) / fmt
            root.mkdir()
            paths = write_shards(root, fmt, shards, rows[fmt], seq_len)
            rows_of, collate = row_fns[fmt], collates[fmt]
            reader = NpyReader() if fmt == "npy" else DefaultReader()
            plain = ShardedStream(paths, reader, rows=[rows[fmt]] * shards)
            shuffled = ShardedStream(paths, reader, shuffle_buffer=1024, rows=[rows[fmt]] * shards)
            # a collate_fn for the stream only where rows need one (npy rows are arrays)
            mcol = None if fmt == "npy" else collate
            B = args.batch_size
            runs: list[tuple[str, Callable[[], int]]] = [
                ("plain loop", lambda p=paths, r=rows_of, c=collate, B=B: plain_loop(p, r, c, B)),
                (
                    "plain loop +shuffle",
                    lambda p=paths, r=rows_of, c=collate, B=B: plain_shuffled_loop(
                        p, r, c, B, 1024
                    ),
                ),
                ("meshfeed w=0", lambda s=plain, c=mcol, B=B: meshfeed_loop(s, B, 0, c)),
                (
                    "meshfeed w=0 +shuffle",
                    lambda s=shuffled, c=mcol, B=B: meshfeed_loop(s, B, 0, c),
                ),
                ("meshfeed w=2", lambda s=plain, c=mcol, B=B: meshfeed_loop(s, B, 2, c)),
            ]
            # Repeats are interleaved (every loader once per round) so that load drifting on
            # a shared machine affects all loaders alike; the median round counts.
            times: dict[str, list[float]] = {name: [] for name, _ in runs}
            cpu: dict[str, list[float]] = {name: [] for name, _ in runs}
            cores: dict[str, list[float]] = {name: [] for name, _ in runs}
            counts = {}
            for _ in range(repeats):
                for name, fn in runs:
                    t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu()
                    counts[name] = fn()
                    wall = time.perf_counter() - t0
                    times[name].append(wall)
                    cpu[name].append(time.process_time() - c0)
                    cores[name].append((cpu[name][-1] + _children_cpu() - k0) / wall)

            def rate(
                name: str, t: float | None = None, counts: dict[str, int] = counts, times=times
            ) -> float:
                return counts[name] / (statistics.median(times[name]) if t is None else t)

            base = rate("plain loop")
            for name, _ in runs:
                bps = rate(name)
                lo, hi = rate(name, max(times[name])), rate(name, min(times[name]))
                cost = ""
                if name.endswith(" +shuffle"):
                    cost = f"{1 - bps / rate(name.removesuffix(' +shuffle')):11.0%}"
                main_us = statistics.median(cpu[name]) / counts[name] * 1e6
                print(
                    f"{fmt:6} {name:24} {bps * args.batch_size:11,.0f} "
                    f"{lo * args.batch_size / 1e3:>7,.0f}k..{hi * args.batch_size / 1e3:>6,.0f}k "
                    f"{bps:10,.1f} {main_us:10,.1f} {statistics.median(cores[name]):6.2f} "
                    f"{bps / base:8.2f}x {cost:>12}"
                )
            for workers in (0, 2):
                costs = [resume_cost(shuffled, B, workers, mcol) for _ in range(repeats)]
                print(
                    f"{fmt:6} resume at half the epoch, {workers} workers: first batch after "
                    f"{statistics.median(c[0] for c in costs) * 1e3:.1f} ms; state "
                    f"{costs[0][1]} bytes"
                )


if __name__ == "__main__":
    main()
