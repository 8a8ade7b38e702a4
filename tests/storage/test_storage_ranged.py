"""RangedFile over moto's S3 server: blocks by ranged GETs, an in-memory LRU, identity by version."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from meshfeed.errors import SourceError
from meshfeed.storage import RangedFile, RangeReads, ShardCache, TooLargeForCache
from tests.storage.conftest import S3


def _file(s3: S3, tmp_path: Path, size: int, **reads: int) -> tuple[bytes, RangedFile]:
    data = os.urandom(size)
    url = s3.put("r/obj.bin", data)
    cache = ShardCache(tmp_path / "cache", storage_options=s3.options)
    return data, RangedFile(url, cache=cache, reads=RangeReads(**reads))


def test_reads_within_one_block_cost_one_get(s3: S3, tmp_path: Path) -> None:
    data, f = _file(s3, tmp_path, 10_000, block_size=1000, max_blocks=4)
    assert len(f) == 10_000 and f.version is not None
    s3.proxy.reset()
    for a in range(2000, 2990, 90):  # eleven reads inside block 2
        assert f.read(a, a + 10) == data[a : a + 10]
    assert s3.proxy.counts["GET"] == 1 and f.cache.stats()["range_reads"] == 1
    assert not Path(f.cache.entry_path(f.url)).exists()  # nothing downloaded whole


def test_spans_across_blocks_fetch_each_missing_run_once(s3: S3, tmp_path: Path) -> None:
    data, f = _file(s3, tmp_path, 10_000, block_size=1000, max_blocks=3)
    s3.proxy.reset()
    spans = [(950, 3050), (7100, 7200), (9990, 10_500), (20_000, 20_010), (5, 5)]
    got = f.read_many(spans)
    assert [bytes(g) for g in got] == [data[950:3050], data[7100:7200], data[9990:], b"", b""]
    # blocks 0-3 in one GET, 7 and 9 one each; more blocks than max_blocks: still whole
    assert f.cache.stats()["range_reads"] == 3
    assert f.read(9000, 9100) == data[9000:9100]  # among the last three kept
    assert f.cache.stats()["range_reads"] == 3
    assert f.read(0, 10) == data[:10]  # evicted: fetched again
    assert f.cache.stats()["range_reads"] == 4


def test_probes_and_the_file_object(s3: S3, tmp_path: Path) -> None:
    data, f = _file(s3, tmp_path, 10_000, block_size=4096)
    assert f[9000:] == data[9000:] and f[:16] == data[:16]
    assert f.cache.stats()["range_reads"] == 2  # exactly the probes, no block
    with f.open() as fh:
        fh.seek(-100, os.SEEK_END)
        assert fh.read() == data[-100:]
        fh.seek(10)
        assert fh.read(5000) == data[10:5010]


def test_a_rewritten_object_is_refused_by_name_in_a_new_process(s3: S3, tmp_path: Path) -> None:
    _, f = _file(s3, tmp_path, 5000)
    clone = pickle.loads(pickle.dumps(f))  # what a spawned worker receives
    assert clone.version == f.version and clone.read(0, 10) == f.read(0, 10)
    s3.put("r/obj.bin", os.urandom(5000))
    with pytest.raises(SourceError, match=r"r/obj.bin changed: the bucket holds version"):
        pickle.loads(pickle.dumps(f))
    f._pid = -1  # as in a forked child: the version is asked again on the next read
    with pytest.raises(SourceError, match="changed"):
        f.read(0, 10)


def test_a_truncated_object_is_a_source_error_not_short_data(s3: S3, tmp_path: Path) -> None:
    _, f = _file(s3, tmp_path, 5000, block_size=1000)
    s3.put("r/obj.bin", os.urandom(1500))
    with pytest.raises(
        SourceError, match=r"\[3000, 4000\) of s3:.*obj.bin.*truncated, rewritten or removed"
    ):
        f.read(3000, 3010)


def test_a_cached_copy_serves_ranges_only_for_its_own_version(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(4000)
    url = s3.put("r/v.bin", data)
    cache = ShardCache(tmp_path / "cache", storage_options=s3.options)
    cache.local_path(url)
    old = RangedFile(url, cache=cache)
    assert old.read(0, 100) == data[:100] and cache.stats()["range_reads"] == 0  # the copy
    new = os.urandom(4000)
    s3.put("r/v.bin", new)
    assert cache.open_range(url, 0, 10) == data[:10]  # no version asked: the copy
    assert RangedFile(url, cache=cache).read(0, 100) == new[:100]  # not the stale copy
    assert cache.stats()["range_reads"] == 1


def test_a_file_larger_than_the_cache_limit_is_refused_not_downloaded(
    s3: S3, tmp_path: Path
) -> None:
    url = s3.put("big/x.bin", os.urandom(50_000))
    with ShardCache(tmp_path, cache_limit=20_000, storage_options=s3.options) as cache:
        with pytest.raises(TooLargeForCache, match=r"50000 bytes, more than cache_limit=20000"):
            cache.local_path(url)
        assert [f.result(timeout=30) for f in cache.prefetch([url])] == [False]
        assert cache.stats()["skipped_prefetch"] == 1
    assert not s3.proxy.object_gets and not list(tmp_path.glob("*/*x.bin")) + list(
        tmp_path.glob("*/*.meshfeed.tmp")
    )


def test_range_reads_are_validated() -> None:
    with pytest.raises(ValueError, match="block_size"):
        RangeReads(block_size=0)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_threads_of_a_forked_child_close_each_inherited_lock_once(s3: S3, tmp_path: Path) -> None:
    import threading

    data, f = _file(s3, tmp_path, 8000, block_size=1000)
    held = f.cache.local_path(s3.put("r/held.bin", b"x" * 100))  # the parent holds an entry
    assert Path(held).read_bytes() == b"x" * 100
    fds = {lock._fd for lock in f.cache._held.values()}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: eight threads reach the cache's fork check at once

        def is_open(fd: int) -> bool:
            try:
                os.fstat(fd)
            except OSError:
                return False
            return True

        # the fork's handler closed the child's copies of the parent's locks, each once: the
        # threads' fork check below has nothing left to close twice
        closed_at_fork = not any(is_open(fd) for fd in fds)
        barrier = threading.Barrier(8)
        results: list[bytes] = []

        def read_one(k: int) -> None:
            barrier.wait()
            results.append(f.cache.open_range(f.url, k * 1000, k * 1000 + 10))

        threads = [threading.Thread(target=read_one, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        expect = sorted(data[k * 1000 : k * 1000 + 10] for k in range(8))
        ok = closed_at_fork and not f.cache._held and sorted(results) == expect
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(read)
    assert f.read(4000, 4010) == data[4000:4010]  # the parent's state is untouched
