"""Eviction order under ``cache_limit`` (#29): a download-ahead stops at the limit instead of
evicting what will be read soon, and a limited stream downloads each shard once per epoch."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from meshfeed import StreamLoader
from meshfeed.sources import ShardedStream
from meshfeed.storage import ShardCache
from meshfeed.storage._layout import IN_USE, PENDING, Entry, book
from tests.storage.conftest import S3, options_for

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


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_limited_stream_downloads_each_shard_once_per_epoch(
    s3: S3, tmp_path: Path, workers: int
) -> None:
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
        # GETs are counted: a body that stalls 2 s on a loaded machine is no second download,
        # but the client sends the GET again (the client waits 30 s for a body, not 2)
        storage_options=options_for(s3.proxy.endpoint, read_timeout=30.0),
        shuffle_buffer=rows,  # a window spans two shards
    )
    s3.proxy.reset()
    with StreamLoader(
        stream, seed=4, batch_size=16, collate_fn=list, num_workers=workers
    ) as loader:
        ids = [row["id"] for batch in loader for row in batch]
    assert sorted(ids) == list(range(rows * shards))
    gets = {k: n for k, n in s3.proxy.object_gets.items() if not k.endswith("index.json")}
    assert len(gets) == shards
    assert all(n == 1 for n in gets.values()), gets  # no shard downloaded twice


def test_a_demanded_download_evicts_the_last_downloaded_ahead_first(tmp_path: Path) -> None:
    # download-ahead runs in reading order: the last one downloaded is the last to be read
    _entry(tmp_path, "soon", age=-PENDING)
    _entry(tmp_path, "later", age=-PENDING - 1)
    new = Entry.of(tmp_path, "s3://b/d/now", {})
    booked, evicted = book(tmp_path, new, SIZE, limit=2 * SIZE, deadline=time.monotonic() + 5)
    assert booked is not None and evicted == 1
    assert _left(tmp_path) == {"soon"}


def _wait_cached(cache: ShardCache, url: str) -> None:
    deadline = time.monotonic() + 30
    while not Path(cache.entry_path(url) + ".meshfeed.json").exists():
        assert time.monotonic() < deadline, f"{url} was not downloaded ahead within 30 s"
        time.sleep(0.01)


def _wait_counted(cache: ShardCache, key: str, value: int) -> None:
    """Wait until ``cache.stats()[key]`` reaches ``value``: a download-ahead's thread counts
    it after the file is published (a loaded machine can run the test in between)."""
    deadline = time.monotonic() + 30
    while cache.stats()[key] < value:
        assert time.monotonic() < deadline, f"{key} is {cache.stats()[key]} after 30 s"
        time.sleep(0.01)


def test_a_download_ahead_that_found_no_room_runs_once_a_shard_is_finished(
    s3: S3, tmp_path: Path
) -> None:
    urls = [s3.put(f"q/s{i}.bin", os.urandom(SIZE)) for i in range(4)]
    with ShardCache(tmp_path, cache_limit=3 * SIZE, storage_options=s3.options) as cache:
        cache.local_path(urls[0])
        cache.local_path(urls[1])  # held: never evicted
        futures = cache.prefetch(urls[2:])
        assert [f.result(timeout=30) for f in futures] == [True, False]  # the limit holds
        assert cache.stats()["skipped_prefetch"] == 1
        cache.release(urls[0])
        cache.finished(urls[0])  # read to its end: evicted first, the waiting one goes
        _wait_cached(cache, urls[3])
        _wait_counted(cache, "resumed_prefetch", 1)
        assert not Path(cache.entry_path(urls[0])).exists()
        assert all(Path(cache.entry_path(u)).exists() for u in urls[1:])  # held and pending kept
        stats = cache.stats()
        assert (stats["resumed_prefetch"], stats["downloads"], stats["evictions"]) == (1, 4, 1)


def test_waiting_download_aheads_run_in_the_order_asked_as_room_is_freed(
    s3: S3, tmp_path: Path
) -> None:
    urls = [s3.put(f"o/s{i}.bin", os.urandom(SIZE)) for i in range(5)]
    with ShardCache(tmp_path, cache_limit=2 * SIZE, storage_options=s3.options) as cache:
        for url in urls[:2]:
            cache.local_path(url)
        assert [f.result(timeout=30) for f in cache.prefetch(urls[2:])] == [False] * 3
        for done, expect in ((urls[0], urls[2]), (urls[1], urls[3])):
            cache.release(done)
            cache.finished(done)
            _wait_cached(cache, expect)
            time.sleep(0.2)  # a download out of order would land meanwhile
            cached = {u for u in urls if Path(cache.entry_path(u)).exists()}
            assert len(cached) == 2 and expect in cached  # never above the limit
        assert not Path(cache.entry_path(urls[4])).exists()  # still waits: no room


def test_a_file_the_reader_asks_for_no_longer_waits_to_be_downloaded_ahead(
    s3: S3, tmp_path: Path
) -> None:
    urls = [s3.put(f"d/s{i}.bin", os.urandom(SIZE)) for i in range(3)]
    with ShardCache(tmp_path, cache_limit=2 * SIZE, storage_options=s3.options) as cache:
        cache.local_path(urls[0])
        cache.local_path(urls[1])
        assert [f.result(timeout=30) for f in cache.prefetch(urls[2:])] == [False]
        cache.release(urls[0])
        cache.release(urls[1])
        cache.local_path(urls[2], make_room=lambda: None)  # demanded: evicts what it must
        cache.finished(urls[0])
        time.sleep(0.2)
        assert cache.stats()["resumed_prefetch"] == 0
        assert cache.stats()["downloads"] == 3


def test_a_download_ahead_asked_for_by_a_reader_first_is_never_downloaded_again(
    s3: S3, tmp_path: Path
) -> None:
    """Download-aheads wait in order (here for the only transfer slot); a reader that asks for
    one first, reads it to its end and sees it evicted must not find it downloaded a second
    time once room is freed: its place in the queue is gone, however late its task runs."""
    slow = s3.put("w/slow.bin", os.urandom(1 << 20))
    asked, other = (s3.put(f"w/{n}.bin", os.urandom(SIZE)) for n in ("asked", "other"))
    limit = (1 << 20) + SIZE + SIZE // 2  # the slow one and one small file
    with ShardCache(
        tmp_path, cache_limit=limit, storage_options=s3.options, prefetch_workers=1
    ) as cache:
        s3.proxy.throttle = 0.05  # about 0.8 s for the slow file's 16 blocks
        futures = cache.prefetch([slow, asked])
        cache.local_path(asked)  # the reader asks for it first: downloaded now
        cache.release(asked)
        cache.finished(asked)
        cache.local_path(other, make_room=lambda: None)  # evicts `asked` (read to its end)
        cache.release(other)
        assert not Path(cache.entry_path(asked)).exists()
        [f.result(timeout=30) for f in futures]
        s3.proxy.throttle = 0.0
        for url in (slow, other):  # room for anything still waiting
            cache.finished(url)
        time.sleep(0.5)  # a download-ahead still waiting would run now
        gets = {k.rsplit("/", 1)[-1]: n for k, n in s3.proxy.object_gets.items()}
        assert gets["asked.bin"] == 1, gets


@pytest.mark.parametrize("until_finished", [True, False])
def test_a_file_read_until_finished_is_kept_from_download_aheads_however_long_unread(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, until_finished: bool
) -> None:
    """A stream that fetched a shard itself (before its download-ahead ran), read part of it,
    and left it unread and unheld for longer than IN_USE (a loaded machine; a worker waiting
    for the training loop) must find it still cached for its other rows: a download-ahead
    that evicted it downloaded it twice (one of 24 shards, in a warm 2-worker limited epoch
    under load). A plain reader's file is an ordinary idle entry then, as before."""
    from meshfeed.storage import _layout

    monkeypatch.setattr(_layout, "IN_USE", 0.05)  # the reader's pause, made short
    urls = [s3.put(f"u/s{i}.bin", os.urandom(SIZE)) for i in range(2)]
    with ShardCache(tmp_path, cache_limit=SIZE, storage_options=s3.options) as cache:
        cache.local_path(urls[0], until_finished=until_finished)
        cache.release(urls[0])
        time.sleep(0.2)
        (ahead,) = cache.prefetch(urls[1:])
        got = ahead.result(timeout=30)
        first = Path(cache.entry_path(urls[0]))
        if not until_finished:
            assert got and not first.exists()
            return
        assert not got and first.exists()  # the limit holds; nothing evicted
        assert cache.local_path(urls[0]) == str(first)  # its other rows: no second download
        cache.release(urls[0])
        cache.finished(urls[0])  # read to its end: evicted first, the waiting one goes
        _wait_cached(cache, urls[1])
        _wait_counted(cache, "downloads", 2)  # counted after the file is published
        assert not first.exists()
        assert cache.stats()["downloads"] == 2
