"""One rank of a huge job: does anything a rank computes grow with the number of data ranks?

For each loader (map-style ``DataLoader``, ``StreamLoader`` over 1,024 shards, the sample
store's ``StoreLoader``, and the balancing planner of ``BalancedBatches``) and each data-parallel
size (1k, 8k, 64k; the mesh also has pp 4, cp 4, tp 8, so 64k data ranks are 8.4 million ranks),
a fresh Python process builds the loader of ONE rank (a data rank in the middle of the mesh) and
reports, after its imports:

- ``first_ms``: time to build the loader and get its first batch;
- ``rss_mb``: growth of the process's peak RSS over that build (``ru_maxrss``); for the store,
  of its resident set (the peak is the filling's, before: the store's samples are its
  producers', in a job the store's own process);
- ``alloc_mb``: peak Python allocations (``tracemalloc``) of a second, identical build (for
  the store: of a third data rank's first batch);
- ``state_b``: ``len(json.dumps(loader.state_dict()))``;
- ``step_us``: mean time of each of the next 20 batches (planning plus a trivial fetch); for
  the store, the first batch of the next data rank (the store plans each round once, for every
  rank, when the first rank asks: ``first_ms`` holds that round's plan);
- ``exact``: for the first global batches, the slices of 16 sampled data ranks are the pieces of
  the global batch the plan gives, and the global batches hold every sample at most once
  (every sample exactly once over a whole epoch of the map loader); for the store, 16
  sampled data ranks each read every round (the store holds two global batches) and get
  their round's part, and the rounds hold every sample exactly once.

The dataset grows with the job (64 samples per data rank; synthetic, computed per index, so
the dataset itself holds no memory). The balancer plans the documents of the balancing group
of one global batch: over the whole DP x CP world its input is the world's documents, so it is
run over groups of a bounded size (``--balance-group``, the mesh's CP x 64 ranks), the way a
job that size balances.

It also times the start-up of a stream of 10,000 shards against one of 100 shards of the
same 20,000 rows (fresh processes, best of 3; ``--files``), the target being 2x + 0.2 s.

    python benchmarks/bench_scale.py            # 1k, 8k, 64k data ranks, every loader
    python benchmarks/bench_scale.py --quick    # 256 and 16k data ranks, map, stream, store; 150 shards
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

MESH = {"pp": 4, "cp": 4, "tp": 8}
PER_RANK = 64  # samples per data rank in the dataset (32 steps an epoch)
BATCH = 2  # per data rank
SHARDS = 1024
SAMPLED_RANKS = 16
ROUNDS = 2  # global batches in the store: a round is in flight when the state is taken


class Range:
    """A map-style dataset of ``n`` ints, computed per index (no memory)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


class SyntheticShards:
    """A seeking reader over ``shard-i`` names of ``rows`` rows each: row r of shard s is
    ``s * rows + r``."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __call__(self, shard: str, start: int, stop: int | None) -> Any:
        base = int(shard.rsplit("-", 1)[1]) * self.rows
        return iter(range(base + start, base + (self.rows if stop is None else stop)))

    def take(self, shard: str, rows: np.ndarray) -> list[int]:
        base = int(shard.rsplit("-", 1)[1]) * self.rows
        return (base + np.asarray(rows)).tolist()

    def count(self, shard: str) -> int:
        return self.rows

    def version(self, shard: str) -> str:
        return f"synthetic:{self.rows}"


def _mesh(dp: int) -> dict[str, int]:
    return {"pp": MESH["pp"], "dp": dp, "cp": MESH["cp"], "tp": MESH["tp"]}


def _rank(dp: int, data_rank: int | None = None, other: int = 1) -> int:
    """A global rank whose data rank is ``data_rank`` (default ``dp // 2 + 1``) and whose
    pp, cp and tp coordinates are ``other``."""
    cp, tp = MESH["cp"], MESH["tp"]
    d = dp // 2 + 1 if data_rank is None else data_rank
    return ((other * dp + d) * cp + other) * tp + other


def build(kind: str, dp: int) -> Any:
    """The loader of one rank (``kind``: map, stream, store)."""
    from meshfeed import DataLoader, StreamLoader
    from meshfeed.sources import ShardedStream

    n = dp * PER_RANK
    if kind == "map":
        return DataLoader(Range(n), batch_size=BATCH, mesh=_mesh(dp), rank=_rank(dp), seed=1)
    if kind == "stream":
        rows = n // SHARDS
        shards = [f"shard-{i}" for i in range(SHARDS)]
        stream = ShardedStream(shards, SyntheticShards(rows), rows=[rows] * SHARDS)
        return StreamLoader(stream, batch_size=BATCH, mesh=_mesh(dp), rank=_rank(dp), seed=1)
    raise ValueError(f"unknown loader {kind!r}")


def _store(dp: int) -> Any:
    """A closed store holding ``ROUNDS`` global batches (filled before timing: the samples
    are the producers', not a rank's)."""
    from meshfeed.queue import SampleStore

    store = SampleStore()
    store.put("p", {"x": list(range(ROUNDS * dp * BATCH))})
    store.close("p")
    # In a job the store's samples live in the store's process (a Ray actor), not in a
    # rank's heap: the collector is told to leave them alone, as it would never see them.
    gc.freeze()
    return store


def _store_loader(dp: int, store: Any, rank: int | None = None) -> Any:
    """A StoreLoader of one rank over ``store``; the time it was started."""
    from meshfeed.queue import StoreLoader

    t0 = time.perf_counter()
    loader = StoreLoader(
        store,
        task="t",
        fields=["x"],
        partition="p",
        batch_size=BATCH,
        mesh=_mesh(dp),
        rank=_rank(dp) if rank is None else rank,
        timeout=60,
        # Synchronous: with prefetch, a loader's request thread plans the next round here,
        # in this process, while the next rank is timed; in a job that work is the store's
        # (its own process), so it would be charged to the wrong party.
        prefetch=1,
    )
    return loader, t0


def _balance(dp: int, group_dp: int) -> tuple[float, int]:
    """Plan one global batch of a DP x CP balancing group of ``group_dp`` data ranks (each
    rank's packed sample: 8 documents of synthetic lengths); time and peak allocation."""
    from meshfeed.balance.schedule import schedule_documents

    ranks = group_dp * MESH["cp"]
    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 1024, size=8 * ranks)
    t0 = time.perf_counter()
    schedule_documents(lengths, num_ranks=ranks, max_tokens=8192, cp_sizes="any")
    return time.perf_counter() - t0, ranks


def _exact(loader: Any, dp: int, steps: int) -> bool:
    """The sampled data ranks' slices are pieces of the plan's global batches, which hold no
    sample twice; for the map loader over a whole epoch (``steps`` = all), every sample once."""
    plan = loader.plan
    epoch, seen, count = 0, [], 0
    whole = steps >= plan.steps(epoch)
    for s in range(min(steps, plan.steps(epoch))):
        step = plan.step_at(epoch, s * plan.global_batch_size)
        every = plan.order.indices(epoch, np.arange(step.start, step.end, dtype=np.int64))
        if len(np.unique(every)) != len(every):
            return False
        for d in np.linspace(0, dp - 1, SAMPLED_RANKS).astype(int).tolist():
            piece = plan.rank_indices(step, d, dp)
            if not np.array_equal(piece, every[d * BATCH : (d + 1) * BATCH]):
                return False
        seen.append(every)
        count += len(every)
    allseen = np.concatenate(seen)
    if whole and isinstance(loader.dataset, Range):
        full = plan.steps(epoch) * plan.global_batch_size
        return count == full and len(np.unique(allseen)) == full
    return len(np.unique(allseen)) == count


def _exact_store(store: Any, dp: int) -> bool:
    """Sampled data ranks (each a fresh loader of another replica coordinate) read every
    round: each gets exactly its data rank's slice of each round (the samples were put in
    order, so round ``j`` is ids ``j * D * batch`` on, cut in ``D`` contiguous parts), and the
    store counts every sample of the rounds consumed exactly once."""
    size = dp * BATCH
    for d in np.linspace(0, dp - 1, SAMPLED_RANKS).astype(int).tolist():
        loader, _ = _store_loader(dp, store, rank=_rank(dp, d, other=0))
        got = [list(b.ids) for b in loader]
        loader.shutdown()
        start = d * BATCH
        if got != [list(range(j * size + start, j * size + start + BATCH)) for j in range(ROUNDS)]:
            return False
    return bool(store.stats()["consumed"].get("t") == ROUNDS * size)


def _shape(value: Any) -> Any:
    """``value`` with every number and string replaced by its type and every list by its
    length and its items' distinct shapes: the state's fields and the lengths of its lists."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        shapes = {json.dumps(_shape(v)) for v in value}
        return [len(value), [json.loads(x) for x in sorted(shapes)]]
    return type(value).__name__


def _rss_kib(kind: str) -> int:
    """Peak RSS (KiB); for the store, the resident set now (its filling set the peak)."""
    if kind == "store":
        with contextlib.suppress(OSError), open("/proc/self/statm") as f:  # else: the peak
            return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def child(kind: str, dp: int, group_dp: int, exact_steps: int) -> dict[str, Any]:
    import meshfeed  # noqa: F401  (imports are not the rank's planning cost)
    from meshfeed.queue import StoreLoader  # noqa: F401
    from meshfeed.sources import ShardedStream  # noqa: F401

    out: dict[str, Any] = {"loader": kind, "dp": dp, "ranks": dp * 128}
    # The store's samples are its producers' (in a job: the store's own process), filled
    # before the rank's growth is measured, as before its time is.
    store = _store(dp) if kind == "store" else None
    rss0 = _rss_kib(kind)
    if kind == "balance":
        took, ranks = _balance(dp, min(dp, group_dp))
        out |= {"first_ms": took * 1e3, "group_ranks": ranks, "state_b": None, "exact": None}
        out["rss_mb"] = (_rss_kib(kind) - rss0) / 1024
        tracemalloc.start()
        _balance(dp, min(dp, group_dp))
        out["alloc_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
        return out
    if kind == "store":
        loader, t0 = _store_loader(dp, store)
    else:
        t0 = time.perf_counter()
        loader = build(kind, dp)
    it = iter(loader)
    next(it)
    out["first_ms"] = (time.perf_counter() - t0) * 1e3
    out["rss_mb"] = (_rss_kib(kind) - rss0) / 1024
    if kind != "store":
        t1 = time.perf_counter()
        for _ in range(20):
            next(it)
        out["step_us"] = (time.perf_counter() - t1) / 20 * 1e6
    else:  # the store plans a round once for every rank: what the next data rank pays
        step = MESH["cp"] * MESH["tp"]  # the next data ranks
        other, t1 = _store_loader(dp, loader.store, rank=_rank(dp) + step)
        next(iter(other))
        out["step_us"] = (time.perf_counter() - t1) * 1e6
        other.shutdown()
        tracemalloc.start()
        third, _ = _store_loader(dp, loader.store, rank=_rank(dp) + 2 * step)
        next(iter(third))
        out["alloc_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
        third.shutdown()
    state = json.dumps(loader.state_dict())
    out["state_b"] = len(state)
    out["state_shape"] = json.dumps(_shape(loader.state_dict()))
    if kind == "store":
        loader.shutdown()
        out["exact"] = _exact_store(loader.store, dp)
    else:
        out["exact"] = _exact(loader, dp, exact_steps)
        loader.shutdown()
    if kind != "store":
        tracemalloc.start()
        again = build(kind, dp)
        next(iter(again))
        out["alloc_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
    return out


def first_batch_of_shards(path: str) -> dict[str, Any]:
    """Time to the first batch of a stream over the shard dataset at ``path`` (a fresh
    process: its imports done first)."""
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    t0 = time.perf_counter()
    loader = StreamLoader(ShardedStream.from_index(path), batch_size=32, mesh={"dp": 8}, rank=3)
    next(iter(loader))
    return {"first_s": time.perf_counter() - t0}


def shard_startup(files: int, rows: int, repeats: int) -> list[str]:
    """A stream of ``files`` shards against one of 100 shards of the same rows: the best of
    ``repeats`` fresh processes each, in turns (target: within 2x + 0.2 s, #32)."""
    import tempfile

    from meshfeed.sources import write_shards

    best: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (100, files):
            samples = ({"x": np.int64(i)} for i in range(rows))
            write_shards(samples, f"{tmp}/d{n}", rows_per_shard=rows // n, num_workers=1)
        # --quick (repeats=1) runs both in one process, many shards first (a smoke run)
        groups = [[files, 100]] if repeats == 1 else [[100], [files]] * repeats
        for group in groups:
            cmd = [sys.executable, __file__, "--shards", *(f"{tmp}/d{n}" for n in group)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            for n, line in zip(group, done.stdout.strip().splitlines()[-len(group) :], strict=True):
                took = json.loads(line)["first_s"]
                best[n] = min(best.get(n, took), took)
    target = 2 * best[100] + 0.2
    verdict = "within" if best[files] <= target else "NOT within"
    return [
        f"start-up, {rows} rows: 100 shards {best[100] * 1e3:.0f} ms, {files} shards "
        f"{best[files] * 1e3:.0f} ms (best of {repeats} fresh processes each): {verdict} "
        f"2x + 0.2 s = {target * 1e3:.0f} ms"
    ]


def run(kind: str, dp: int, group_dp: int, exact_steps: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, str(dp), "--balance-group", str(group_dp)]
    cmd += ["--exact-steps", str(exact_steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} at dp={dp} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if v < 100 else f"{v:.0f}"
    return str(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="256 and 16k data ranks, map, stream, store; 150 shards",
    )
    parser.add_argument("--child", nargs=2, metavar=("LOADER", "DP"), help=argparse.SUPPRESS)
    parser.add_argument("--shards", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--files", type=int, default=None, help="shards of the start-up test")
    parser.add_argument("--balance-group", type=int, default=64, help="data ranks per group")
    parser.add_argument("--exact-steps", type=int, default=PER_RANK, help="global batches checked")
    args = parser.parse_args()
    if args.shards:
        for path in args.shards:
            print(json.dumps(first_batch_of_shards(path)))
        return
    if args.child:
        kind, dp = args.child[0], int(args.child[1])
        print(json.dumps(child(kind, dp, args.balance_group, args.exact_steps)))
        return
    sizes = [256, 16384] if args.quick else [1024, 8192, 65536]
    # --quick leaves the balancer out (each fresh process spends seconds importing)
    kinds = ["map", "stream", "store"] if args.quick else ["map", "stream", "store", "balance"]
    exact_steps = 4 if args.quick else args.exact_steps
    cases = [(kind, dp, args.balance_group, exact_steps) for kind in kinds for dp in sizes]
    # --quick runs its fresh processes two at a time (it checks, it does not time)
    with ThreadPoolExecutor(2 if args.quick else 1) as pool:
        rows = list(pool.map(lambda case: run(*case), cases))
    cols = ["loader", "dp", "ranks", "first_ms", "step_us", "rss_mb", "alloc_mb", "state_b"]
    lines = ["| " + " | ".join([*cols, "exact"]) + " |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in [*cols, "exact"]) + " |")
    verdict = []
    for kind in kinds:
        small = next(r for r in rows if r["loader"] == kind and r["dp"] == sizes[0])
        big = next(r for r in rows if r["loader"] == kind and r["dp"] == sizes[-1])
        ratio_t = big["first_ms"] / small["first_ms"]
        ratio_m = max(big["alloc_mb"], 0.01) / max(small["alloc_mb"], 0.01)
        if big["state_b"] is None:
            state = "no state"
        else:  # the state names the data world size: its digits may differ, nothing else
            grows = big["state_shape"] != small["state_shape"]
            state = f"state {small['state_b']} -> {big['state_b']} B " + (
                "(GROWS)" if grows else "(same fields; numbers' digits differ)"
            )
        verdict.append(
            f"{kind}: {sizes[-1]}/{sizes[0]} data ranks: time to first batch x{ratio_t:.2f}, "
            f"peak allocations x{ratio_m:.2f}, {state}"
        )
    files = args.files or (150 if args.quick else 10_000)
    rows_total = 1_500 if args.quick else 20_000
    verdict += shard_startup(files, rows=rows_total, repeats=1 if args.quick else 3)
    exact = all(r["exact"] is not False for r in rows)
    verdict.append(f"exactly-once checks: {'pass' if exact else 'FAIL'}")
    text = "\n".join([*lines, "", *verdict])
    print(text)
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"scale{'_quick' if args.quick else ''}.txt").write_text(text + "\n")
    if not exact:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
