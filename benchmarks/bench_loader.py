"""meshfeed.DataLoader against torch's DataLoader + DistributedSampler and torchdata's
StatefulDataLoader: throughput, per-batch overhead, resume latency and order memory.

    PYTHONPATH=src python benchmarks/bench_loader.py            # full run (a few minutes)
    PYTHONPATH=src python benchmarks/bench_loader.py --quick    # < 1 minute
    PYTHONPATH=src python benchmarks/bench_loader.py --out benchmarks/results/loader_full.md

A full run (not ``--quick``) also writes its throughput and overhead tables, with the command,
date, torch version and load average, to ``benchmarks/results/loader_throughput.txt`` and
``loader_overhead.txt`` (``--results-dir`` elsewhere).

What is measured (every number comes from this run; medians):

1. Throughput (batches/s) on a memmap-backed tokenised dataset (uint16 tokens, fixed windows
   of 2048 tokens, batch 8): the *same* dataset object with the same ``__getitem__`` serves
   both loaders, at 0 and 2 workers (torch with ``persistent_workers=True``, like meshfeed's
   workers, which live as long as the loader; ``prefetch_factor`` default; no pinning on
   either). Each loader is timed alone (``alone_windows``): a fresh loader per repeat, the
   systems one after the other in an order that alternates between repeats, a warm-up longer
   than either loader's read-ahead, then a long steady window inside the first epoch; the
   time to the first batch (worker start-up included) is reported apart. Median and range.
2. Per-batch overhead (order, slicing, fetch calls, collate) with a dataset that returns
   ready tensors, 0 workers: microseconds per batch, wall and CPU time, timed the same way.
3. Resume latency: ``load_state_dict`` + first batch at steps 10, 10**4 and 10**6 on a tiny
   synthetic dataset of 8 * 10**6 + 512 samples. torchdata's ``StatefulDataLoader`` is given
   its real state where iterating there is cheap (steps 10 and 10**4); at 10**6 its state is
   the step-10**4 state with the step counters scaled (checked to reproduce the real state
   at 10**4 from the one at 10). What it does on resume is what it actually does: it
   regenerates the sampler's permutation and fast-forwards the sampler (no fetching).
4. Memory of the order for n = 10**9 samples, measured in a fresh child process (tracemalloc
   peak, and peak-RSS growth), against ``torch.randperm`` (10**7, 10**8) and iterating a
   ``DistributedSampler`` (10**6, 10**7), whose cost at 10**9 is a linear extrapolation (said
   so in the table).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import DistributedSampler

import meshfeed
from meshfeed import DataLoader, DataMesh
from meshfeed.sources import TokenWindows, write_indexed

WINDOW = 2048
BATCH = 8
RESUME_STEPS = (10, 10**4, 10**6)

FIRST_BATCHES = 300
HOT_PATH = (
    "src/meshfeed/loader.py",
    "src/meshfeed/fetch.py",
    "src/meshfeed/collate.py",
    "src/meshfeed/rng.py",
    "src/meshfeed/order",
    "src/meshfeed/services",
)

warnings.filterwarnings("ignore", message=".*set_vital.*")


# --------------------------------------------------------------------------- datasets
class MemmapWindows:
    """Fixed windows of ``WINDOW`` uint16 tokens from a memmap; one int64 tensor per sample."""

    def __init__(self, path: str, num_windows: int) -> None:
        self.path = path
        self.num_windows = num_windows
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r", shape=(num_windows * WINDOW,))

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> torch.Tensor:
        window = self.tokens[i * WINDOW : (i + 1) * WINDOW]
        return torch.from_numpy(window.astype(np.int64))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "num_windows": self.num_windows}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["num_windows"])  # type: ignore[misc]


class ReadyTensors:
    """Returns pre-made tensors (no I/O, no conversion): isolates the loader's own cost."""

    def __init__(self, num_samples: int, width: int) -> None:
        self.num_samples = num_samples
        self.rows = [torch.full((width,), k, dtype=torch.int64) for k in range(64)]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i % 64]


class TinySamples:
    """``n`` samples that are their own index (a Python int): resume cost without I/O."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> int:
        return int(i)


def write_tokens(directory: str, num_windows: int) -> str:
    path = os.path.join(directory, "tokens.u16")
    rng = np.random.default_rng(0)
    tokens = np.memmap(path, dtype=np.uint16, mode="w+", shape=(num_windows * WINDOW,))
    chunk = 1 << 22
    for lo in range(0, tokens.size, chunk):
        hi = min(lo + chunk, tokens.size)
        tokens[lo:hi] = rng.integers(0, 50_000, size=hi - lo, dtype=np.uint16)
    tokens.flush()
    del tokens
    with open(path, "rb") as f:  # warm the page cache: both loaders read from memory
        while f.read(1 << 24):
            pass
    return path


# --------------------------------------------------------------------------- loaders
def meshfeed_loader(ds: Any, *, workers: int = 0, dp: int = 1, rank: int = 0) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=BATCH,
        mesh=DataMesh.from_sizes(dp=dp),
        rank=rank,
        seed=0,
        num_workers=workers,
    )


def torch_loader(ds: Any, *, workers: int = 0, dp: int = 1, rank: int = 0) -> TorchDataLoader:
    sampler: DistributedSampler[Any] = DistributedSampler(
        ds, num_replicas=dp, rank=rank, shuffle=True, seed=0
    )
    return TorchDataLoader(
        ds,
        batch_size=BATCH,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def interleaved_rates(
    streams: dict[str, Iterator[Any]],
    *,
    warmup: int,
    batches: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per batch of each stream, timed in turns (A B A B ...) after a warm-up.

    ``clock=time.process_time`` counts this process's CPU time only: on a shared machine it
    is far less disturbed by other jobs than wall time (meaningful with 0 workers only).
    """
    for it in streams.values():
        for _ in range(warmup):
            next(it)
    out: dict[str, list[float]] = {k: [] for k in streams}
    for _ in range(repeats):
        for name, it in streams.items():
            t0 = clock()
            for _ in range(batches):
                next(it)
            out[name].append((clock() - t0) / batches)
    return out


def first_batches(make: Callable[[], Any], n: int) -> tuple[float, float]:
    """Fresh loader -> seconds to its first batch (worker start-up included), and seconds
    from there to batch ``n`` (the first batches' rate, while message sizes adapt)."""
    loader = make()
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    t1 = time.perf_counter()
    for _ in range(n - 1):
        next(it)
    t2 = time.perf_counter()
    del it
    if hasattr(loader, "shutdown"):
        loader.shutdown()
    return t1 - t0, t2 - t1


def live_threads() -> int:
    """Threads running, but meshfeed's reaper (started once per process where the cycle
    collector frees a loader, then idle): a loader is timed once the last one's are gone."""
    return sum(t.name != "meshfeed-reaper" for t in threading.enumerate())


# --------------------------------------------------------------------------- 1. throughput
def settle(threads: int, timeout: float = 60.0) -> None:
    """Wait until a dropped loader's worker processes and threads are gone, so that the next
    loader is timed alone (torch shuts its persistent workers down when the iterator is
    collected; meshfeed's ``shutdown`` joins them)."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while (mp.active_children() or live_threads() > threads) and (time.monotonic() < deadline):
        time.sleep(0.02)


def alone_windows(
    makers: dict[str, Callable[[], Any]], *, warmup: int, batches: int, repeats: int
) -> dict[str, dict[str, list[float]]]:
    """Each loader timed alone: per repeat, a fresh loader of each system, one after the other
    (the order alternates between repeats: A B, B A, ...), none running while another is timed.

    Per window: ``first_s`` (construction to the first batch, worker start-up included), then
    ``warmup`` batches untimed (more than any loader can hold ready: meshfeed's workers read
    up to workers x prefetch x 16 batches ahead, torch's workers x prefetch_factor; a window
    that drained a full buffer would read above the steady rate), then ``batches`` batches
    timed in wall time (``wall_s``) and in this process's CPU time (``cpu_s``)."""
    names = list(makers)
    out: dict[str, dict[str, list[float]]] = {
        n: {"first_s": [], "wall_s": [], "cpu_s": []} for n in names
    }
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            threads = live_threads()
            t0 = time.perf_counter()
            loader = makers[name]()
            it = forever(loader)
            next(it)
            first = time.perf_counter() - t0
            for _ in range(warmup):
                next(it)
            c0, t1 = time.process_time(), time.perf_counter()
            for _ in range(batches):
                next(it)
            wall, cpu = time.perf_counter() - t1, time.process_time() - c0
            it.close()
            if hasattr(loader, "shutdown"):
                loader.shutdown()
            del loader, it
            settle(threads)
            out[name]["first_s"].append(first)
            out[name]["wall_s"].append(wall / batches)
            out[name]["cpu_s"].append(cpu / batches)
    return out


def meshfeed_frames(loader: Any, batches: int = 20) -> list[str]:
    """The meshfeed functions called while ``loader`` makes ``batches`` batches in this
    process (0 workers): checks that torch's path (dataset, sampler, collate) runs no
    meshfeed code."""
    root = str(Path(meshfeed.__file__).resolve().parent)
    seen: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.add(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    it = iter(loader)
    sys.setprofile(profile)
    try:
        for _ in range(batches):
            next(it)
    finally:
        sys.setprofile(None)
    return sorted(seen)


def spread(xs: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """Median [min-max] of ``xs`` times ``scale``."""
    return (
        f"{fmt(scale * median(xs), digits)} "
        f"[{fmt(scale * min(xs), digits)}-{fmt(scale * max(xs), digits)}]"
    )


def bench_throughput(cfg: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    path = write_tokens(tmp, cfg.tp_windows)
    ds = MemmapWindows(path, cfg.tp_windows)
    # The same dataset object serves both loaders; per sample ``__getitem__`` (no
    # ``fetch_batch`` / ``__getitems__``, which meshfeed would call instead), and torch's path
    # runs no meshfeed code.
    assert not hasattr(ds, "fetch_batch") and not hasattr(ds, "__getitems__")
    frames = meshfeed_frames(torch_loader(ds))
    if frames:
        raise RuntimeError(f"torch's loader ran meshfeed code: {frames}")
    rows = []
    for workers, dp in ((0, 1), (2, 1), (0, 2)):
        makers: dict[str, Callable[[], Any]] = {
            "meshfeed": partial(meshfeed_loader, ds, workers=workers, dp=dp),
            "torch": partial(torch_loader, ds, workers=workers, dp=dp),
        }
        need = 1 + cfg.tp_warmup + cfg.tp_batches
        for name, make in makers.items():  # stay inside one epoch: no epoch change is timed
            loader = make()
            if need > len(loader):
                raise ValueError(
                    f"{name}: the sizes need {need} batches, an epoch has {len(loader)}"
                )
            del loader
        t = alone_windows(
            makers, warmup=cfg.tp_warmup, batches=cfg.tp_batches, repeats=cfg.tp_repeats
        )
        mf, tl = t["meshfeed"], t["torch"]
        pairs = [b / a for a, b in zip(mf["wall_s"], tl["wall_s"], strict=True)]
        rows.append(
            {
                "workers": workers,
                "mesh": f"dp={dp} rank 0",
                "meshfeed_bps": [1 / s for s in mf["wall_s"]],
                "torch_bps": [1 / s for s in tl["wall_s"]],
                "ratio": median(tl["wall_s"]) / median(mf["wall_s"]),
                "pair_ratios": pairs,
                "cpu_ratio": median(tl["cpu_s"]) / median(mf["cpu_s"]),
                "meshfeed_cpu_us": [1e6 * s for s in mf["cpu_s"]],
                "torch_cpu_us": [1e6 * s for s in tl["cpu_s"]],
                "meshfeed_first_ms": [1e3 * s for s in mf["first_s"]],
                "torch_first_ms": [1e3 * s for s in tl["first_s"]],
            }
        )
        print(f"  throughput workers={workers} dp={dp}: {rows[-1]}", file=sys.stderr)
    return rows


# --------------------------------------------------------------------------- workers
class NumpyWindows(MemmapWindows):
    """The same windows as numpy arrays (Grain batches numpy, not torch tensors)."""

    def __getitem__(self, i: int) -> Any:
        return self.tokens[i * WINDOW : (i + 1) * WINDOW].astype(np.int64)


def grain_stream(ds: Any, workers: int) -> tuple[Iterator[Any] | None, str]:
    """Grain's dataset API with ``mp_prefetch`` over the same windows, or why not."""
    try:
        import grain
    except ImportError as exc:
        return None, f"grain is not installed ({exc}); pip install grain"
    dataset = grain.MapDataset.source(ds).shuffle(seed=0).repeat().batch(BATCH)
    options = grain.MultiprocessingOptions(num_workers=workers)
    return iter(dataset.to_iter_dataset().mp_prefetch(options)), ""


def bench_workers(cfg: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    """Cheap samples: in-process vs 2 workers, torch DataLoader, torchdata's
    StatefulDataLoader and Grain with 2 workers.

    Wall time of the main process per batch, interleaved; and this process's CPU time per
    batch (time.process_time), which shows what the transport costs the training process
    whatever the machine's load.
    """
    path = write_tokens(tmp, cfg.windows)
    ds = MemmapWindows(path, cfg.windows)
    inproc = meshfeed_loader(ds, workers=0)
    workers = meshfeed_loader(ds, workers=2)
    tl = torch_loader(ds, workers=2)
    # The same tokens as a .bin/.idx corpus read by TokenWindows.fetch_batch: one gather per
    # batch, the cheapest batches meshfeed makes (what the worker path must keep up with).
    corpus = os.path.join(tmp, "corpus")
    write_indexed(corpus, [np.memmap(path, dtype=np.uint16, mode="r")], np.uint16)
    windows = TokenWindows(corpus, seq_len=WINDOW - 1)
    tw0 = meshfeed_loader(windows, workers=0)
    tw2 = meshfeed_loader(windows, workers=2)
    streams: dict[str, Iterator[Any]] = {
        "meshfeed, 0 workers": forever(inproc),
        "meshfeed, 2 workers": forever(workers),
        "meshfeed TokenWindows.fetch_batch, 0 workers": forever(tw0),
        "meshfeed TokenWindows.fetch_batch, 2 workers": forever(tw2),
        "torch DataLoader, 2 workers": forever(tl),
    }
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as exc:
        print(f"  StatefulDataLoader row skipped: {exc}; pip install torchdata", file=sys.stderr)
    else:
        sdl = StatefulDataLoader(
            ds,
            batch_size=BATCH,
            sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0),
            drop_last=True,
            num_workers=2,
            persistent_workers=True,
        )
        streams["torchdata StatefulDataLoader, 2 workers"] = forever(sdl)
    grain_it, why = grain_stream(NumpyWindows(path, cfg.windows), 2)
    if grain_it is not None:
        streams["grain mp_prefetch, 2 workers"] = grain_it
    else:
        print(f"  grain row skipped: {why}", file=sys.stderr)
    wall = interleaved_rates(streams, warmup=cfg.warmup, batches=cfg.batches, repeats=cfg.repeats)
    cpu = interleaved_rates(
        streams, warmup=0, batches=cfg.batches, repeats=cfg.repeats, clock=time.process_time
    )
    base = 1 / median(wall["meshfeed, 0 workers"])
    rows: list[dict[str, Any]] = []
    for name in streams:
        rate = 1 / median(wall[name])
        rows.append(
            {
                "loader": name,
                "bps": rate,
                "vs_inprocess": rate / base,
                "main_cpu_us": 1e6 * median(cpu[name]),
            }
        )
    mf2 = rows[1]["bps"]
    for r in rows:
        r["meshfeed_2w_over"] = mf2 / r["bps"]
    if grain_it is None:
        rows.append({"loader": "grain mp_prefetch, 2 workers", "skipped": why})
    for r in rows:  # the fetch_batch rows against their own in-process rate
        if r["loader"].startswith("meshfeed TokenWindows"):
            r["vs_inprocess"] = r["bps"] / rows[2]["bps"]
    # The same two loaders alone, one after the other (a long run each, no interleaving that
    # lets the workers idle while another loader runs): the worker path's steady state.
    steady: dict[int, tuple[float, float]] = {}
    for w, loader in ((0, tw0), (2, tw2)):
        it = forever(loader)
        for _ in range(cfg.warmup + 200):
            next(it)
        n = 20 * cfg.batches
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            next(it)
        steady[w] = (n / (time.perf_counter() - t0), 1e6 * (time.process_time() - c0) / n)
    for w in (0, 2):
        rate, cpu_us = steady[w]
        rows.append(
            {
                "loader": f"meshfeed TokenWindows.fetch_batch, {w} workers, steady",
                "bps": rate,
                "vs_inprocess": rate / steady[0][0],
                "main_cpu_us": cpu_us,
                "meshfeed_2w_over": mf2 / rate,
            }
        )
    rows += first_batch_rows(windows, FIRST_BATCHES, max(5, cfg.repeats), mf2)
    del streams, grain_it
    workers.shutdown()
    tw2.shutdown()
    print(f"  workers: {rows}", file=sys.stderr)
    return rows


def first_batch_rows(ds: Any, n: int, repeats: int, mf2: float) -> list[dict[str, Any]]:
    """The first ``n`` batches of fresh loaders over ``ds``, 0 and 2 workers alternating,
    medians: from the first batch on, and with the time to the first batch included."""
    times: dict[int, list[tuple[float, float]]] = {0: [], 2: []}
    for _ in range(repeats):
        for w in (0, 2):
            times[w].append(first_batches(partial(meshfeed_loader, ds, workers=w), n))
    rates = {
        (w, start): median([(n - (not start)) / (a * start + b) for a, b in times[w]])
        for w in (0, 2)
        for start in (False, True)
    }
    rows = []
    for start in (False, True):
        for w in (0, 2):
            what = "start-up included" if start else "from the first batch on"
            rows.append(
                {
                    "loader": f"meshfeed TokenWindows.fetch_batch, {w} workers, first {n} "
                    f"batches ({what})",
                    "bps": rates[w, start],
                    "vs_inprocess": rates[w, start] / rates[0, start],
                    "main_cpu_us": float("nan"),
                    "meshfeed_2w_over": mf2 / rates[w, start],
                }
            )
    for w, row in zip((0, 2), rows[:2], strict=True):
        row["workers"], row["first_s"] = w, median([a for a, _ in times[w]])
    return rows


# --------------------------------------------------------------------------- transport
_TRANSPORT_SRC = torch.arange(BATCH * WINDOW, dtype=torch.int64)  # 128 KiB


def _ring_init(worker: int, num_workers: int) -> Callable[[Any], Any]:
    return lambda _task: {"tokens": _TRANSPORT_SRC.clone()}


def _torch_shm_worker(conn: Any) -> None:
    import torch.multiprocessing  # registers torch's shared-memory reductions

    torch.set_num_threads(1)
    while conn.recv() is not None:
        conn.send({"tokens": _TRANSPORT_SRC.clone().share_memory_()})


def _pump(get: Callable[[], Any], put: Callable[[], None], n: int) -> tuple[float, float]:
    """Wall and this process's CPU seconds per batch, 2 requests in flight."""
    for _ in range(2):
        put()
    for _ in range(50):
        get()
        put()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        get()
        put()
    c1, t1 = time.process_time(), time.perf_counter()
    for _ in range(2):
        get()
    return (t1 - t0) / n, (c1 - c0) / n


def bench_transport(cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """One 128 KiB batch from a worker: the ring of slots vs torch's shared-memory storages,
    and the ring's per-batch costs one by one (measured in this process)."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    from meshfeed.runtime import WorkerPool
    from meshfeed.runtime.transport import dumps, loads

    n, reps = cfg.transport_batches, cfg.repeats
    ring_runs, torch_runs = [], []
    for _ in range(reps):
        pool = WorkerPool(1, timeout=60, ring=4)
        pool.start(_ring_init)
        ring_runs.append(_pump(pool.result, partial(pool.submit, 0), n))
        pool.shutdown()
        ctx = mp.get_context("fork")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_torch_shm_worker, args=(theirs,), daemon=True)
        proc.start()
        import torch.multiprocessing  # noqa: F401  (rebuilds shared tensors on receipt)

        torch_runs.append(_pump(mine.recv, partial(mine.send, 0), n))
        mine.send(None)
        proc.join(5)
    # the ring's parts, each timed alone in this process
    batch = {"tokens": _TRANSPORT_SRC.clone()}
    bufs: list[Any] = []
    meta = dumps(batch, bufs)
    header = pickle.dumps(("ok", 0, meta, [(0, 131072)], 131072, []), 5)
    a, b = mp.Pipe(duplex=False)
    shm = shared_memory.SharedMemory(create=True, size=1 << 18)
    np.frombuffer(cast(Any, shm.buf), dtype=np.int64, count=BATCH * WINDOW)[:] = (
        _TRANSPORT_SRC.numpy()
    )

    def per_call(fn: Callable[[], Any], k: int = 2000) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        return (time.perf_counter() - t0) / k

    def pipe_message() -> None:
        b.send_bytes(header)
        a.recv_bytes()

    def map_slot() -> None:
        other = shared_memory.SharedMemory(name=shm.name)
        other.close()

    def one_copy() -> None:
        own = np.empty(1 << 17, dtype=np.uint8).data
        view = shm.buf
        assert view is not None
        own[:] = view[: 1 << 17]
        del view

    received = memoryview(bytearray(1 << 17))

    def header_pickle() -> None:
        dumps(batch, [])

    def header_unpickle() -> None:
        loads(meta, [received])

    parts = {
        "pipe message (header, send + receive)": median([per_call(pipe_message) for _ in range(3)]),
        "shared-memory map (attach + close; once per slot, not per batch)": median(
            [per_call(map_slot, 200) for _ in range(3)]
        ),
        "one copy (128 KiB out of the slot)": median([per_call(one_copy) for _ in range(3)]),
        "header pickle (in the worker)": median([per_call(header_pickle) for _ in range(3)]),
        "header unpickle (tensors rebuilt as views of the copy)": median(
            [per_call(header_unpickle) for _ in range(3)]
        ),
    }
    shm.close()
    shm.unlink()
    rows = [
        {
            "what": "ring of slots (meshfeed), per batch",
            "wall_us": 1e6 * median([r[0] for r in ring_runs]),
            "main_cpu_us": 1e6 * median([r[1] for r in ring_runs]),
        },
        {
            "what": "torch share_memory_() + fd passing, per batch",
            "wall_us": 1e6 * median([r[0] for r in torch_runs]),
            "main_cpu_us": 1e6 * median([r[1] for r in torch_runs]),
        },
    ]
    rows += [{"what": k, "part_us": 1e6 * v} for k, v in parts.items()]
    main_side = sum(
        v for k, v in parts.items() if not k.startswith(("shared-memory map", "header pickle"))
    )
    rows.append(
        {"what": "main process per batch: pipe + copy + unpickle", "part_us": 1e6 * main_side}
    )
    print(f"  transport: {rows}", file=sys.stderr)
    return rows


# --------------------------------------------------------------------------- 2. overhead
def bench_overhead(cfg: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for width in (WINDOW, 1):
        ds = ReadyTensors(10**6, width)
        assert not hasattr(ds, "fetch_batch") and not hasattr(ds, "__getitems__")
        frames = meshfeed_frames(torch_loader(ds))
        if frames:
            raise RuntimeError(f"torch's loader ran meshfeed code: {frames}")
        t = alone_windows(
            {"meshfeed": partial(meshfeed_loader, ds), "torch": partial(torch_loader, ds)},
            warmup=200,
            batches=cfg.overhead_batches,
            repeats=cfg.overhead_repeats,
        )
        row: dict[str, Any] = {"sample": f"int64[{width}]"}
        for label in ("wall", "cpu"):
            m, tl = t["meshfeed"][f"{label}_s"], t["torch"][f"{label}_s"]
            row.update(
                {
                    f"meshfeed_{label}": [1e6 * x for x in m],
                    f"torch_{label}": [1e6 * x for x in tl],
                    f"ratio_{label}": median(tl) / median(m),
                    f"pairs_{label}": [b / a for a, b in zip(m, tl, strict=True)],
                }
            )
        rows.append(row)
        print(f"  overhead {rows[-1]}", file=sys.stderr)
    return rows


# --------------------------------------------------------------------------- 3. resume
_TD_STEP_KEYS = ("_sampler_iter_yielded", "_num_yielded")
_TD_SAMPLE_KEYS = ("samples_yielded", "yielded")


def scale_torchdata_state(state: Any, step: int) -> Any:
    """A StatefulDataLoader state with its step / sample counters set to ``step``."""
    if isinstance(state, dict):
        out = {}
        for key, value in state.items():
            if key in _TD_STEP_KEYS:
                out[key] = step
            elif key in _TD_SAMPLE_KEYS:
                out[key] = step * BATCH
            else:
                out[key] = scale_torchdata_state(value, step)
        return out
    return state


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(torch.equal(a, b))
    return bool(a == b)


def torchdata_variants(ds: Any) -> dict[str, Callable[[], Any]]:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def plain() -> Any:
        s: DistributedSampler[Any] = DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
        return StatefulDataLoader(ds, batch_size=BATCH, sampler=s, drop_last=True)

    def stateful() -> Any:
        s = StatefulDistributedSampler(ds, num_replicas=1, rank=0, seed=0)
        return StatefulDataLoader(ds, batch_size=BATCH, sampler=s, drop_last=True)

    def random_sampler() -> Any:
        g = torch.Generator().manual_seed(0)
        return StatefulDataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True, generator=g)

    return {
        "StatefulDataLoader+DistributedSampler": plain,
        "StatefulDataLoader+StatefulDistributedSampler": stateful,
        "StatefulDataLoader(shuffle=True)": random_sampler,
    }


def _resume_seconds(make: Callable[[], Any], state: Any) -> tuple[float, Any]:
    loader = make()
    t0 = time.perf_counter()
    loader.load_state_dict(state)
    batch = next(iter(loader))
    elapsed = time.perf_counter() - t0
    if hasattr(loader, "shutdown"):
        loader.shutdown()
    return elapsed, batch


def resume_samples(steps: tuple[int, ...]) -> int:
    """The resume data set's size: the last step's batches and a little more."""
    return steps[-1] * BATCH + 512


def bench_resume(cfg: argparse.Namespace) -> list[dict[str, Any]]:
    steps = cfg.resume_steps
    ds = TinySamples(resume_samples(steps))
    ref_steps = list(steps[:2])  # real states; the last step's is scaled from the second's
    makers: dict[str, Callable[[], Any]] = {"meshfeed": lambda: meshfeed_loader(ds)}
    variants = torchdata_variants(ds)
    if cfg.quick:
        variants = dict(list(variants.items())[:1])
    makers.update(variants)

    # Real states (and the batch that follows) at the cheap steps; scaled states at 10**6.
    states: dict[str, dict[int, Any]] = {}
    expected: dict[str, dict[int, torch.Tensor]] = {}
    for name, make in makers.items():
        loader = make()
        it = iter(loader)
        done = 0
        states[name], expected[name] = {}, {}
        for step in ref_steps:
            while done < step:
                next(it)
                done += 1
            states[name][step] = loader.state_dict()
            expected[name][step] = next(it)
            done += 1
        if hasattr(loader, "shutdown"):
            loader.shutdown()
        base = states[name][ref_steps[0]]
        if name == "meshfeed":
            scaled = {s: {**base, "position": s * BATCH} for s in steps}
        else:
            scaled = {s: scale_torchdata_state(base, s) for s in steps}
        for step in ref_steps:  # the scaled state is the real one where we can check it
            if not _same_state(scaled[step], states[name][step]):
                raise RuntimeError(f"{name}: scaled state at {step} differs from the real one")
        states[name].update({s: scaled[s] for s in steps if s not in ref_steps})

    rows = []
    for step in steps:
        row: dict[str, Any] = {"step": step}
        for name, make in makers.items():
            _resume_seconds(make, states[name][step])  # warm-up
            runs = [_resume_seconds(make, states[name][step]) for _ in range(cfg.resume_repeats)]
            for _, batch in runs:
                if step in expected[name] and not torch.equal(batch, expected[name][step]):
                    raise RuntimeError(f"{name} resumed at step {step} with the wrong batch")
            row[name] = 1e3 * median([s for s, _ in runs])
        rows.append(row)
        print(f"  resume {row}", file=sys.stderr)
    size_row: dict[str, Any] = {"step": "state bytes"}
    for name in makers:
        st = states[name][ref_steps[-1]]
        size_row[name] = len(json.dumps(st)) if name == "meshfeed" else len(pickle.dumps(st))
    rows.append(size_row)
    return rows


# --------------------------------------------------------------------------- 4. memory
class LengthOnly:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(kind: str, n: int) -> dict[str, Any]:
    """Runs in a fresh process: peak bytes allocated by building an order and using it."""
    ds = LengthOnly(n)
    work: Callable[[], Any]
    if kind == "meshfeed-order":
        from meshfeed.order.batches import BatchPlan, ShuffledOrder

        def work() -> Any:
            plan = BatchPlan(ShuffledOrder(n, seed=0), global_batch_size=BATCH)
            step = plan.step_at(0, (n // 2) // BATCH * BATCH)
            assert step is not None
            return plan.rank_indices(step, 0, 1)

    elif kind == "meshfeed-loader":

        def work() -> Any:
            loader = meshfeed_loader(ds)
            state = loader.state_dict()
            loader.load_state_dict({**state, "position": (n // 2) // BATCH * BATCH})
            return next(iter(loader))

    elif kind == "torch-randperm":

        def work() -> Any:
            return torch.randperm(n)

    elif kind == "torch-DistributedSampler":

        def work() -> Any:
            sampler: DistributedSampler[Any] = DistributedSampler(
                cast(Any, ds), num_replicas=1, rank=0, seed=0
            )
            it = iter(sampler)
            return [next(it) for _ in range(BATCH)]

    else:
        raise ValueError(f"unknown memory kind {kind!r}")
    work()  # first call pays one-off imports and caches; measure a second, fresh call
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS counter (VmHWM)
        f.write("5")
    base = _rss_kib("VmRSS")
    tracemalloc.start()
    result = work()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    hwm = _rss_kib("VmHWM")
    del result
    return {"kind": kind, "n": n, "tracemalloc_peak": peak, "rss_growth": (hwm - base) * 1024}


def run_memory_child(kind: str, n: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", kind, str(n)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_memory(cfg: argparse.Namespace) -> list[dict[str, Any]]:
    jobs = [("meshfeed-order", 10**9), ("meshfeed-loader", 10**9)]
    jobs += [("torch-randperm", n) for n in cfg.randperm_sizes]
    # a list of n Python ints: ~150 bytes of RSS per sample
    jobs += [("torch-DistributedSampler", n) for n in cfg.sampler_sizes]
    # Each child measures its own memory, which a sibling running beside it does not change:
    # two at a time (most of a child's time is importing torch).
    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = list(pool.map(lambda job: run_memory_child(*job), jobs))
    for row in rows:
        print(f"  memory {row}", file=sys.stderr)
    return rows


# --------------------------------------------------------------------------- report
def fmt(x: float, digits: int = 1) -> str:
    return "-" if x != x else f"{x:,.{digits}f}"  # NaN: not measured


def mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB"


def source_revision() -> str:
    """The git commit of the meshfeed being measured, and its uncommitted hot-path files."""
    root = Path(meshfeed.__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", *HOT_PATH],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"git {head}" + (f", uncommitted changes in {', '.join(changed)}" if changed else "")


def throughput_lines(cfg: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"## Throughput: memmap uint16 windows of {WINDOW} tokens, batch {BATCH}, "
        f"{cfg.tp_windows} windows",
        "",
        f"Each loader alone: {cfg.tp_repeats} repeats, each a fresh loader of each system one "
        "after the other (order alternating: meshfeed first in even repeats, torch first in "
        "odd ones), the previous loader's workers and threads gone before the next starts. "
        f"Per loader: first batch (construction + worker start-up), {cfg.tp_warmup} batches "
        f"untimed (more than either holds ready: meshfeed <= workers x prefetch x 16 = 64 at 2 "
        f"workers, torch workers x prefetch_factor = 4), then {cfg.tp_batches} batches timed "
        "(steady state, inside the first epoch). Median [min-max] over the repeats. torch: "
        "`DataLoader(sampler=DistributedSampler(shuffle=True, seed=0), drop_last=True, "
        "persistent_workers=True` with workers, `prefetch_factor` default, `pin_memory=False`); "
        "meshfeed: `DataLoader(mesh=DataMesh.from_sizes(dp=...), seed=0)`, prefetch default, "
        "pin_memory=False. The same dataset object (`MemmapWindows.__getitem__`: numpy + torch "
        "only; checked: torch's loader calls no meshfeed function).",
        "",
        "| workers | mesh | meshfeed batches/s | torch batches/s | meshfeed / torch "
        "(medians) | per-repeat ratios | CPU-time ratio | main-process CPU us/batch meshfeed "
        "| torch | first batch ms meshfeed | torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pairs = r["pair_ratios"]
        cpu = f"{r['cpu_ratio']:.2f}" if r["workers"] == 0 else "-"
        lines.append(
            f"| {r['workers']} | {r['mesh']} | {spread(r['meshfeed_bps'])} "
            f"| {spread(r['torch_bps'])} | {r['ratio']:.2f} "
            f"| {min(pairs):.2f}-{max(pairs):.2f} | {cpu} | {spread(r['meshfeed_cpu_us'])} "
            f"| {spread(r['torch_cpu_us'])} | {spread(r['meshfeed_first_ms'], digits=2)} "
            f"| {spread(r['torch_first_ms'], digits=2)} |"
        )
    lines += [
        "",
        "Ratios >= 1: meshfeed faster. Per-repeat ratios: torch's wall time per batch / "
        "meshfeed's within one repeat (the two windows adjacent in time). CPU-time ratio: the "
        "same in this process's CPU time (time.process_time), 0 workers only, where all the "
        "work is in this process (with workers, the main process's CPU is what receiving a "
        "batch costs it, not the work).",
    ]
    return lines


def overhead_lines(cfg: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"## Per-batch overhead: ready tensors, batch {BATCH}, 0 workers",
        "",
        f"Each loader alone, {cfg.overhead_repeats} repeats (a fresh loader of each system per "
        "repeat, order alternating), 200 batches untimed, then "
        f"{cfg.overhead_batches} batches timed; wall and this process's CPU time over the same "
        "window. Median [min-max] over the repeats, us per batch.",
        "",
        "| sample | meshfeed wall | torch wall | torch / meshfeed (wall) | per-repeat "
        "| meshfeed CPU | torch CPU | torch / meshfeed (CPU) | per-repeat |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pw, pc = r["pairs_wall"], r["pairs_cpu"]
        lines.append(
            f"| {r['sample']} | {spread(r['meshfeed_wall'])} | {spread(r['torch_wall'])} "
            f"| {r['ratio_wall']:.2f} | {min(pw):.2f}-{max(pw):.2f} "
            f"| {spread(r['meshfeed_cpu'])} | {spread(r['torch_cpu'])} "
            f"| {r['ratio_cpu']:.2f} | {min(pc):.2f}-{max(pc):.2f} |"
        )
    lines += [
        "",
        "Ratios >= 1: meshfeed is cheaper. CPU = this process's CPU time (time.process_time), "
        "less disturbed by other jobs on the machine than wall time.",
    ]
    return lines


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


RESULT_FILES = {"throughput": "loader_throughput.txt", "overhead": "loader_overhead.txt"}


def write_result_files(
    cfg: argparse.Namespace, results: dict[str, Any], loads: dict[str, tuple[str, str]]
) -> None:
    """The throughput and overhead tables, each in its results file, with how they were made."""
    lines_of = {"throughput": throughput_lines, "overhead": overhead_lines}
    for section, name in RESULT_FILES.items():
        if section not in results:
            continue
        before, after = loads[section]
        argv = " ".join(sys.argv[1:]) if cfg.argv is None else " ".join(cfg.argv)
        head = [
            f"# meshfeed.DataLoader vs torch DataLoader + DistributedSampler: {section}",
            "",
            f"Command: PYTHONPATH={os.environ.get('PYTHONPATH', '')} python "
            f"benchmarks/bench_loader.py {argv}",
            f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"Machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
            f"torch {torch.__version__}, meshfeed from {source_revision()}",
            f"Load average (/proc/loadavg) before: {before}; after: {after}. Other jobs share "
            "this machine while it runs: absolute numbers are noisy.",
            "",
        ]
        out = cfg.results_dir / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(head + lines_of[section](cfg, results[section])) + "\n")
        print(f"  wrote {out}", file=sys.stderr)


def report(cfg: argparse.Namespace, results: dict[str, Any]) -> str:
    lines = [
        "# meshfeed.DataLoader benchmark",
        "",
        f"Command: `PYTHONPATH={os.environ.get('PYTHONPATH', '')} python {' '.join(sys.argv)}`",
        f"Machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, torch {torch.__version__}; "
        f"load average at the end {os.getloadavg()[0]:.1f} (other jobs share the machine: "
        "absolute numbers are noisy). Throughput and overhead: each loader alone, order "
        "alternating between repeats; the other sections: medians of "
        f"{cfg.repeats} interleaved repeats unless noted.",
        f"meshfeed imported from `{Path(meshfeed.__file__).parent}` ({source_revision()}).",
        "",
    ]
    if "throughput" in results:
        lines += [*throughput_lines(cfg, results["throughput"]), ""]
    if "workers" in results:
        lines += [
            f"## Worker processes, cheap samples: memmap windows of {WINDOW} tokens, batch "
            f"{BATCH} (128 KiB of int64 per batch), {cfg.batches} batches per repeat",
            "",
            "| loader | batches/s | / meshfeed 0 workers (TokenWindows rows: / its 0 workers) "
            "| meshfeed 2 workers / this "
            "| main process CPU us/batch |",
            "|---|---|---|---|---|",
        ]
        for r in results["workers"]:
            if "skipped" in r:
                lines.append(f"| {r['loader']} | skipped: {r['skipped']} | | | |")
                continue
            lines.append(
                f"| {r['loader']} | {fmt(r['bps'])} | {r['vs_inprocess']:.2f} "
                f"| {r['meshfeed_2w_over']:.2f} | {fmt(r['main_cpu_us'])} |"
            )
        lines += [
            "",
            "Wall-time rates, interleaved; on 2 cores the workers compete with the main "
            "process (and with other jobs) for the CPUs. Main-process CPU per batch is the "
            "cost the training process pays to receive a batch. The first-batches rows time "
            f"{FIRST_BATCHES} batches of fresh loaders (0 and 2 workers alternating, medians); "
            "the time to the first batch (forking the workers included): "
            + ", ".join(
                f"{w} workers {1e3 * r['first_s']:.1f} ms"
                for r in results["workers"]
                if "first_s" in r
                for w in (r["workers"],)
            )
            + ".",
            "",
        ]
    if "transport" in results:
        lines += [
            f"## Transport of one 128 KiB batch from a worker ({cfg.transport_batches} batches "
            "per repeat, 2 in flight)",
            "",
            "| what | wall us/batch | main process CPU us/batch | part us |",
            "|---|---|---|---|",
        ]
        for r in results["transport"]:
            lines.append(
                f"| {r['what']} | {fmt(r.get('wall_us', float('nan')))} "
                f"| {fmt(r.get('main_cpu_us', float('nan')))} "
                f"| {fmt(r.get('part_us', float('nan')))} |"
            )
        lines.append("")
    if "overhead" in results:
        lines += [*overhead_lines(cfg, results["overhead"]), ""]
    if "resume" in results:
        names = [k for k in results["resume"][0] if k != "step"]
        lines += [
            f"## Resume latency: load_state_dict + first batch, ms "
            f"({resume_samples(cfg.resume_steps):,} tiny "
            f"samples, median of {cfg.resume_repeats})",
            "",
            "| step | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for r in results["resume"]:
            step = r["step"]
            label = f"{step:,}" if isinstance(step, int) else step
            cells = [(fmt(r[n], 2) if isinstance(step, int) else f"{r[n]:,}") for n in names]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    if "memory" in results:
        lines += [
            "## Memory of the order (fresh process; tracemalloc peak and peak-RSS growth)",
            "",
            "| what | n | tracemalloc peak | peak RSS growth | linear extrapolation to n = 10**9 |",
            "|---|---|---|---|---|",
        ]
        for r in results["memory"]:
            n = r["n"]
            extra = (
                "measured at 10**9"
                if n == 10**9
                else (
                    f"~{mib(max(r['tracemalloc_peak'], r['rss_growth']) * 10**9 / n)} (extrapolated)"
                )
            )
            lines.append(
                f"| {r['kind']} | {n:.0e} | {mib(r['tracemalloc_peak'])} | {mib(r['rss_growth'])} | {extra} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small version (< 1 minute)")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument(
        "--only",
        nargs="*",
        choices=["throughput", "workers", "transport", "overhead", "resume", "memory"],
        help="run only these sections",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        help="where the throughput and overhead tables are written (loader_throughput.txt, "
        "loader_overhead.txt); default benchmarks/results/ for a full run, none for --quick",
    )
    parser.add_argument("--memory-child", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child[0], int(args.memory_child[1]))))
        return
    if args.quick:
        args.windows, args.warmup, args.batches, args.repeats = 4096, 10, 60, 3
        args.overhead_batches, args.resume_repeats, args.transport_batches = 1000, 1, 500
        args.tp_windows, args.tp_warmup, args.tp_batches, args.tp_repeats = 8192, 70, 200, 2
        args.overhead_repeats = 2
        args.randperm_sizes, args.sampler_sizes = [10**7], [10**6]
        args.resume_steps = (10, 10**3, 10**5)  # a smoke run: the full run's 10**4 / 10**6
    else:
        args.windows, args.warmup, args.batches, args.repeats = 32768, 30, 300, 5
        args.overhead_batches, args.resume_repeats, args.transport_batches = 20000, 3, 3000
        args.tp_windows, args.tp_warmup, args.tp_batches, args.tp_repeats = 131072, 300, 6000, 8
        args.overhead_repeats = 8
        if args.results_dir is None:
            args.results_dir = Path(__file__).resolve().parent / "results"
        args.randperm_sizes, args.sampler_sizes = [10**7, 10**8], [10**6, 10**7]
        args.resume_steps = RESUME_STEPS
    sections = args.only or ["throughput", "workers", "transport", "overhead", "resume", "memory"]
    results: dict[str, Any] = {}
    loads: dict[str, tuple[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="meshfeed-bench-") as tmp:
        for section in sections:
            print(f"[{section}]", file=sys.stderr)
            t0 = time.perf_counter()
            before = loadavg()
            if section == "throughput":
                results[section] = bench_throughput(args, tmp)
            elif section == "workers":
                results[section] = bench_workers(args, tmp)
            elif section == "transport":
                results[section] = bench_transport(args)
            elif section == "overhead":
                results[section] = bench_overhead(args)
            elif section == "resume":
                results[section] = bench_resume(args)
            else:
                results[section] = bench_memory(args)
            loads[section] = (before, loadavg())
            print(f"  ({time.perf_counter() - t0:.1f}s, load {loads[section]})", file=sys.stderr)
    text = report(args, results)
    print(text)
    if args.results_dir is not None:
        write_result_files(args, results, loads)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
