"""Functions the multi-process storage tests run in spawned processes (importable by name)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from meshfeed.storage import ShardCache


def fetch_after_barrier(
    cache_dir: str, url: str, options: dict[str, Any], barrier: Any, out: Any
) -> None:
    """Wait until every process is ready, ask for ``url``, report (digest, stats)."""
    cache = ShardCache(cache_dir, storage_options=options)
    barrier.wait(timeout=60)
    path = cache.local_path(url)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    out.put((digest, cache.stats()))
    cache.close()


def fetch(cache_dir: str, url: str, options: dict[str, Any]) -> None:
    """Download ``url`` into the cache (the test kills this process mid-way)."""
    ShardCache(cache_dir, storage_options=options).local_path(url)


def fetch_and_hold(
    cache_dir: str, url: str, options: dict[str, Any], barrier: Any, out: Any, hold: float
) -> None:
    """Ask for ``url`` with the others, report how long it took, then keep holding it for
    ``hold`` seconds (as a stream holds the shards it reads)."""
    cache = ShardCache(cache_dir, storage_options=options, lock_timeout=hold + 5)
    barrier.wait(timeout=60)
    start = time.monotonic()
    cache.local_path(url)
    out.put(time.monotonic() - start)
    time.sleep(hold)
    cache.close()


def read_stream_on_a_full_disk(
    urls: list[str], options: dict[str, Any], cache_dir: str, max_file: int, out: Any
) -> None:
    """Read a URL stream (on_error="substitute", the default) in a process whose files cannot
    grow past ``max_file`` bytes (``RLIMIT_FSIZE``: the kernel refuses the write, as a full
    disk does); report the rows served or the error raised."""
    import resource
    import signal

    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file, resource.RLIM_INFINITY))
    try:
        rows = [2000] * len(urls)  # given: the first download happens inside a batch fetch
        stream = ShardedStream(urls, rows=rows, cache_dir=cache_dir, storage_options=options)
        loader = StreamLoader(stream, batch_size=4, seed=0, collate_fn=list)
        rows = [r for b in loader for r in b]
        out.put(("served", len(rows)))
    except Exception as e:
        out.put(("raised", f"{type(e).__name__}: {e}"))


def read_dataset_within_a_limit(
    rank: int,
    world: int,
    url: str,
    options: dict[str, Any],
    cache_dir: str,
    limit: int,
    workers: int,
) -> list[int]:
    """One gloo rank's epoch of a shard dataset from ``url`` through a cache of ``limit`` bytes."""
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    stream = ShardedStream.from_index(
        url, cache_dir=cache_dir, cache_limit=limit, storage_options=options, shuffle_buffer=64
    )
    with StreamLoader(
        stream,
        batch_size=8,
        seed=1,
        mesh={"dp": world},
        num_workers=workers,
        drop_last=False,
        collate_fn=lambda rows: [r["id"] for r in rows],
    ) as loader:
        return [i for b in loader for i in b]


def read_limited_epoch(
    url: str, options: dict[str, Any], cache_dir: str, limit: int, window: int, out: Any
) -> None:
    """One 2-worker epoch of the shard dataset at ``url`` through a cache of ``limit`` bytes,
    in a fresh process (no state left by earlier tests); report whether every row came once."""
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    stream = ShardedStream.from_index(
        url, cache_dir=cache_dir, cache_limit=limit, storage_options=options, shuffle_buffer=window
    )
    with StreamLoader(
        stream, seed=1, collate_fn=list, batch_size=8, drop_last=False, num_workers=2
    ) as lo:
        out.put(sorted(r["id"] for b in lo for r in b))
