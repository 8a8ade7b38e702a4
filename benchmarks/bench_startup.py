"""Start-up with thousands of files: time to the first batch of a stream of many shards against
one of 100 shards of the same rows, locally and on an S3 API (#32).

Both datasets hold the same rows (``{"x": int64}``), written by ``write_shards`` (index
version 2: the shards by column). Each measurement is a fresh process (imports done before the
clock starts, s3fs's too) that builds ``ShardedStream.from_index(path_or_url)`` and a ``StreamLoader``
(rank 3 of dp 8, batches of 32) and takes its first batch; on S3 with an empty cache folder of
its own (cold: the index and the shards the batch reads are downloaded). The S3 API is moto's
server on 127.0.0.1 (``bench_remote.S3Server``, which counts the requests it answers: the
object GETs while a cold start's process ran, its download-ahead of the shards it will read
included). Reported: the best of ``--repeats`` runs, in turns, and whether the many-shard
stream is within the target of 2x + 0.2 s of the 100-shard one.

Then the same for an equal-weight ``Mixture`` of Megatron corpora (``TokenDocuments`` each,
written by ``write_indexed``; the same documents split over 100 corpora against 4,000 and
10,000): time to the first batch of a ``DataLoader``, or the error it raised, twice: from the
folder's corpora manifest (``open_corpora``, written by ``write_corpora_manifest`` before the
clock starts: the corpora open on first read, so the first batch opens only those it reads),
and without one (every corpus opened and checked up front). An open corpus holds no file
descriptor (its ``.bin`` is mapped on first read through a bounded LRU, #32).

    PYTHONPATH=src python benchmarks/bench_startup.py            # 10,000 shards vs 100
    PYTHONPATH=src python benchmarks/bench_startup.py --quick    # 200 shards vs 100, 3,000 rows,
                                                                 # 100 corpora vs 50
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

BASE = 100  # the shards of the reference dataset
MANIFEST = "corpora.json"  # a corpora folder's manifest (meshfeed.sources.tokens.manifest)


def first_batch(where: str, cache: str | None, endpoint: str | None) -> dict[str, Any]:
    """Time to the first batch of the dataset at ``where`` (a fresh process)."""
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    remote: dict[str, Any] = {}
    if endpoint is not None:
        import s3fs  # noqa: F401  (an import: done before the clock, like meshfeed's)

        remote = {"cache_dir": cache, "storage_options": _options(endpoint)}
    t0 = time.perf_counter()
    stream = ShardedStream.from_index(where, **remote)
    with StreamLoader(stream, batch_size=32, mesh={"dp": 8}, rank=3, seed=0) as loader:
        batch = next(iter(loader))
    took = time.perf_counter() - t0
    return {"first_s": took, "rows": len(batch["x"])}


def first_batch_of_mixture(
    folder: str,
    corpora: int,
    manifest: bool,
    cache: str | None = None,
    endpoint: str | None = None,
) -> dict[str, Any]:
    """Time to the first batch of an equal-weight ``Mixture`` of the ``corpora`` Megatron
    corpora ``c00000`` ... in ``folder`` (``TokenDocuments`` each), from the folder's manifest
    or each opened by its prefix, or the error it raised; a bucket's through ``cache``."""
    import meshfeed
    from meshfeed.sources import TokenDocuments
    from meshfeed.sources.tokens.manifest import open_corpora

    remote: dict[str, Any] = {}
    if endpoint is not None:
        import s3fs  # noqa: F401  (an import: done before the clock, like meshfeed's)

        remote = {"cache_dir": cache, "storage_options": _options(endpoint)}
    t0 = time.perf_counter()
    try:
        if manifest:
            corpora_of = open_corpora(folder, **remote)
            sources = {n: TokenDocuments(c) for n, c in corpora_of.items()}
        else:
            sources = {f"c{i}": TokenDocuments(f"{folder}/c{i:05d}") for i in range(corpora)}
        mix = meshfeed.Mixture(sources, dict.fromkeys(sources, 1), seed=0)
        loader = meshfeed.DataLoader(
            mix, batch_size=32, mesh={"dp": 8}, rank=3, seed=0, collate_fn=list
        )
        next(iter(loader))
    except OSError as e:  # too many open files (before #32 each corpus held two maps)
        return {"first_s": None, "error": f"{type(e).__name__}: {e}"}
    return {"first_s": time.perf_counter() - t0}


def write_corpora(root: Path, sizes: list[int], documents: int) -> None:
    """``documents`` documents (8 tokens each) split over each of ``sizes`` corpora, with the
    folder's corpora manifest."""
    from meshfeed.sources import write_indexed
    from meshfeed.sources.tokens.manifest import write_corpora_manifest

    for n in sizes:
        for i in range(n):
            docs = (np.arange(8) + j for j in range(documents // n))
            write_indexed(root / f"m{n}" / f"c{i:05d}", docs, np.uint16)
        write_corpora_manifest(root / f"m{n}")


def corpus_mixtures(
    where: dict[int, str],
    documents: int,
    repeats: int,
    manifest: bool,
    s3: tuple[str, Path] | None = None,
) -> list[str]:
    """A mixture of the first of ``where``'s corpus counts against the others (folders or
    URLs of the same documents, written by :func:`write_corpora`), from the manifest or not:
    the best of ``repeats`` fresh processes (``--quick``: one process, the reference first,
    untimed, then each). ``s3``: the endpoint and a folder for an empty cache per run."""
    sizes = list(where)

    def run(n: int, tag: str) -> dict[str, Any]:
        cold = None if s3 is None else str(s3[1] / f"m{n}-{int(manifest)}-{tag}")
        endpoint = None if s3 is None else s3[0]
        return dict(folder=where[n], corpora=n, manifest=manifest, cache=cold, endpoint=endpoint)

    if repeats == 1:
        got = _mixture_children([run(sizes[0], "warm"), *(run(n, "0") for n in sizes)])[1:]
    else:
        got = []
        for n in sizes:
            tries = [_mixture_children([run(n, str(r))])[0] for r in range(repeats)]
            got.append(min(tries, key=lambda g: g["first_s"] or float("inf")))
    base = got[0]["first_s"]
    lines = []
    how = "from the manifest" if manifest else "each corpus opened by its prefix"
    how += "" if s3 is None else ", s3, cold cache"
    if base is None:
        return [f"corpus mixture ({how}): {sizes[0]} corpora fail: {got[0]['error']}"]
    for n, g in zip(sizes[1:], got[1:], strict=True):
        if g["first_s"] is None:
            lines.append(f"corpus mixture ({how}): {n} corpora fail: {g['error']}")
            continue
        target = 2 * base + 0.2
        ok = "within" if g["first_s"] <= target else "NOT within"
        lines.append(
            f"corpus mixture ({how}), {documents} documents: {sizes[0]} corpora "
            f"{base * 1e3:.0f} ms, "
            f"{n} corpora {g['first_s'] * 1e3:.0f} ms (x{g['first_s'] / base:.2f}): {ok} "
            f"2x + 0.2 s = {target * 1e3:.0f} ms"
        )
    return lines


def _mixture_children(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--mixture", json.dumps(runs)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"corpus mixture {runs} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(runs) :]]


def _options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


def _children(runs: list[dict[str, Any]], one_process: bool) -> list[float]:
    """First-batch times of ``runs`` (``first_batch``'s arguments), each in a fresh process, or
    all in one (``--quick``: a process start costs seconds on a loaded machine)."""
    groups = [runs] if one_process else [[r] for r in runs]
    out = []
    for group in groups:
        cmd = [sys.executable, __file__, "--child", json.dumps(group)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"first batch of {group} failed:\n{done.stderr[-3000:]}")
        lines = done.stdout.strip().splitlines()[-len(group) :]
        out += [float(json.loads(line)["first_s"]) for line in lines]
    return out


def write(root: Path, files: int, rows: int) -> dict[int, Path]:
    from meshfeed.sources import write_shards

    out = {}
    for n in (BASE, files):
        samples = ({"x": np.int64(i)} for i in range(rows))
        write_shards(samples, root / f"d{n}", rows_per_shard=rows // n)
        out[n] = root / f"d{n}"
    return out


def upload(client: Any, bucket: str, local: Path, prefix: str, last: str = "index.json") -> None:
    """Every file of ``local`` under ``prefix``, 32 at once (the index, ``last``, last)."""
    files = sorted(p for p in local.iterdir() if p.name != last)
    with cf.ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), bucket, f"{prefix}/{p.name}"), files))
    client.upload_file(str(local / last), bucket, f"{prefix}/{last}")


def measure(
    runs: dict[tuple[str, int], dict[str, Any]], repeats: int, server: Any = None
) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], int]]:
    """The best first-batch time per run, in turns, a process each; the GETs the server
    answered while each cold start's process ran (its download-ahead included). One run
    (``--quick``): every run in one process, no GETs counted."""
    best: dict[tuple[str, int], float] = {}
    gets: dict[tuple[str, int], int] = {}
    if repeats == 1:
        # one process: every run once first, untimed (what a process loads on first use,
        # s3fs's client included), then the timed runs, each S3 one with a cache of its own
        warm = [{**r, "cache": r["cache"] and f"{r['cache']}-warm"} for r in runs.values()]
        took = _children([*warm, *runs.values()], one_process=True)[len(warm) :]
        return dict(zip(runs, took, strict=True)), gets
    for r in range(repeats):
        for key, run in runs.items():
            if run["cache"] is not None:
                run = {**run, "cache": f"{run['cache']}-{r}"}  # cold: an empty cache each
            if server is not None:
                server.counts.reset()
            took = _children([run], one_process=False)[0]
            best[key] = min(best.get(key, took), took)
            if server is not None and run["endpoint"] is not None:
                gets[key] = server.counts.gets
    return best, gets


def verdict(
    where: str, files: int, best: dict[tuple[str, int], float], gets: dict[tuple[str, int], int]
) -> str:
    base, many = best[(where, BASE)], best[(where, files)]
    target = 2 * base + 0.2
    ok = "within" if many <= target else "NOT within"
    line = (
        f"{where}: {BASE} shards {base * 1e3:.0f} ms, {files} shards {many * 1e3:.0f} ms "
        f"(x{many / base:.2f}): {ok} 2x + 0.2 s = {target * 1e3:.0f} ms"
    )
    if (where, BASE) in gets:
        line += (
            f"; object GETs while a cold start's process ran (download-ahead included): "
            f"{gets[(where, BASE)]} and {gets[(where, files)]}"
        )
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="200 shards, 100 corpora against 50, one process"
    )
    parser.add_argument("--files", type=int, default=None, help="shards of the large dataset")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-s3", action="store_true", help="local only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mixture", help=argparse.SUPPRESS)
    parser.add_argument(
        "--corpora",
        default=None,
        help="corpus counts of the mixture rows, comma-separated, against 100 (default "
        "4000,10000; --quick 100 against 50; 0: none)",
    )
    parser.add_argument(
        "--manifest-only",
        action="store_true",
        help="corpus mixtures from their manifest only (skip opening every corpus up front)",
    )
    args = parser.parse_args()
    if args.mixture:
        for run in json.loads(args.mixture):
            print(json.dumps(first_batch_of_mixture(**run)), flush=True)
        return
    if args.child:
        for run in json.loads(args.child):
            print(json.dumps(first_batch(**run)), flush=True)
        return
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    files = args.files or (200 if args.quick else 10_000)
    repeats = args.repeats or (1 if args.quick else 3)
    rows = 3_000 if args.quick else 20_000
    how = f"best of {repeats} fresh processes each" if repeats > 1 else "one process, warmed up"
    lines = [f"{rows} rows; {how}"]
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        local = write(tmp, files, rows)
        runs = {
            ("local", n): {"where": str(local[n]), "cache": None, "endpoint": None}
            for n in (files, BASE)
        }
        server = None if args.no_s3 else stack.enter_context(s3_server(lines))
        if server is not None:
            t0 = time.perf_counter()
            for n in (files, BASE):
                upload(server.client, server.bucket, local[n], f"d{n}")
            lines.append(f"s3: moto on 127.0.0.1, uploaded in {time.perf_counter() - t0:.0f} s")
            for n in (files, BASE):
                url = f"s3://{server.bucket}/d{n}"
                cache = str(tmp / f"cache-{n}")
                runs[("s3", n)] = {"where": url, "cache": cache, "endpoint": server.endpoint}
        best, gets = measure(runs, repeats, server)
        lines += [verdict(w, files, best, gets) for w in ("local", "s3") if (w, BASE) in best]
        corpora = [
            int(c) for c in (args.corpora or ("100" if args.quick else "4000,10000")).split(",")
        ]
        if corpora != [0]:
            sizes = [BASE // 2 if args.quick else BASE, *corpora]  # --quick: 50 vs 100
            write_corpora(tmp, sizes, rows)
            local_at = {n: str(tmp / f"m{n}") for n in sizes}
            for manifest in (True,) if args.manifest_only else (True, False):
                lines += corpus_mixtures(local_at, rows, repeats, manifest)
            if server is not None:
                t0 = time.perf_counter()
                for n in sizes:
                    upload(server.client, server.bucket, tmp / f"m{n}", f"m{n}", last=MANIFEST)
                lines.append(f"s3: corpora uploaded in {time.perf_counter() - t0:.0f} s")
                urls = {n: f"s3://{server.bucket}/m{n}" for n in sizes}
                s3 = (server.endpoint, tmp / "corpora-cache")
                lines += corpus_mixtures(urls, rows, repeats, True, s3)
    text = "\n".join(lines)
    print(text)
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"startup{'_quick' if args.quick else ''}.txt").write_text(text + "\n")


@contextlib.contextmanager
def s3_server(lines: list[str]) -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1 with a bucket (``bench_remote``'s, which counts the
    requests it answers), or None with a line saying why it is skipped."""
    try:
        from bench_remote import BUCKET, start_s3

        server, client = start_s3()
    except Exception as e:
        lines.append(f"s3: skipped ({type(e).__name__}: {e}); pip install 'moto[server]' s3fs")
        yield None
        return
    server.client, server.bucket = client, BUCKET
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":
    main()
