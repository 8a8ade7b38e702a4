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
