"""Streaming throughput: meshfeed's StreamLoader vs a plain Python loop over the same shards.

Two shard formats, written once to a temp directory:

- ``npy``: token rows (``int32[seq_len]``) in ``.npy`` shards, read through a memory map (cheap
  per row: the loop measures per-row and per-batch overhead); meshfeed reads them with a
  reader of a dozen lines that has ``take`` (rows by index: one gather per batch);
- ``jsonl``: JSON lines ``{"id": ..., "tokens": [...]}`` (parsing dominates: CPU-bound);
  meshfeed reads them with its default reader (no user code: rows by index through a
  line-offset table), the plain loop line by line; both collate with the same function.

For each format it measures, in the same run:

- ``plain loop``: the loop a user would write first: the same reader over every shard, row
  by row, rows grouped into lists of ``batch_size`` and collated with meshfeed's
  ``default_collate``, in one process. It is not the same work as meshfeed's npy path, which
  gathers a batch's rows at once with the reader's ``take`` (and is not a physical limit: a
  hand-written batched gather would be faster than this loop);
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
the plain loop (what a user gets over that loop, not a bound) and, for the shuffled rows, the cost of the shuffle buffer against the same path without
it (median of 5 interleaved rounds, 3 with ``--quick``; the range is the slowest..fastest
round, since the machine may be shared). The header reports how many cores two busy processes
actually got just before (``effective cores``): on a shared machine it may be far below the
core count.

Then the shard formats with an index, on bench_shards' samples (``{"tokens": int32[128..2048],
"pixels": uint8[4096]}``, fixed seed; 40,000 samples, 4,000 with ``--quick``), each written
into ~``--shard-mib`` MiB shards in this process and read for one shuffled epoch, batches of
32 kept as lists (the rows are ragged), by each system's own loader at 0 and 2 workers:
meshfeed shards (``write_shards``, raw and zstd; ``ShardedStream.from_index`` with 4,096-row
shuffle windows + ``StreamLoader``), MosaicML Streaming (``MDSWriter``; ``StreamingDataset``
in a torch ``DataLoader``), litdata (``optimize``; ``StreamingDataset`` in its
``StreamingDataLoader``) and WebDataset (``ShardWriter`` of ``.npy`` fields; ``WebDataset``
with shard shuffle and a 1,000-sample buffer, decoded, in a torch ``DataLoader``). Reported:
write seconds, MiB on disk, samples/s (worker start-up included) and a check that the epoch
served every sample once (row and token counts). A peer that does not import is skipped with
the reason (MosaicML Streaming and litdata pin an older numpy: run the script in their
environment with ``PYTHONPATH=src``).

    PYTHONPATH=src python benchmarks/bench_stream.py [--quick] [--jsonl-rows N] [--shard-rows N]
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
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_shards
from meshfeed.collate import default_collate
from meshfeed.sources.streams.readers import DefaultReader
from meshfeed.sources.streams.stream import ShardedStream
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


# --- shard formats with an index: meshfeed shards vs the peers -------------------------------


def keep(batch: list[Any]) -> list[Any]:
    """Every shard-format loader's collate: ragged rows, so a batch stays a list of samples."""
    return batch


def tally(batches: Any, tokens_key: str = "tokens") -> tuple[int, int]:
    samples = tokens = 0
    for batch in batches:
        samples += len(batch)
        tokens += sum(len(s[tokens_key]) for s in batch)
    return samples, tokens


def mf_write(out: Path, compression: str | None) -> None:
    from meshfeed.sources import write_shards as write

    assert bench_shards.DATA is not None
    write(
        iter(bench_shards.DATA),
        out,
        bytes_per_shard=bench_shards.SHARD_BYTES,
        compression=compression,
    )


def mf_read(out: Path, workers: int) -> tuple[int, int]:
    stream = ShardedStream.from_index(out, shuffle_buffer=4096)
    with StreamLoader(
        stream, batch_size=32, num_workers=workers, seed=1, drop_last=False, collate_fn=keep
    ) as loader:
        return tally(loader)


def mosaic_read(out: Path, workers: int) -> tuple[int, int]:
    ds = bench_shards.mosaic_dataset(out, shuffle=True)
    return tally(
        torch.utils.data.DataLoader(ds, batch_size=32, num_workers=workers, collate_fn=keep)
    )


def litdata_read(out: Path, workers: int) -> tuple[int, int]:
    import litdata

    ds = bench_shards.litdata_dataset(out, shuffle=True)
    return tally(
        litdata.StreamingDataLoader(ds, batch_size=32, num_workers=workers, collate_fn=keep)
    )


def wds_write(out: Path, compression: str | None) -> None:
    import webdataset as wds

    assert bench_shards.DATA is not None
    out.mkdir(parents=True)
    with wds.ShardWriter(
        str(out / "shard-%06d.tar"), maxsize=bench_shards.SHARD_BYTES, maxcount=10**9, verbose=0
    ) as sink:
        for i, s in enumerate(bench_shards.DATA):
            sink.write(
                {"__key__": f"{i:09d}", "tokens.npy": s["tokens"], "pixels.npy": s["pixels"]}
            )


def wds_read(out: Path, workers: int) -> tuple[int, int]:
    import webdataset as wds

    urls = sorted(str(p) for p in out.glob("*.tar"))
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=1)
        .shuffle(1000)
        .decode()
    )
    return tally(
        torch.utils.data.DataLoader(ds, batch_size=32, num_workers=workers, collate_fn=keep),
        "tokens.npy",
    )


def import_wds() -> tuple[Any, str]:
    try:
        import webdataset
    except ImportError as e:
        return None, f"not installed ({e}); pip install webdataset"
    return webdataset, getattr(webdataset, "__version__", "?")


def shard_formats(rows: int, shard_mib: int) -> None:
    """The table of the shard formats with an index (module docstring)."""
    logging.getLogger("concurrent.futures").setLevel(logging.CRITICAL)
    data = bench_shards.Data(rows)
    bench_shards.DATA = data
    bench_shards.SHARD_BYTES = shard_mib << 20
    expect = (rows, int(data.offsets[-1]))
    raw = (data.tokens.nbytes + data.pixels.nbytes) / 2**20
    print(
        f"\nshard formats: {rows} samples, {raw:.0f} MiB raw, {shard_mib} MiB shards, batch 32, "
        "shuffled, one epoch each"
    )
    systems: list[tuple[str, Any, Any, tuple[str | None, ...]]] = [
        ("meshfeed shards", mf_write, mf_read, (None, "zstd"))
    ]
    for name, imp, write, read, comps in (
        (
            "mosaic",
            bench_shards.import_mosaic,
            lambda o, c: bench_shards.mosaic_write(o, c),
            mosaic_read,
            (None, "zstd"),
        ),
        (
            "litdata",
            bench_shards.import_litdata,
            lambda o, c: bench_shards.litdata_write(o, c),
            litdata_read,
            (None, "zstd"),
        ),
        ("webdataset", import_wds, wds_write, wds_read, (None,)),
    ):
        mod, note = imp()
        print(f"  {name}: {note}" if mod is not None else f"  {name}: skipped, {note}")
        if mod is not None:
            systems.append((name, write, read, comps))
    header = f"{'system':<22}{'write s':>8}{'MiB':>7}{'w=0 /s':>10}{'w=2 /s':>10}  epoch"
    print(header)
    print("-" * len(header))
    root = Path(tempfile.mkdtemp(prefix="bench-stream-shards-"))
    try:
        for name, write, read, comps in systems:
            for comp in comps:
                out = root / f"{name.replace(' ', '-')}-{comp}"
                t0 = time.perf_counter()
                write(out, comp)
                t_write = time.perf_counter() - t0
                row = f"{name + ' ' + (comp or 'raw'):<22}{t_write:>8.1f}"
                row += f"{bench_shards.disk_mib(out):>7.1f}"
                checks = []
                for workers in (0, 2):
                    t0 = time.perf_counter()
                    try:
                        got = read(out, workers)
                    except Exception as e:  # a peer's failure is a result, not the end
                        row += f"{'failed':>10}"
                        checks.append(f"w={workers}: {type(e).__name__}: {e}"[:200])
                        continue
                    row += f"{got[0] / (time.perf_counter() - t0):>10,.0f}"
                    checks.append("ok" if got == expect else f"w={workers} got {got}")
                print(row + "  " + ", ".join(dict.fromkeys(checks)), flush=True)
                bench_shards.remove(out)
                bench_shards.remove(out.parent / "ld-cache")
    finally:
        bench_shards.remove(root)


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
    parser.add_argument(
        "--shard-rows", type=int, default=None, help="samples of the shard formats (40k; 4k quick)"
    )
    parser.add_argument("--shard-mib", type=int, default=None, help="shard size (32; 8 quick)")
    parser.add_argument("--only-shards", action="store_true", help="only the shard-format table")
    args = parser.parse_args()
    shard_rows = args.shard_rows or (4_000 if args.quick else 40_000)
    shard_mib = args.shard_mib or (8 if args.quick else 32)
    if args.only_shards:
        torch.set_num_threads(1)
        logging.getLogger("meshfeed").setLevel(logging.ERROR)
        shard_formats(shard_rows, shard_mib)
        return
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
    shard_formats(shard_rows, shard_mib)


if __name__ == "__main__":
    main()
