"""Eviction order under ``cache_limit`` (#29): a download-ahead stops at the limit instead of
evicting what will be read soon, and a limited stream downloads each shard once per epoch."""

from __future__ import annotations

import os
import time
from pathlib import Path

from meshfeed import StreamLoader
from meshfeed.sources import ShardedStream
from meshfeed.storage._layout import IN_USE, PENDING, Entry, book
from tests.storage.conftest import S3

SIZE = 1000


def _entry(cache_dir: Path, name: str, *, age: float) -> Entry:
    """A complete entry of SIZE bytes last used ``age`` seconds ago (negative: pending)."""
    entry = Entry.of(cache_dir, f"s3://b/d/{name}", {})
    entry.data.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.temp()
    tmp.write_bytes(b"x" * SIZE)
    entry.publish(tmp, {"url": entry.url, "size": SIZE, "version": "v", "checksum": ""})
    t = time.time() - age
    os.utime(entry.sidecar, (t, t))
    return entry


def _left(cache_dir: Path) -> set[str]:
    return {p.name.removesuffix(".meshfeed.json") for p in cache_dir.glob("*/*.meshfeed.json")}


def _cache(tmp_path: Path) -> dict[str, Entry]:
    """Two idle entries (read to their end), one downloaded ahead and unread, one in use."""
    return {
        "idle-old": _entry(tmp_path, "idle-old", age=IN_USE + 20),
        "idle": _entry(tmp_path, "idle", age=IN_USE + 10),
        "pending": _entry(tmp_path, "pending", age=-PENDING),
        "in-use": _entry(tmp_path, "in-use", age=0),
    }


def _book(tmp_path: Path, name: str, *, demanded: bool) -> Path | None:
    new = Entry.of(tmp_path, f"s3://b/d/{name}", {})
    booked, _ = book(
        tmp_path, new, SIZE, limit=4 * SIZE, deadline=time.monotonic() + 5, demanded=demanded
    )
    return booked


def test_a_download_ahead_evicts_only_idle_entries_then_stops_at_the_limit(
    tmp_path: Path,
) -> None:
    _cache(tmp_path)
    assert _book(tmp_path, "a", demanded=False) is not None
    assert _left(tmp_path) == {"idle", "pending", "in-use"}  # the least recently used idle one
    assert _book(tmp_path, "b", demanded=False) is not None
    assert _left(tmp_path) == {"pending", "in-use"}
    # only what will be read soon is left: the download-ahead is refused, nothing evicted
    assert _book(tmp_path, "c", demanded=False) is None
    assert _left(tmp_path) == {"pending", "in-use"}


def test_a_demanded_download_evicts_idle_then_pending_then_in_use_entries(
    tmp_path: Path,
) -> None:
    _cache(tmp_path)
    order = []
    for name in "abcd":
        before = _left(tmp_path)
        booking = _book(tmp_path, name, demanded=True)
        assert booking is not None
        booking.unlink()  # the download is published (and read) in place of its booking
        _entry(tmp_path, name, age=0)
        order += sorted(before - _left(tmp_path))
    assert order == ["idle-old", "idle", "pending", "in-use"]


def test_a_pending_entry_is_an_ordinary_one_again_once_its_date_passes(tmp_path: Path) -> None:
    _entry(tmp_path, "stale", age=IN_USE + 1)  # a download-ahead no job read, PENDING s ago
    for i in range(3):
        _entry(tmp_path, f"p{i}", age=-PENDING)
    assert _book(tmp_path, "a", demanded=False) is not None
    assert _left(tmp_path) == {"p0", "p1", "p2"}


def test_a_limited_stream_downloads_each_shard_once_per_epoch(s3: S3, tmp_path: Path) -> None:
    from meshfeed.sources import write_shards

    rows, shards = 400, 10
    out = write_shards(
        ({"id": i, "pad": os.urandom(2000)} for i in range(rows * shards)),
        tmp_path / "ds",
        rows_per_shard=rows,
    )
    files = sorted(f for f in out.parent.iterdir() if f.name != "index.json")
    for f in files:
        s3.put(f"lim/{f.name}", f.read_bytes())
    s3.put("lim/index.json", out.read_bytes())
    stream = ShardedStream.from_index(
        s3.url("lim"),
        cache_dir=tmp_path / "cache",
        cache_limit=4 * max(f.stat().st_size for f in files) + out.stat().st_size,  # 40 %
        storage_options=s3.options,
        shuffle_buffer=rows,  # a window spans two shards
    )
    s3.proxy.reset()
    with StreamLoader(stream, seed=4, batch_size=16, collate_fn=list) as loader:
        ids = [row["id"] for batch in loader for row in batch]
    assert sorted(ids) == list(range(rows * shards))
    gets = {k: n for k, n in s3.proxy.object_gets.items() if not k.endswith("index.json")}
    assert len(gets) == shards
    assert all(n == 1 for n in gets.values()), gets  # no shard downloaded twice
