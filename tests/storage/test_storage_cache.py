"""ShardCache against moto's S3 server (through a fault-injecting proxy), in one process."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from meshfeed.errors import SourceError
from meshfeed.storage import CacheDiskError, ShardCache, version_of
from tests.storage.conftest import S3, options_for


def _put_many(s3: S3, n: int, size: int) -> dict[str, bytes]:
    out = {}
    for i in range(n):
        data = os.urandom(size)
        out[s3.put(f"shards/s{i:03d}.bin", data)] = data
    return out


def _idle(data: Path) -> None:
    """Date the entry of ``data`` as last read long ago (a download-ahead may evict it)."""
    old = time.time() - 60
    os.utime(data.with_name(data.name + ".meshfeed.json"), (old, old))


def _temps(cache_dir: Path) -> list[Path]:
    return list(cache_dir.glob("*/.*.meshfeed.tmp"))


def _wait_for_partial(cache_dir: Path, timeout: float = 10.0) -> None:
    """Until a download has written bytes (a booking, full-size from the start, is not one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        downloads = [p for p in _temps(cache_dir) if ".booking." not in p.name]
        if any(p.stat().st_size > 0 for p in downloads if p.exists()):
            return
        time.sleep(0.005)
    raise AssertionError("the download never started writing")


def test_a_file_downloads_once_and_is_then_a_hit(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(200_000)
    url = s3.put("a/x.bin", data)
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        p1 = cache.local_path(url)
        p2 = cache.local_path(url)
        assert p1 == p2 and Path(p1).read_bytes() == data
        stats = cache.stats()
    assert stats["downloads"] == 1 and stats["hits"] == 1 and stats["bytes"] == 200_000
    assert stats["gets"] == 1 and s3.proxy.counts["GET"] == 1  # one GET for the whole file
    meta = json.loads(Path(p1 + ".meshfeed.json").read_text())
    assert meta["url"] == url and meta["size"] == 200_000
    assert meta["checksum"] == "md5:" + hashlib.md5(data).hexdigest()  # = the ETag, checked
    assert meta["version"] == version_of(url, storage_options=s3.options)


def test_a_restart_reuses_the_cache_after_one_identity_check_per_file(
    s3: S3, tmp_path: Path
) -> None:
    files = _put_many(s3, 3, 50_000)
    with ShardCache(tmp_path, storage_options=s3.options) as first:
        for url in files:
            first.local_path(url)
    s3.proxy.reset()
    with ShardCache(tmp_path, storage_options=s3.options, verify="checksum") as again:
        for _ in range(2):
            for url, data in files.items():
                assert Path(again.local_path(url)).read_bytes() == data
                again.release(url)
        stats = again.stats()
    assert stats["downloads"] == 0 and stats["hits"] == 6 and stats["gets"] == 0
    # the cached copies are checked against the bucket once per job: one HEAD per file
    assert s3.proxy.counts["HEAD"] == 3 and sum(s3.proxy.counts.values()) == 3


def test_a_file_rewritten_in_the_bucket_is_not_served_from_a_stale_cache(
    s3: S3, tmp_path: Path
) -> None:
    url = s3.put("a/index.json", b'{"old": 1}')
    with ShardCache(tmp_path, storage_options=s3.options) as first:
        assert Path(first.local_path(url)).read_bytes() == b'{"old": 1}'
    s3.put("a/index.json", b'{"new": 22}')  # a new job, the same cache_dir
    with ShardCache(tmp_path, storage_options=s3.options) as again:
        assert Path(again.local_path(url)).read_bytes() == b'{"new": 22}'
        assert again.stats()["downloads"] == 1


def test_an_expected_file_needs_no_request_and_is_checked_as_it_enters(
    s3: S3, tmp_path: Path
) -> None:
    data = os.urandom(40_000)
    url = s3.put("a/shard.mfs", data)
    digest = "blake2b:" + hashlib.blake2b(data, digest_size=16).hexdigest()
    s3.proxy.reset()
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        cache.expect(url, digest=digest, size=len(data))
        assert Path(cache.local_path(url)).read_bytes() == data
        cache.release(url)
        worker = pickle.loads(pickle.dumps(cache))  # expectations travel to workers
        assert Path(worker.local_path(url)).read_bytes() == data
        worker.close()
    assert s3.proxy.counts["HEAD"] == 0 and s3.proxy.counts["GET"] == 1
    s3.put("a/shard.mfs", os.urandom(40_000))  # rewritten behind its index's back
    with ShardCache(tmp_path / "fresh", storage_options=s3.options) as cache:
        cache.expect(url, digest=digest, size=len(data))
        with pytest.raises(SourceError, match=r"shard s3://.*a/shard\.mfs does not match"):
            cache.local_path(url)
    with pytest.raises(ValueError, match="digest='blake2b:HEX'"):
        cache.expect(url, digest="md5:00", size=1)


def _expect(cache: ShardCache, url: str, data: bytes) -> None:
    digest = "blake2b:" + hashlib.blake2b(data, digest_size=16).hexdigest()
    cache.expect(url, digest=digest, size=len(data))


def _read(cache: ShardCache, url: str) -> bytes:
    try:
        return Path(cache.local_path(url)).read_bytes()
    finally:
        cache.release(url)


def _evicted_a(s3: S3, tmp_path: Path, a: bytes) -> str:
    """``a`` and another shard read through a cache that holds one: ``a`` is evicted, its
    checked download's ETag recorded."""
    ua, ub = s3.put("v/a.mfs", a), s3.put("v/b.mfs", os.urandom(len(a)))
    with ShardCache(tmp_path, storage_options=s3.options, cache_limit=len(a) * 3 // 2) as cache:
        _expect(cache, ua, a)
        assert _read(cache, ua) == a
        _expect(cache, ub, s3.client.get_object(Bucket=s3.bucket, Key="v/b.mfs")["Body"].read())
        _read(cache, ub)
        assert cache.stats()["evictions"] == 1 and cache.stats()["vouched"] == 0
    return ua


def test_a_checked_object_downloaded_again_is_vouched_for_by_its_etag(
    s3: S3, tmp_path: Path
) -> None:
    """Read again after eviction (in another process too: the record is on disk), a shard the
    cache checked against its index is one GET If-Match its recorded ETag, not hashed."""
    a = os.urandom(300_000)
    ua = _evicted_a(s3, tmp_path, a)
    s3.proxy.reset()
    with ShardCache(tmp_path, storage_options=s3.options, cache_limit=450_000) as cache:
        _expect(cache, ua, a)
        assert _read(cache, ua) == a
        stats = cache.stats()
    assert stats["downloads"] == 1 and stats["vouched"] == 1
    assert s3.proxy.counts["GET"] == 1 and s3.proxy.counts["HEAD"] == 0


def test_an_object_rewritten_after_its_checked_download_is_refused_by_name(
    s3: S3, tmp_path: Path
) -> None:
    """The server refuses the recorded ETag (412): the download is hashed as a first one, and
    the rewritten shard disagrees with its index."""
    a = os.urandom(300_000)
    ua = _evicted_a(s3, tmp_path, a)
    s3.put("v/a.mfs", os.urandom(len(a)))  # same size, other bytes, behind the index's back
    s3.proxy.reset()
    with ShardCache(tmp_path, storage_options=s3.options, cache_limit=450_000) as cache:
        _expect(cache, ua, a)
        with pytest.raises(SourceError, match=r"v/a\.mfs does not match its index\.json"):
            cache.local_path(ua)
        assert cache.stats()["vouched"] == 0
    assert s3.proxy.counts["GET"] == 2  # the refused If-Match, then the checked download


def test_an_etag_record_that_cannot_be_written_costs_the_download_nothing(
    s3: S3, tmp_path: Path
) -> None:
    data = os.urandom(50_000)
    url = s3.put("v/c.mfs", data)
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        record = Path(cache.entry_path(url) + ".meshfeed.etag")
        record.mkdir(parents=True)  # in the record's place: it cannot be written
        _expect(cache, url, data)
        assert _read(cache, url) == data
        assert cache.stats()["downloads"] == 1 and record.is_dir()
    assert not list(record.parent.glob(".*.meshfeed.tmp"))


def test_a_cut_download_resumes_at_the_byte_it_reached(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(3_000_000)
    url = s3.put("r/big.mfs", data)
    s3.proxy.reset()
    s3.proxy.cut_next, s3.proxy.cut_at = 1, 1_000_000
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        _expect(cache, url, data)
        assert _read(cache, url) == data
        stats = cache.stats()
    assert stats["downloads"] == 1 and stats["retries"] == 0
    [(path, gets)] = s3.proxy.object_gets.items()
    assert gets == 2 and s3.proxy.whole_gets[path] == 1  # the resume asked for the rest only


def test_a_vouched_download_cut_mid_way_never_splices_a_rewritten_object(
    s3: S3, tmp_path: Path
) -> None:
    """Every request of a download that is not hashed names the ETag: a shard rewritten between
    a cut and its resume is downloaded again and checked, never pieced together."""
    a = os.urandom(3_000_000)
    ua = _evicted_a(s3, tmp_path, a)
    s3.proxy.reset()
    s3.proxy.cut_next, s3.proxy.cut_at = 1, 1_000_000
    s3.proxy.on_cut = lambda: s3.put("v/a.mfs", os.urandom(len(a)))
    with ShardCache(
        tmp_path, storage_options=s3.options, cache_limit=4_500_000, retry_timeout=15
    ) as cache:
        _expect(cache, ua, a)
        with pytest.raises(SourceError, match=r"v/a\.mfs does not match its index\.json"):
            cache.local_path(ua)
    assert s3.proxy.whole_gets and max(s3.proxy.object_gets.values()) >= 3


def test_a_corrupted_entry_is_downloaded_again_under_checksum_verification(
    s3: S3, tmp_path: Path
) -> None:
    data = os.urandom(30_000)
    url = s3.put("c/x.bin", data)
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        path = Path(cache.local_path(url))
    with open(path, "r+b") as f:  # same size, other bytes: only a checksum notices
        f.write(b"\0" * 100)
    with ShardCache(tmp_path, storage_options=s3.options, verify="checksum") as cache:
        assert Path(cache.local_path(url)).read_bytes() == data
        assert cache.stats()["downloads"] == 1


def test_the_limit_evicts_least_recently_used_entries_but_never_a_held_one(
    s3: S3, tmp_path: Path
) -> None:
    files = _put_many(s3, 6, 40_000)
    urls = list(files)
    cache = ShardCache(tmp_path, cache_limit=100_000, storage_options=s3.options)
    held = cache.local_path(urls[0])  # held through the whole pass
    for url in urls[1:]:
        with cache.hold(url) as path:
            assert Path(path).read_bytes() == files[url]
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("*/s*.bin"))
        assert on_disk <= 100_000
    assert Path(held).read_bytes() == files[urls[0]], "a held entry was evicted"
    stats = cache.stats()
    assert stats["evictions"] >= 3 and stats["downloads"] == 6
    # the evicted ones come back by downloading again; the held one is still a hit
    s3.proxy.reset()
    cache.local_path(urls[0])
    assert s3.proxy.counts["GET"] == 0
    cache.close()


def test_holds_are_counted_per_call_and_the_last_release_frees_the_entry(
    s3: S3, tmp_path: Path
) -> None:
    files = _put_many(s3, 3, 40_000)
    a, b, c = files
    cache = ShardCache(tmp_path, cache_limit=90_000, storage_options=s3.options)
    cache.local_path(a)
    cache.local_path(a)  # a second reader of the same file in this process
    cache.release(a)
    with cache.hold(b), pytest.raises(SourceError, match="this reader itself holds 2 files"):
        cache.local_path(c)  # a and b held by this reader: the limit is a limit, by name
    assert cache.stats()["evictions"] == 0 and Path(cache.entry_path(a)).exists()
    cache.release(a)
    cache.local_path(c)  # a released: evicted to make room
    assert not Path(cache.entry_path(a)).exists()
    cache.release(c)
    cache.local_path(a)
    cache.release(a)
    with cache.hold(b):
        ShardCache(tmp_path, cache_limit=90_000, storage_options=s3.options).local_path(
            s3.put("shards/extra.bin", os.urandom(40_000))
        )
    assert not Path(cache.entry_path(a)).exists()  # released and least recently used: evicted
    cache.close()


def test_prefetch_downloads_ahead_within_the_limit(s3: S3, tmp_path: Path) -> None:
    files = _put_many(s3, 4, 40_000)
    urls = list(files)
    with ShardCache(tmp_path, cache_limit=130_000, storage_options=s3.options) as cache:
        pinned = cache.local_path(urls[0])
        other = ShardCache(tmp_path, storage_options=s3.options)  # another process's hold
        other.local_path(urls[1])
        results = [f.result(timeout=30) for f in cache.prefetch(urls[2:])]
        # 80 kB held of 130 kB: one download-ahead fits, the other (concurrent) cannot make room
        assert sorted(results) == [False, True]
        assert cache.stats()["skipped_prefetch"] == 1
        other.close()  # urls[1] may go now, once idle: read to its end a while ago
        _idle(Path(cache.entry_path(urls[1])))
        assert [f.result(timeout=30) for f in cache.prefetch(urls[2:])] == [True, True]
        assert cache.stats()["evictions"] == 1
        assert Path(pinned).read_bytes() == files[urls[0]]
        s3.proxy.reset()
        for url in urls[2:]:
            assert Path(cache.local_path(url)).read_bytes() == files[url]
        assert s3.proxy.counts["GET"] == 0  # served by the download-ahead
        assert not list(tmp_path.glob("*/.*.meshfeed.tmp"))  # no booking left behind


def test_open_range_reads_part_of_a_file_with_one_ranged_get(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(100_000)
    url = s3.put("r/x.bin", data)
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        assert cache.open_range(url, 1000, 1500) == data[1000:1500]
        assert s3.proxy.counts["GET"] == 1 and cache.stats()["range_reads"] == 1
        assert not Path(cache.entry_path(url)).exists()  # no whole-file download
        cache.local_path(url)
        s3.proxy.reset()
        assert cache.open_range(url, 99_000, 100_000) == data[99_000:]
        assert s3.proxy.counts["GET"] == 0  # cached: read locally


def test_injected_500s_are_retried(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(50_000)
    url = s3.put("f/x.bin", data)
    s3.proxy.fail_next = 3
    with ShardCache(tmp_path, storage_options=s3.options, retry_timeout=10) as cache:
        assert Path(cache.local_path(url)).read_bytes() == data
        assert cache.stats()["retries"] == 3
    assert s3.proxy.counts["GET"] == 1


def test_500s_past_the_bound_name_the_url(s3: S3, tmp_path: Path) -> None:
    url = s3.put("f/y.bin", b"x" * 1000)
    s3.proxy.fail_next = 10_000
    t0 = time.monotonic()
    with (
        ShardCache(tmp_path, storage_options=s3.options, retry_timeout=0.5) as cache,
        pytest.raises(SourceError, match=rf"cannot (stat|download) {url}.*OSError"),
    ):
        cache.local_path(url)
    assert time.monotonic() - t0 < 3.0
    assert not Path(cache.entry_path(url)).exists() and not _temps(tmp_path)


def test_slow_answers_past_the_client_timeout_are_retried(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(20_000)
    url = s3.put("s/x.bin", data)
    opts = options_for(s3.proxy.endpoint, read_timeout=0.5)
    s3.proxy.slow_next, s3.proxy.delay = 1, 1.5  # the first answer comes after the timeout
    t0 = time.monotonic()
    with ShardCache(tmp_path, storage_options=opts, retry_timeout=10) as cache:
        assert Path(cache.local_path(url)).read_bytes() == data
    assert time.monotonic() - t0 < 8.0
    assert s3.proxy.counts["HEAD"] + s3.proxy.counts["GET"] >= 3  # one slow, then HEAD + GET


def test_slow_answers_within_the_timeout_just_take_longer(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(20_000)
    url = s3.put("s/y.bin", data)
    s3.proxy.slow_next, s3.proxy.delay = 2, 0.3
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        assert Path(cache.local_path(url)).read_bytes() == data
        assert cache.stats()["retries"] == 0


def test_the_endpoint_stopped_mid_download_and_restarted(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(2_000_000)
    url = s3.put("d/big.bin", data)
    s3.proxy.throttle = 0.05  # ~31 chunks of 64 KiB: about 1.5 s per download
    cache = ShardCache(tmp_path, storage_options=s3.options, retry_timeout=15)
    result: dict[str, object] = {}

    def fetch() -> None:
        try:
            result["path"] = cache.local_path(url)
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=fetch)
    t.start()
    _wait_for_partial(tmp_path)
    s3.proxy.stop()  # mid-download: the connection drops, new ones are refused
    time.sleep(0.5)
    s3.proxy.throttle = 0.0
    s3.proxy.start()
    t.join(timeout=30)
    assert "error" not in result, result.get("error")
    assert Path(str(result["path"])).read_bytes() == data
    assert cache.stats()["downloads"] == 1
    assert s3.proxy.counts["GET"] >= 2  # the cut one and the retry
    assert not _temps(tmp_path)
    cache.close()


def test_a_wrong_endpoint_fails_fast_naming_the_url_and_the_endpoint(
    s3: S3, tmp_path: Path
) -> None:
    url = s3.put("d/x.bin", b"x" * 1000)
    s3.proxy.stop()  # nothing listens there any more: every connection is refused
    t0 = time.monotonic()
    with (
        ShardCache(tmp_path, storage_options=s3.options) as cache,  # retry_timeout=60 s
        pytest.raises(
            SourceError,
            match=rf"{url}: the server at {s3.proxy.endpoint} refused every connection.*"
            "check the endpoint",
        ),
    ):
        cache.local_path(url)
    assert time.monotonic() - t0 < 10.0  # not the 60 s of retry_timeout


def test_a_changed_object_is_refused_by_name_on_resume(s3: S3, tmp_path: Path) -> None:
    url = s3.put("v/x.bin", b"first version")
    with ShardCache(tmp_path / "a", storage_options=s3.options) as cache:
        cache.local_path(url)
    recorded = version_of(url, storage_options=s3.options)  # what a checkpoint stores
    s3.put("v/x.bin", b"other version")
    assert version_of(url, storage_options=s3.options) != recorded
    # a node without a copy: the bucket's object is not the recorded one
    with (
        ShardCache(tmp_path / "b", storage_options=s3.options) as fresh,
        pytest.raises(SourceError, match=rf"{url} changed.*{recorded}"),
    ):
        fresh.local_path(url, version=recorded)
    assert not Path(fresh.entry_path(url)).exists()
    # a node with the old copy serves it to a resume that expects it, and refuses a mismatch
    with ShardCache(tmp_path / "a", storage_options=s3.options) as kept:
        assert Path(kept.local_path(url, version=recorded)).read_bytes() == b"first version"
        with pytest.raises(SourceError, match=rf"{url} changed"):
            kept.local_path(url, version="13-somethingelse")


def test_a_leftover_temporary_file_is_removed_and_never_read(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(5000)
    url = s3.put("t/x.bin", data)
    cache = ShardCache(tmp_path, storage_options=s3.options)
    entry = Path(cache.entry_path(url))
    entry.parent.mkdir(parents=True)
    leftover = entry.with_name(f".{entry.name}.deadbeef0000.meshfeed.tmp")
    leftover.write_bytes(data[:1000])  # what a killed writer leaves
    entry.write_bytes(data[:1000])  # even a renamed half file, without its sidecar
    ShardCache(tmp_path, storage_options=s3.options)  # a new cache sweeps it
    assert not leftover.exists() and not entry.exists()
    assert Path(cache.local_path(url)).read_bytes() == data
    cache.close()


def test_the_cache_pickles_as_its_settings(s3: S3, tmp_path: Path) -> None:
    import pickle

    url = s3.put("p/x.bin", b"abc")
    cache = ShardCache(tmp_path, cache_limit=10_000, storage_options=s3.options, retry_timeout=3)
    cache.local_path(url)
    clone = pickle.loads(pickle.dumps(cache))
    assert (clone.cache_dir, clone.cache_limit, clone.retry.timeout) == (tmp_path, 10_000, 3)
    assert clone.stats()["hits"] == 0
    assert Path(clone.local_path(url)).read_bytes() == b"abc"
    assert clone.stats()["hits"] == 1
    cache.close()
    clone.close()


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_limit"):
        ShardCache(tmp_path, cache_limit=0)
    with pytest.raises(ValueError, match="verify"):
        ShardCache(tmp_path, verify="md5")  # type: ignore[arg-type]


def test_a_waiter_gives_up_after_lock_timeout_naming_the_url(s3: S3, tmp_path: Path) -> None:
    from meshfeed.storage._layout import Entry

    url = s3.put("w/x.bin", b"abc")
    writer = Entry.of(tmp_path, url, s3.options).open_lock()  # another process mid-download
    assert writer.try_acquire(exclusive=True)
    t0 = time.monotonic()
    with (
        ShardCache(tmp_path, storage_options=s3.options, lock_timeout=0.3) as cache,
        pytest.raises(SourceError, match=r"timed out waiting.*caching s3://.*/w/x.bin"),
    ):
        cache.local_path(url)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert s3.proxy.counts["GET"] == 0
    writer.close()


@pytest.mark.slow
def test_importing_the_readers_does_not_import_fsspec() -> None:
    import subprocess
    import sys

    code = (
        "import sys, meshfeed.sources.tokens.windows, meshfeed.sources.parquet, meshfeed.storage; "
        "print('fsspec' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow
def test_a_full_cache_disk_raises_by_name_and_is_never_a_bad_sample(s3: S3, tmp_path: Path) -> None:
    import multiprocessing as mp

    from tests.storage._procs import read_stream_on_a_full_disk

    urls = [s3.put(f"full/p{i}.jsonl", b'{"id": 1}\n' * 2000) for i in range(3)]  # 20 kB
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(
        target=read_stream_on_a_full_disk,
        args=(urls, s3.options, str(tmp_path / "cache"), 8_000, out),
    )
    p.start()
    kind, what = out.get(timeout=120)
    p.join(timeout=30)
    assert kind == "raised", what  # not an epoch of substituted rows
    assert what.startswith("CacheDiskError: the shard cache at ") and str(tmp_path) in what
    assert "the disk is full" in what and "cache_dir=" in what


def test_an_unwritable_cache_dir_is_refused_by_name(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CacheDiskError, match=rf"{blocker}/cache cannot be created.*writable"):
        ShardCache(blocker / "cache")
    with pytest.raises(CacheDiskError, match="/sys/meshfeed-cache cannot be created"):
        ShardCache("/sys/meshfeed-cache")  # a read-only file system on Linux


def test_a_lock_that_cannot_open_leaves_nothing_for_exit(tmp_path: Path) -> None:
    import gc

    from meshfeed.storage._lock import FileLock

    with pytest.raises(FileNotFoundError):
        FileLock(str(tmp_path / "missing" / "x.lock"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exception in __del__ is reported as a warning
        gc.collect()


def _hold_for(seconds: float, started: Any) -> None:
    started.set()  # past the fork's handlers: the copies this child keeps are kept for good
    time.sleep(seconds)


def test_a_forked_child_keeps_no_lock_another_thread_held_at_the_fork(tmp_path: Path) -> None:
    """A worker forked while a download thread holds an entry's lock must not keep that lock
    after the parent lets go (``flock`` belongs to the open file description, which a fork
    shares): otherwise every reader of the entry waits ``lock_timeout``."""
    import multiprocessing as mp

    from meshfeed.storage._lock import FileLock

    path = str(tmp_path / "entry.lock")
    held = FileLock(path)
    assert held.try_acquire(exclusive=True)
    ctx = mp.get_context("fork")
    started = ctx.Event()
    child = ctx.Process(target=_hold_for, args=(30.0, started))
    child.start()  # forked while this process holds the lock
    try:
        assert started.wait(timeout=60)
        held.close()  # the parent lets go: the lock must be free for everyone now
        other = FileLock(path)
        try:
            assert other.try_acquire(exclusive=True), "the forked child kept the parent's lock"
        finally:
            other.close()
        assert child.is_alive()
    finally:
        child.kill()
        child.join(timeout=30)
