"""ShardCache shared by real processes of one node, against moto's S3 server."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed.storage import ShardCache
from tests.storage import _procs
from tests.storage.conftest import S3


def _partial(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.glob("*/.*.meshfeed.tmp") if ".booking." not in p.name]


@pytest.mark.slow
def test_four_processes_download_a_file_once_per_node(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(1_000_000)
    url = s3.put("p/shared.bin", data)
    s3.proxy.throttle = 0.03  # the download lasts ~0.5 s, so the four requests overlap
    ctx = mp.get_context("fork")  # children use only the cache and HTTP; spawn re-imports torch
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(
            target=_procs.fetch_after_barrier,
            args=(str(tmp_path), url, s3.options, barrier, out),
        )
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert {digest for digest, _ in results} == {hashlib.sha256(data).hexdigest()}
    stats = [s for _, s in results]
    assert sum(s["downloads"] for s in stats) == 1
    assert sum(s["hits"] for s in stats) == 3
    assert sum(s["waits"] for s in stats) >= 1  # the others waited for the one download
    assert s3.proxy.counts["GET"] == 1  # counted by the server side too


@pytest.mark.slow
def test_a_writer_killed_mid_download_leaves_nothing_readable(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(1_000_000)
    url = s3.put("k/big.bin", data)
    s3.proxy.throttle = 0.1  # ~1.6 s per download: the kill lands mid-way
    ctx = mp.get_context("fork")  # children use only the cache and HTTP; spawn re-imports torch
    writer = ctx.Process(target=_procs.fetch, args=(str(tmp_path), url, s3.options))
    writer.start()
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 0 for p in _partial(tmp_path) if p.exists()):
        assert time.monotonic() < deadline and writer.is_alive(), "the download never started"
        time.sleep(0.005)
    os.kill(writer.pid, signal.SIGKILL)  # type: ignore[arg-type]
    writer.join(timeout=30)
    assert writer.exitcode == -signal.SIGKILL
    s3.proxy.throttle = 0.0
    entry = Path(ShardCache(tmp_path).entry_path(url))  # its sweep runs here
    assert not entry.exists() and not Path(f"{entry}.meshfeed.json").exists()
    assert not _partial(tmp_path), "a new cache removes the dead writer's temporary file"
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        assert Path(cache.local_path(url)).read_bytes() == data
        assert cache.stats()["downloads"] == 1
    assert not list(tmp_path.glob("*/.*.meshfeed.tmp"))


@pytest.mark.slow
def test_a_waiter_takes_over_when_the_writer_is_killed(s3: S3, tmp_path: Path) -> None:
    import threading

    data = os.urandom(1_000_000)
    url = s3.put("k/other.bin", data)
    s3.proxy.throttle = 0.1
    ctx = mp.get_context("fork")  # children use only the cache and HTTP; spawn re-imports torch
    writer = ctx.Process(target=_procs.fetch, args=(str(tmp_path), url, s3.options))
    writer.start()
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 0 for p in _partial(tmp_path) if p.exists()):
        assert time.monotonic() < deadline and writer.is_alive(), "the download never started"
        time.sleep(0.005)
    waiter = ShardCache(tmp_path, storage_options=s3.options)
    waiter.identify(url)  # the job's identity check first: the thread below waits on the lock
    got: dict[str, object] = {}
    t = threading.Thread(target=lambda: got.update(path=waiter.local_path(url)))
    t.start()
    time.sleep(0.2)  # the waiter is blocked on the writer's lock
    assert "path" not in got
    s3.proxy.throttle = 0.0
    os.kill(writer.pid, signal.SIGKILL)  # type: ignore[arg-type]
    writer.join(timeout=30)
    t.join(timeout=30)
    assert Path(str(got["path"])).read_bytes() == data
    stats = waiter.stats()
    assert stats["downloads"] == 1 and stats["waits"] >= 1
    assert not list(tmp_path.glob("*/.*.meshfeed.tmp"))
    waiter.close()


@pytest.mark.slow
def test_a_process_waiting_to_download_takes_the_copy_another_still_holds(
    s3: S3, tmp_path: Path
) -> None:
    url = s3.put("h/held.bin", os.urandom(4_000_000))
    ctx = mp.get_context("fork")
    for _ in range(2):  # the race (both ask before either published) needs a few tries
        cache_dir = tmp_path / f"cache-{_}"
        barrier, out = ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(
                target=_procs.fetch_and_hold,
                args=(str(cache_dir), url, s3.options, barrier, out, 4.0),
            )
            for _ in range(2)
        ]
        for p in procs:
            p.start()
        waits = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0  # neither timed out on the lock the other keeps
        # the waiter takes the copy once it is published, while the other still holds it: its
        # wait ends within moments of the download's, not after the hold (4 s) or the lock
        # timeout (9 s). Compared with the download's own time, which a loaded server can
        # stretch (read timeouts and retries) for both alike.
        assert max(waits) - min(waits) < 3, waits


def _disk_use(folder: Path) -> int:
    """Bytes the cache's files take (bookings are sparse placeholders: no blocks)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            if ".booking." in name:
                continue
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def _peak_while(folder: Path, run: Any) -> tuple[Any, int]:
    """``run()``'s result and the peak disk use of ``folder`` sampled every few ms meanwhile."""
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _disk_use(folder))
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        return run(), peak
    finally:
        done.set()
        t.join()


@pytest.mark.parametrize(
    ("world", "workers"),
    [
        (1, 0),
        pytest.param(2, 2, marks=pytest.mark.slow),
        pytest.param(4, 0, marks=pytest.mark.slow),
    ],
)
def test_peak_cache_disk_stays_within_the_limit_across_processes(
    s3: S3, tmp_path: Path, world: int, workers: int
) -> None:
    from meshfeed.sources import write_shards
    from tests.dist_utils import run_distributed
    from tests.storage._procs import read_dataset_within_a_limit

    samples = [{"id": i, "x": np.full(500, i, np.int32)} for i in range(1200)]
    index = write_shards(samples, tmp_path / "ds", rows_per_shard=100)  # 12 shards of ~200 kB
    sizes = []
    for f in sorted(index.parent.iterdir()):
        s3.put(f"ds/{f.name}", f.read_bytes())
        sizes.append(f.stat().st_size)
    limit = int(0.4 * sum(sizes))  # 40 % of the data
    cache = tmp_path / "cache"
    results, peak = _peak_while(
        cache,
        lambda: run_distributed(
            read_dataset_within_a_limit,
            world,
            s3.url("ds"),
            s3.options,
            str(cache),
            limit,
            workers,
        ),
    )
    served = [i for r in results for i in r]
    assert sorted(served) == list(range(1200))  # every row once, across ranks and workers
    assert 0 < peak <= limit + max(sizes), (peak, limit, max(sizes))
