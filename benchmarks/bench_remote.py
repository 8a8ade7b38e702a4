"""Reading from an S3 API: meshfeed vs MosaicML Streaming and litdata, same data, same server.

moto's S3 server runs on 127.0.0.1 and counts the requests it answers inside its own WSGI
application (no proxy in the data path: every reader talks straight to the server), so the
requests and bytes of an epoch are counted where the server sees them. The samples are bench_shards' (``{"tokens":
int32[128..2048], "pixels": uint8[4096]}``, fixed seed), written locally in each system's
format (uncompressed, ``--shard-mib`` shards) and uploaded:

- ``meshfeed shards``: :func:`~meshfeed.sources.write_shards`, read with
  ``ShardedStream.from_index("s3://...", cache_dir=...)`` + ``StreamLoader`` (shards
  downloaded whole into the node cache as the stream reaches them);
- ``meshfeed mds``: the Mosaic MDS upload read by ``mds_stream`` (byte ranges, no cache:
  cold and warm are alike);
- ``meshfeed .bin/.idx``: the tokens only (no pixels) as a Megatron corpus, read with
  ``TokenDocuments("s3://...", cache_dir=...)`` + ``meshfeed.DataLoader`` (map-style);
- ``meshfeed windows`` / ``mf windows ranged`` (``--ranged``): the same corpus as ``TokenWindows``
  (``seq_len`` 2048, shuffled), its ``.bin`` downloaded whole into the node cache, or read by
  ranged GETs of blocks (``--block-kib``, default 1 MiB; 8 kept per process) and never cached;
- ``mosaic``: ``StreamingDataset(remote=s3://..., local=cache, shuffle=True)`` in a torch
  ``DataLoader``;
- ``litdata``: ``StreamingDataset("s3://...", cache_dir=cache, shuffle=True)`` in its
  ``StreamingDataLoader``.

One shuffled epoch, batches of 32 (a collate that keeps the samples as they come, the rows
being ragged), per system and worker count: ``cold`` with an empty cache, then ``warm`` with
the cache the cold epoch left. Reported: samples/s, MB/s of sample payload, GET requests
(object GETs, of which ranged) and MB sent by the server for the epoch, and a check that the
epoch served every sample once (row count and total token count). Time includes opening
the dataset (index download) and the workers' start.

``--large``: the large-sample rows of ``large_samples.py`` (80-120 kB samples, meshfeed vs
litdata, epoch 1 from an empty cache and epoch 2 from the cache it filled, each in a fresh
process) from this server instead.

A peer that does not import is skipped with the reason (MosaicML Streaming and litdata pin an
older numpy; here they live in their own virtualenv, where meshfeed imports with
``PYTHONPATH=src``).

    PYTHONPATH=src python benchmarks/bench_remote.py [--quick] [--rows 40000] [--shard-mib 32]
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

import bench_shards
import large_samples
from bench_shards import Data, disk_mib, import_litdata, import_mosaic, remove

BATCH = 32
LIMIT_WINDOW = 4096  # rows in a shuffle window of the cache-limit rows (set from the data)
BUCKET = "bench"


# --- the server's own counters -----------------------------------------------------------


class ServerCounts:
    """Requests moto's S3 server answered since the last :meth:`reset`: per method, object
    GETs (listings excluded), ranged GETs and body bytes sent. Counted inside the server's own
    WSGI application (a wrapper around moto's app in the same server): nothing stands between
    a reader and the server, so no reader is slowed or changed by the counting."""

    def __init__(self) -> None:
        self.methods: Counter[str] = Counter()
        self.gets = self.ranged = self.bytes = 0
        self._lock = threading.Lock()

    def app(self, inner: Any) -> Any:
        def counted(environ: dict[str, Any], start_response: Any) -> Any:
            method = environ.get("REQUEST_METHOD", "")
            key = environ.get("PATH_INFO", "").strip("/").partition("/")[2]
            with self._lock:
                self.methods[method] += 1
                if method == "GET" and key and not environ.get("QUERY_STRING"):
                    self.gets += 1
                    self.ranged += "HTTP_RANGE" in environ
            for chunk in inner(environ, start_response):
                with self._lock:
                    self.bytes += len(chunk)
                yield chunk

        return counted

    def reset(self) -> None:
        with self._lock:
            self.methods.clear()
            self.gets = self.ranged = self.bytes = 0


class S3Server:
    """moto's S3 server on 127.0.0.1 (threaded werkzeug, as ``ThreadedMotoServer``), counting."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self.counts = ServerCounts()
        app = self.counts.app(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, app, threaded=True)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()


# --- readers: each returns (samples, tokens) of one epoch -----------------------------------


def keep(batch: list[Any]) -> list[Any]:
    """The collate of every loader here: the rows are ragged, so a batch stays a list."""
    return batch


def tally(batches: Iterable[Any]) -> tuple[int, int]:
    samples = tokens = 0
    for batch in batches:
        samples += len(batch)
        tokens += sum(len(s["tokens"]) for s in batch)
    return samples, tokens


def tally_corpus(batches: Iterable[Any]) -> tuple[int, int]:
    samples = tokens = 0
    for batch in batches:
        samples += len(batch["lengths"])
        tokens += len(batch["tokens"])
    return samples, tokens


def plain_get(url: str, cache: Path, opts: dict[str, Any], workers: int) -> tuple[int, int]:
    """The transport's ceiling: every file of the meshfeed upload fetched whole, one after the
    other, with s3fs into ``cache`` (no decoding; the counts are the data's, for the check)."""
    import s3fs

    assert bench_shards.DATA is not None
    fs = s3fs.S3FileSystem(**opts)
    cache.mkdir(parents=True, exist_ok=True)
    for i, key in enumerate(sorted(fs.ls(url.removeprefix("s3://")))):
        fs.get_file(key, str(cache / str(i)))
    return bench_shards.DATA.rows, int(bench_shards.DATA.offsets[-1])


def meshfeed_shards(
    url: str, cache: Path, opts: dict[str, Any], workers: int, limit: int | None = None
) -> tuple[int, int]:
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    stream = ShardedStream.from_index(
        f"{url}/index.json",
        cache_dir=cache,
        cache_limit=limit,
        storage_options=opts,
        # under a limit, a window of rows that fits in it (as litdata shuffles within chunks):
        # a window wider than the limit would re-download its shards every batch
        shuffle_buffer=4096 if limit is None else max(64, LIMIT_WINDOW),
    )
    with StreamLoader(
        stream, batch_size=BATCH, num_workers=workers, seed=1, drop_last=False, collate_fn=keep
    ) as loader:
        return tally(loader)


def meshfeed_mds(url: str, cache: Path, opts: dict[str, Any], workers: int) -> tuple[int, int]:
    from meshfeed import StreamLoader
    from meshfeed.sources.streams.mds import mds_stream
    from meshfeed.storage import open_url

    stream = mds_stream(
        url, open_file=functools.partial(open_url, storage_options=opts), shuffle_buffer=4096
    )
    with StreamLoader(
        stream, batch_size=BATCH, num_workers=workers, seed=1, drop_last=False, collate_fn=keep
    ) as loader:
        return tally(loader)


def meshfeed_corpus(url: str, cache: Path, opts: dict[str, Any], workers: int) -> tuple[int, int]:
    from meshfeed import DataLoader
    from meshfeed.sources.tokens.windows import TokenDocuments

    docs = TokenDocuments(f"{url}/corpus", cache_dir=cache, storage_options=opts)
    with DataLoader(
        docs, batch_size=BATCH, num_workers=workers, seed=1, drop_last=False, shuffle=True
    ) as loader:
        return tally_corpus(loader)


SEQ_LEN = 2048
RANGES: Any = None  # the RangeReads of the ranged row, set in main (meshfeed imports late)


def meshfeed_windows(
    url: str, cache: Path, opts: dict[str, Any], workers: int, ranged: Any = False
) -> tuple[int, int]:
    from meshfeed import DataLoader
    from meshfeed.sources.tokens.windows import TokenWindows

    windows = TokenWindows(
        f"{url}/corpus", seq_len=SEQ_LEN, cache_dir=cache, storage_options=opts, ranged=ranged
    )
    samples = tokens = 0
    with DataLoader(
        windows,  # type: ignore[arg-type]
        batch_size=BATCH,
        num_workers=workers,
        seed=1,
        drop_last=False,
        shuffle=True,
    ) as loader:
        for batch in loader:
            samples += batch.shape[0]
            tokens += batch.numel()
    return samples, tokens


def mosaic_epoch(url: str, cache: Path, opts: dict[str, Any], workers: int) -> tuple[int, int]:
    import streaming
    import torch.utils.data
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = streaming.StreamingDataset(
        remote=url, local=str(cache), shuffle=True, batch_size=BATCH, shuffle_seed=1
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=keep)
    return tally(loader)


def litdata_epoch(
    url: str, cache: Path, opts: dict[str, Any], workers: int, limit: int | None = None
) -> tuple[int, int]:
    import litdata
    import litdata.streaming.downloader as ld_downloader

    # litdata's async downloads (obstore) refuse a plain-http endpoint without this; a real
    # bucket is https, so this only adapts litdata to the local test server
    options = getattr(ld_downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        ld_downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": "true"}  # type: ignore[attr-defined]

    ds = litdata.StreamingDataset(
        url,
        cache_dir=str(cache),
        shuffle=True,
        seed=1,
        storage_options={
            "endpoint_url": opts["endpoint_url"],
            "aws_access_key_id": opts["key"],
            "aws_secret_access_key": opts["secret"],
            "region_name": "us-east-1",
        },
        **({} if limit is None else {"max_cache_size": limit}),
    )
    loader = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=keep)
    return tally(loader)


# --- writing and uploading ------------------------------------------------------------------


def write_all(root: Path, data: Data, shard_bytes: int, peers: dict[str, bool]) -> dict[str, Path]:
    """Each format's local folder (only what the run reads)."""
    from meshfeed.sources import write_indexed, write_shards

    bench_shards.SHARD_BYTES = shard_bytes
    out = {"mf": root / "mf", "idx": root / "idx"}
    write_shards(iter(data), out["mf"], bytes_per_shard=shard_bytes)
    out["idx"].mkdir()
    docs = (data.tokens[data.offsets[i] : data.offsets[i + 1]] for i in range(data.rows))
    write_indexed(out["idx"] / "corpus", docs, dtype=np.int32)
    if peers["mosaic"]:
        out["mds"] = root / "mds"
        bench_shards.mosaic_write(out["mds"], None)
    if peers["litdata"]:
        out["ld"] = root / "ld"
        bench_shards.litdata_write(out["ld"], None)
    return out


def upload(client: Any, local: Path, prefix: str) -> int:
    files = [p for p in sorted(local.rglob("*")) if p.is_file()]
    for p in files:
        client.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(local).as_posix()}")
    return len(files)


def start_s3() -> tuple[S3Server, Any]:
    import boto3

    server = S3Server()
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=BUCKET)
    return server, client


# --- the run --------------------------------------------------------------------------------


class PeakDisk:
    """The peak bytes of the files under ``folder`` (a cache), sampled every few ms by a
    thread until :meth:`stop` (sparse booking placeholders, which take no blocks, excluded)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak = folder, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _used(self) -> int:
        total = 0
        for root, _, files in os.walk(self.folder):
            for name in files:
                if ".booking." not in name:
                    with contextlib.suppress(FileNotFoundError):
                        total += os.stat(os.path.join(root, name)).st_size
        return total

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self._used())
            time.sleep(0.005)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())


Reader = Callable[[str, Path, dict[str, Any], int], tuple[int, int]]


def run_system(
    name: str,
    read: Reader,
    url: str,
    counts: ServerCounts,
    opts: dict[str, Any],
    root: Path,
    expect: tuple[int, int],
    payload_mb: float,
    workers_list: list[int],
) -> None:
    plain = name.startswith("plain")  # a transport baseline: one row
    for workers in workers_list[:1] if plain else workers_list:
        cache = root / f"cache-{name.replace(' ', '-')}-{workers}"
        remove(cache)
        for temp in ("cold",) if plain else ("cold", "warm"):
            counts.reset()
            peak = PeakDisk(cache)
            t0 = time.perf_counter()
            try:
                got = read(url, cache, opts, workers)
            except Exception as e:  # a peer's failure is a result, not the end of the run
                print(f"{name:<20}{workers:>3} {temp:<5}  failed: {type(e).__name__}: {e}")
                break
            finally:
                peak.stop()
            t = time.perf_counter() - t0
            ok = "ok" if got == expect else f"MISMATCH {got} != {expect}"
            frac = payload_mb * got[0] / expect[0]
            print(
                f"{name:<20}{workers:>3} {temp:<5}{got[0] / t:>10,.0f}{frac / t:>8.1f}"
                f"{counts.gets:>7}{counts.ranged:>8}{counts.methods['HEAD']:>7}{counts.bytes / 1e6:>9.1f}{t:>8.1f}"
                f"{peak.peak / 2**20:>9.1f}  {ok}",
                flush=True,
            )
        remove(cache)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3,000 samples, meshfeed shards only")
    p.add_argument("--rows", type=int, default=None, help="samples (default 40k; 3k --quick)")
    p.add_argument("--shard-mib", type=int, default=None, help="shard size (16; 2 --quick)")
    p.add_argument("--workers", default="0,2", help="worker counts, comma-separated")
    p.add_argument(
        "--only",
        default=None,
        help="run only the systems whose name contains one of these (comma-separated)",
    )
    p.add_argument(
        "--ranged",
        action="store_true",
        help="add the ranged windows row (slow: every window that misses is a GET; use with "
        "--rows 10000 --only windows)",
    )
    p.add_argument(
        "--block-kib", type=int, default=1024, help="block size of the ranged windows row (KiB)"
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=30.0,
        help="meshfeed's shard-cache lock timeout (default 600 s): a stalled epoch fails then",
    )
    p.add_argument(
        "--limit-pct",
        type=float,
        default=40.0,
        help="cache-limit rows with a limit of this %% of the data (0: none; default 40)",
    )
    p.add_argument(
        "--limit-window",
        type=float,
        default=0.5,
        help="meshfeed's shuffle window in the cache-limit rows, as a share of the rows the "
        "limit holds (default 0.5; at 0.25 the next window downloads while one is read)",
    )
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds (report medians)")
    p.add_argument("--large", action="store_true", help="the large-sample rows instead")
    args = p.parse_args()
    logging.getLogger("meshfeed").setLevel(logging.ERROR)
    logging.getLogger("concurrent.futures").setLevel(logging.CRITICAL)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    rows = args.rows or (3_000 if args.quick else 40_000)
    shard_mib = args.shard_mib or (2 if args.quick else 16)
    workers_list = [int(w) for w in args.workers.split(",")]
    from meshfeed.storage import RangeReads
    from meshfeed.storage.cache import ShardCache

    global RANGES
    RANGES = RangeReads(block_size=args.block_kib << 10, max_blocks=8)  # 8 kept per process

    # Two workers that ask for one uncached shard at once can stall until the lock timeout
    # (one waits for an exclusive lock while the other holds the published copy): shorten it
    # so such an epoch shows as failed instead of stopping the run for ten minutes
    kwdefaults = ShardCache.__init__.__kwdefaults__
    if kwdefaults is not None:
        kwdefaults["lock_timeout"] = args.lock_timeout
    try:
        server, client = start_s3()
    except Exception as e:
        print(
            f"skipped: no S3 server on 127.0.0.1 ({type(e).__name__}: {e}); pip install "
            "'moto[server]' boto3 s3fs"
        )
        return
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=server.endpoint,
        S3_ENDPOINT_URL=server.endpoint,
    )
    opts = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": server.endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }
    if args.large:  # the large-sample rows instead (large_samples.py), from this server
        try:
            large_samples.report(args, workers_list, s3=(client, server.endpoint, BUCKET))
        finally:
            server.stop()
        return
    data = Data(rows)
    bench_shards.DATA = data
    expect = (rows, int(data.offsets[-1]))
    payload_mb = (data.tokens.nbytes + data.pixels.nbytes) / 1e6
    peers = {}
    for name, imp in (("mosaic", import_mosaic), ("litdata", import_litdata)):
        if args.quick:
            peers[name] = False
            print(f"{name}: skipped (--quick reads meshfeed only)")
            continue
        mod, note = imp()
        peers[name] = mod is not None
        print(f"{name}: {note}" if mod is not None else f"{name}: skipped, {note}")
    # meshfeed's S3 client, imported before any clock runs, as the peers' are just above (it
    # is imported lazily: otherwise the first meshfeed epoch of a run would time the import)
    import s3fs  # noqa: F401

    root = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        t0 = time.perf_counter()
        local = write_all(root / "data", data, shard_mib << 20, peers)
        disk_bytes = {k: int(disk_mib(v) * 2**20) for k, v in local.items()}
        sizes = {k: f"{upload(client, v, k)} files {disk_mib(v):.0f} MiB" for k, v in local.items()}
        shutil.rmtree(root / "data")
        print(
            f"{rows} samples, {payload_mb:.0f} MB payload, {shard_mib} MiB shards; written and "
            f"uploaded in {time.perf_counter() - t0:.0f} s: {sizes}; cpus {os.cpu_count()}"
        )
        print(
            f"\n{'system':<20}{'w':>3} {'cache':<5}{'samples/s':>10}{'MB/s':>8}{'GETs':>7}"
            f"{'ranged':>8}{'HEADs':>7}{'MB sent':>9}{'s':>8}{'peak MiB':>9}  epoch"
        )
        systems: list[tuple[str, Reader, str]] = [
            ("plain GET (s3fs)", plain_get, "mf"),
            ("meshfeed shards", meshfeed_shards, "mf"),
            ("meshfeed .bin/.idx*", meshfeed_corpus, "idx"),
            ("meshfeed windows*", meshfeed_windows, "win"),
        ]
        if args.ranged:
            systems.append(
                ("mf windows ranged*", functools.partial(meshfeed_windows, ranged=RANGES), "win")
            )
        if peers["mosaic"]:
            systems += [("meshfeed mds", meshfeed_mds, "mds"), ("mosaic", mosaic_epoch, "mds")]
        if peers["litdata"]:
            systems.append(("litdata", litdata_epoch, "ld"))
        if args.limit_pct:
            limit = int(disk_bytes["mf"] * args.limit_pct / 100)
            global LIMIT_WINDOW
            LIMIT_WINDOW = int(rows * limit / disk_bytes["mf"] * args.limit_window)
            print(
                f"cache limit rows: {limit / 2**20:.1f} MiB ({args.limit_pct} % of the shards); "
                f"meshfeed's shuffle window {LIMIT_WINDOW} rows"
            )
            systems.append(
                ("meshfeed shards lim", functools.partial(meshfeed_shards, limit=limit), "mf")
            )
            if peers["litdata"]:
                systems.append(("litdata lim", functools.partial(litdata_epoch, limit=limit), "ld"))
        rounds = [systems] * args.rounds  # interleaved: every system once per round
        for name, read, key in [row for r in rounds for row in r]:
            if args.only and not any(o in name for o in args.only.split(",")):
                continue
            exp = expect
            mb = payload_mb
            if key == "idx":
                mb = data.tokens.nbytes / 1e6
            if key == "win":  # the windows of the same corpus: (windows, their tokens)
                n = (int(data.offsets[-1]) - 1) // SEQ_LEN
                exp, mb, key = (n, n * (SEQ_LEN + 1)), n * SEQ_LEN * 4 / 1e6, "idx"
            run_system(
                name, read, f"s3://{BUCKET}/{key}", server.counts, opts, root, exp, mb, workers_list
            )
        print(
            "\n* tokens only (no 4 KiB field), map-style DataLoader; MB/s of its own payload"
            " (windows: int32 windows of 2048 tokens, shuffled)."
            "\nGETs: object GETs of the epoch (listings excluded), ranged: those with a Range"
            " header; MB sent: bytes the server sent for the epoch."
        )
    finally:
        server.stop()
        remove(root)


if __name__ == "__main__":
    main()
