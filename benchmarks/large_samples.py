"""The large-sample rows of bench_shards.py and bench_remote.py (``--large``): meshfeed vs litdata.

Samples ``{"id": int, "image": uint8[80_000..120_000] (random length and bytes), "label": int}``,
sample ``i`` from the fixed seed ``(SEED, i)``, written in 16 MiB shards (``--shard-mib``) by
meshfeed's ``write_shards`` and litdata's ``optimize``. Each measurement runs in a fresh
process (this file's ``child`` command), with batches of 32 and a collate that keeps the
samples as they come:

- ``epoch 1`` / ``epoch 2``: the first and second shuffled pass of one loader in a fresh
  process. Locally the dataset's files are first dropped from the page cache
  (``posix_fadvise(DONTNEED)`` on each file: it drops clean pages, so epoch 1 reads the disk;
  the whole machine's cache cannot be dropped without root); from S3 the cache folder starts
  empty (epoch 1 cold, epoch 2 from the cache epoch 1 filled);
- ``resume``: the first batch after resuming at 50 % of an epoch (a state saved by another
  process), timed from building the loader in a fresh process (``build``) and from ``iter``.

meshfeed: ``ShardedStream.from_index(path_or_url, shuffle_buffer=512)`` (about 3 shards) +
``StreamLoader(shuffle=True)``; litdata: ``StreamingDataset(shuffle=True)`` +
``StreamingDataLoader`` and its ``load_state_dict``. Every epoch is checked: each id once.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

SEED = 29
BATCH = 32
SHUFFLE_BUFFER = 512


def sample(i: int) -> dict[str, Any]:
    """Sample ``i``: the same bytes in every process and run."""
    rng = np.random.default_rng((SEED, i))
    n = int(rng.integers(80_000, 120_001))
    return {"id": i, "image": np.frombuffer(rng.bytes(n), np.uint8), "label": i % 10}


def keep(batch: list[Any]) -> list[Any]:
    """The collate of both systems: samples stay as they come (the images are ragged)."""
    return batch


def write(system: str, out: Path, rows: int, shard_bytes: int) -> None:
    if system == "meshfeed":
        from meshfeed.sources import write_shards

        write_shards((sample(i) for i in range(rows)), out, bytes_per_shard=shard_bytes)
        return
    import litdata

    litdata.optimize(
        fn=sample,
        inputs=list(range(rows)),
        output_dir=str(out),
        chunk_bytes=shard_bytes,
        num_workers=1,
        reorder_files=False,
        verbose=False,
        start_method="fork",
    )


def evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (clean pages only; no root needed)."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --- in the child process --------------------------------------------------------------------


def _s3(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


def meshfeed_loader(src: str, cache: str, endpoint: str, workers: int) -> Any:
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    remote = {"cache_dir": cache, "storage_options": _s3(endpoint)} if endpoint else {}
    stream = ShardedStream.from_index(src, shuffle_buffer=SHUFFLE_BUFFER, **remote)
    return StreamLoader(
        stream, batch_size=BATCH, num_workers=workers, seed=1, shuffle=True, collate_fn=keep
    )


def litdata_loader(src: str, cache: str, endpoint: str, workers: int) -> Any:
    import litdata

    opts: dict[str, Any] = {}
    if endpoint:
        import litdata.streaming.downloader as ld_downloader

        # litdata's async downloads refuse a plain-http endpoint without this (a real bucket
        # is https): it only adapts litdata to the local test server
        options = getattr(ld_downloader, "_OBSTORE_CLIENT_OPTIONS", None)
        if isinstance(options, dict):
            ld_downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": "true"}  # type: ignore[attr-defined]
        opts["storage_options"] = {
            "endpoint_url": endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        }
    ds = litdata.StreamingDataset(src, cache_dir=cache, shuffle=True, seed=1, **opts)
    return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=keep)


def _ids(batches: Iterator[list[dict[str, Any]]]) -> list[int]:
    """The ids served, each image touched once per 4 KiB page: a mapped view is read only
    when touched, so a consumer that never looked at the bytes would measure no reading."""
    ids = []
    for b in batches:
        for s in b:
            int(np.asarray(s["image"])[::4096].sum())
            ids.append(int(s["id"]))
    return ids


def child(argv: list[str]) -> None:
    """``child MODE SYSTEM SRC CACHE ENDPOINT WORKERS ROWS STATE``: one measurement, as JSON."""
    mode, system, src, cache, endpoint, workers, rows, state = argv
    build = meshfeed_loader if system == "meshfeed" else litdata_loader
    __import__("meshfeed.sources" if system == "meshfeed" else "litdata")  # imports not timed
    t0 = time.perf_counter()
    loader = build(src, cache, endpoint, int(workers))
    out: dict[str, Any] = {}
    if mode == "epochs":
        for epoch in (1, 2):
            t = time.perf_counter()
            ids = _ids(iter(loader))
            out[f"epoch{epoch}"] = int(rows) / (time.perf_counter() - t)
            out[f"ok{epoch}"] = sorted(ids) == list(range(int(rows)))
    elif mode == "save":  # the state at 50 % of epoch 1
        it = iter(loader)
        for _ in range(int(rows) // BATCH // 2):
            next(it)
        Path(state).write_bytes(pickle.dumps(loader.state_dict()))
    else:
        loader.load_state_dict(pickle.loads(Path(state).read_bytes()))
        t = time.perf_counter()
        first = next(iter(loader))
        done = time.perf_counter()
        out = {"build": (done - t0) * 1e3, "iter": (done - t) * 1e3, "ok1": len(first) == BATCH}
    if system == "meshfeed":
        loader.shutdown()
    print(json.dumps(out), flush=True)


# --- in the bench's process ------------------------------------------------------------------


def report(args: Any, workers_list: list[int], s3: tuple[Any, str, str] | None = None) -> None:
    """Print the large-sample table of a bench's ``--large`` run (``args``: its ``rows``,
    ``rounds``, ``quick``), in a temporary folder removed at the end."""
    import shutil
    import tempfile

    rows = args.rows or (640 if args.quick else 6400)
    rounds = args.rounds or (1 if args.quick else 3)
    print(f"{rows} samples of 80-120 kB, 16 MiB shards, median of {rounds} interleaved rounds")
    root = Path(tempfile.mkdtemp(prefix="bench-large-"))
    try:
        lines = run(root, rows=rows, shard_mib=16, workers_list=workers_list, rounds=rounds, s3=s3)
        print("\n".join(lines), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(
    root: Path,
    *,
    rows: int,
    shard_mib: int,
    workers_list: list[int],
    rounds: int,
    s3: tuple[Any, str, str] | None = None,
) -> list[str]:
    """Write the data set with each system found here, upload it where ``s3`` says (a boto3
    client, the server's endpoint, a bucket), measure, and return the report's lines."""
    systems = ["meshfeed"]
    try:
        import litdata
    except ImportError as e:
        note = f"litdata: skipped, not installed ({e}); pip install litdata"
    else:
        systems.append("litdata")
        note = f"litdata: {litdata.__version__}"
    lines = [note]
    sources = {}
    for system in systems:
        out = root / f"large-{system}"
        t = time.perf_counter()
        write(system, out, rows, shard_mib << 20)
        mib = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
        lines.append(f"{system}: written in {time.perf_counter() - t:.1f} s, {mib:.0f} MiB")
        sources[system] = str(out)
        if s3 is not None:
            client, _, bucket = s3
            for p in sorted(x for x in out.rglob("*") if x.is_file()):
                client.upload_file(str(p), bucket, f"large-{system}/{p.relative_to(out)}")
            sources[system] = f"s3://{bucket}/large-{system}"
    endpoint = "" if s3 is None else s3[1]
    if endpoint:
        sources["meshfeed"] += "/index.json"
    lines += measure(
        sources,
        root=root,
        rows=rows,
        workers_list=workers_list,
        rounds=rounds,
        endpoint=endpoint,
        resume=not endpoint,
    )
    return lines


def run_child(python: str, *args: Any, timeout: float = 300.0) -> dict[str, Any]:
    cmd = [python, __file__, "child", *[str(a) for a in args]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def measure(
    sources: dict[str, str],
    *,
    root: Path,
    rows: int,
    workers_list: list[int],
    rounds: int,
    endpoint: str = "",
    resume: bool = True,
    resume_workers: int = 2,
) -> list[str]:
    """The rows of the large-sample table: per worker count, epoch 1 / epoch 2 samples/s of
    each system (median of ``rounds`` interleaved rounds) and meshfeed ÷ litdata; then the
    resume row. ``sources``: system -> its dataset (a folder, or an ``s3://`` URL with
    ``endpoint``)."""
    import shutil

    python = sys.executable
    got: dict[tuple[str, int, str], list[float]] = {}
    checks: list[bool] = []
    for _ in range(rounds):
        for workers in workers_list:
            for system, src in sources.items():
                cache = root / f"cache-{system}"
                shutil.rmtree(cache, ignore_errors=True)
                if not endpoint:
                    evict(Path(src))
                r = run_child(python, "epochs", system, src, cache, endpoint, workers, rows, "-")
                checks += [r["ok1"], r["ok2"]]
                for k in ("epoch1", "epoch2"):
                    got.setdefault((system, workers, k), []).append(r[k])
    states = {}
    for system, src in sources.items() if resume else ():
        states[system] = root / f"state-{system}.pkl"
        cache = root / f"cache-{system}"
        run_child(
            python, "save", system, src, cache, endpoint, resume_workers, rows, states[system]
        )
    for _ in range(rounds if resume else 0):
        for system, src in sources.items():
            cache = root / f"cache-{system}"
            r = run_child(
                python, "resume", system, src, cache, endpoint, resume_workers, rows, states[system]
            )
            checks.append(r["ok1"])
            for k in ("build", "iter"):
                got.setdefault((system, resume_workers, k), []).append(r[k])
    return _table(got, sources, workers_list, resume_workers if resume else None, all(checks))


def _table(
    got: dict[tuple[str, int, str], list[float]],
    sources: dict[str, str],
    workers_list: list[int],
    resume_workers: int | None,
    ok: bool,
) -> list[str]:
    med = {k: float(np.median(v)) for k, v in got.items()}
    both = "meshfeed" in sources and "litdata" in sources
    lines = [f"{'row':<34}{'meshfeed':>10}{'litdata':>10}{'mf/ld':>8}   per round"]
    rows = [(w, k, f"{what} samples/s", True) for w in workers_list for k, what in _EPOCHS]
    if resume_workers is not None:
        rows += [(resume_workers, k, f"resume 1st batch ms {what}", False) for k, what in _RESUME]
    for w, k, what, higher in rows:
        mf, ld = med.get(("meshfeed", w, k)), med.get(("litdata", w, k))
        line = _row(f"w={w} {what}", mf, ld, both, higher)
        if both:  # the rounds were interleaved: each round's ratio in the same conditions
            pairs = zip(got[("meshfeed", w, k)], got[("litdata", w, k)], strict=True)
            line += "   " + " / ".join(f"{a / b if higher else b / a:.2f}" for a, b in pairs)
        lines.append(line)
    lines.append(f"every epoch served each id once, each resume a full batch: {ok}")
    return lines


_EPOCHS = (("epoch1", "epoch 1"), ("epoch2", "epoch 2"))
_RESUME = (("build", "from build"), ("iter", "from iter"))


def _row(label: str, mf: float | None, ld: float | None, both: bool, higher: bool) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    ratio = "-"
    if both and mf and ld:
        # the ratio is "how many times litdata's speed": a time is inverted
        ratio = f"{(mf / ld if higher else ld / mf):.2f}x"
    return f"{label:<34}{fmt(mf):>10}{fmt(ld):>10}{ratio:>8}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2:])
    else:
        sys.exit("run bench_shards.py --large or bench_remote.py --large")
