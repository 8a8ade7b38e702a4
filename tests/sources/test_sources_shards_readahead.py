"""Read-ahead of planned shards into the page cache (#29): ReadAhead, populate, uncached_runs,
and ShardFormatReader / ShardedStream with it on and off."""

from __future__ import annotations

import ctypes
import errno
import mmap
import multiprocessing as mp
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed import DataLoader, StreamLoader
from meshfeed.errors import SourceError
from meshfeed.sources import ShardedStream, ShardFormatReader, write_shards
from meshfeed.sources.shards import readahead
from meshfeed.sources.shards.readahead import ReadAhead, populate, uncached_runs
from meshfeed.testing import assert_resume_equivalence

PAGE = mmap.PAGESIZE
needs_populate = pytest.mark.skipif(
    not ReadAhead(len).enabled, reason="needs Linux 5.14+ (madvise MADV_POPULATE_READ)"
)


def missing(path: Path) -> int:
    """Bytes of ``path`` not in the page cache."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        view = np.frombuffer(m, np.uint8)
        runs = uncached_runs(view.ctypes.data, size)
        del view
    finally:
        m.close()
    return sum(b - a for a, b in runs)


def evict(*paths: Path) -> None:
    """Drop the files from the page cache (skip where the filesystem keeps them in memory)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if missing(paths[0]) == 0:
        pytest.skip("this filesystem keeps the files in memory: nothing to read ahead")


def files(tmp_path: Path, n: int, pages: int = 16) -> list[Path]:
    out = []
    for i in range(n):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(np.random.default_rng(i).bytes(pages * PAGE))
        out.append(p)
    return out


def test_uncached_runs_are_the_pages_mincore_reports_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resident = np.ones(64, np.uint8)
    resident[8:12] = resident[40] = resident[63] = 0

    def mincore(address: int, size: int, vec: int) -> int:
        assert size == 64 * PAGE - 100
        ctypes.memmove(vec, resident.ctypes.data, 64)
        return 0

    monkeypatch.setattr(readahead, "_LIBC", (mincore, None))
    runs = uncached_runs(0, 64 * PAGE - 100)
    assert runs == [(8 * PAGE, 12 * PAGE), (40 * PAGE, 41 * PAGE), (63 * PAGE, 64 * PAGE - 100)]
    monkeypatch.setattr(readahead, "_LIBC", (lambda *a: -1, None))  # mincore failed
    assert uncached_runs(0, 3 * PAGE) == [(0, 3 * PAGE)]
    assert uncached_runs(0, 0) == []


@needs_populate
def test_populate_reads_only_what_the_cache_lacks(tmp_path: Path) -> None:
    (p,) = files(tmp_path, 1, pages=32)
    evict(p)
    assert missing(p) == 32 * PAGE
    assert populate(str(p)) == 32 * PAGE
    assert missing(p) == 0
    assert populate(str(p)) == 0  # cached: one mincore, nothing asked
    assert populate(str(tmp_path / "gone.bin")) == 0  # the reader reports a missing file
    (tmp_path / "empty.bin").write_bytes(b"")
    assert populate(str(tmp_path / "empty.bin")) == 0


@needs_populate
def test_opening_a_planned_shard_reads_ahead_ahead_bytes_of_the_plan(tmp_path: Path) -> None:
    fs = files(tmp_path, 6)
    names = [str(f) for f in fs]
    evict(*fs)
    ahead = ReadAhead(lambda s: os.path.getsize(s), ahead_bytes=3 * 16 * PAGE, threads=2)
    try:
        ahead.plan(names[2:] + names[:2])  # the order the stream reads them in
        ahead._reads[names[2]].result(timeout=30)  # the plan starts on its first shards
        ahead.opened(names[3])
        assert missing(fs[3]) == 0  # opened returns once its shard is cached
        for s in names[2:6]:
            ahead._reads[s].result(timeout=30)
        assert [missing(f) == 0 for f in fs] == [False, False, True, True, True, True]
        ahead.opened(str(tmp_path / "elsewhere.bin"))  # not planned: left to the faults
        ahead.opened(names[1])
        assert missing(fs[1]) == 0 and names[0] not in ahead._reads  # past the plan's end
    finally:
        ahead.close()


@needs_populate
def test_a_new_plan_looks_again_at_shards_the_cache_dropped(tmp_path: Path) -> None:
    fs = files(tmp_path, 2)
    names = [str(f) for f in fs]
    ahead = ReadAhead(lambda s: os.path.getsize(s), ahead_bytes=1 << 30)
    try:
        evict(*fs)
        ahead.plan(names)
        for read in list(ahead._reads.values()):  # opened() waits for its own shard only
            read.result(timeout=30)
        assert missing(fs[0]) == missing(fs[1]) == 0
        evict(*fs)
        ahead.plan(names)  # the next epoch's plan
        ahead.opened(names[0])
        ahead.opened(names[1])
        assert missing(fs[0]) == missing(fs[1]) == 0
    finally:
        ahead.close()


def test_read_ahead_options_are_checked_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"read_ahead must be >= 0.*read_ahead=-1"):
        ShardFormatReader(read_ahead=-1)
    with pytest.raises(ValueError, match=r"threads >= 1.*threads=0"):
        ReadAhead(len, threads=0)
    assert not ReadAhead(len, ahead_bytes=0).enabled


def dataset(tmp_path: Path, rows: int = 240) -> Path:
    samples = ({"id": i, "img": np.full(3000 + i, i % 251, np.uint8)} for i in range(rows))
    write_shards(samples, tmp_path / "ds", rows_per_shard=20)
    return tmp_path / "ds"


def ids(stream: ShardedStream, epochs: int = 2) -> list[list[int]]:
    loader = StreamLoader(stream, batch_size=16, seed=3, shuffle=True, collate_fn=list)
    out = []
    for _ in range(epochs):
        got = []
        for batch in loader:
            for s in batch:
                assert int(s["img"][0]) == int(s["id"]) % 251 and len(s["img"]) == 3000 + s["id"]
                got.append(int(s["id"]))
        out.append(got)
    loader.shutdown()
    return out


@pytest.mark.parametrize("read_ahead", [0, 1 << 20])
def test_a_stream_serves_the_same_rows_in_the_same_order_with_read_ahead_on_or_off(
    tmp_path: Path, read_ahead: int
) -> None:
    root = dataset(tmp_path)
    plain = ShardedStream.from_index(root, shuffle_buffer=50)
    reader = ShardFormatReader.from_index(root, read_ahead=read_ahead)
    ahead = ShardedStream(reader.shards, reader=reader, shuffle_buffer=50)
    got = ids(ahead)
    assert got == ids(plain)
    assert all(sorted(e) == list(range(240)) for e in got)


@needs_populate
@pytest.mark.parametrize("door", [StreamLoader, DataLoader])
def test_a_stream_plans_its_reader_so_shards_ahead_of_the_rows_are_cached(
    tmp_path: Path, door: type[StreamLoader] | type[DataLoader]
) -> None:
    """Either door walks the stream's own order (make_order), which plans the reader's reads."""
    root = dataset(tmp_path)
    stream = ShardedStream.from_index(root, shuffle_buffer=50)  # the default reader reads ahead
    shards = [Path(s) for s in stream.shards]
    evict(*shards)
    loader = door(stream, batch_size=16, seed=3, shuffle=True, collate_fn=list)
    it = iter(loader)
    next(it)
    reads = stream.reader._ahead._reads  # type: ignore[union-attr]
    for r in list(reads.values()):
        r.result(timeout=30)
    # the plan's first 64 MiB hold the whole data set (12 shards of ~62 kB): all of it is read
    # ahead, where the first batch's rows alone lie in 2 or 3 shards
    assert set(reads) == set(stream.shards)
    assert [missing(s) for s in shards] == [0] * len(shards)
    loader.shutdown()


@needs_populate
@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_shard_changed_after_its_read_ahead_is_refused_by_name(
    tmp_path: Path, change: str
) -> None:
    root = dataset(tmp_path)
    reader = ShardFormatReader.from_index(root, read_ahead=1 << 30)
    reader.plan(reader.shards)
    reader.take(reader.shards[0], np.array([0, 5]))  # reads every shard ahead
    for r in list(reader._ahead._reads.values()):
        r.result(timeout=30)
    victim = Path(reader.shards[3])
    data = victim.read_bytes()
    written = (root / "index.json").stat().st_mtime_ns
    if change == "truncated":
        victim.write_bytes(data[:-100])
        match = r"shard-00003.mfs has \d+ bytes but its index"
    else:
        victim.write_bytes(data[:-3] + bytes(b ^ 1 for b in data[-3:]))  # same size
        os.utime(victim, ns=(written + 10**9, written + 10**9))
        match = "shard-00003.mfs has content hash"
    with pytest.raises(SourceError, match=match):
        reader.take(reader.shards[3], np.array([0]))
    assert int(reader.take(reader.shards[4], np.array([1]))[0]["id"]) == 81


def test_a_reader_pickles_its_read_ahead_option_and_not_its_threads(tmp_path: Path) -> None:
    reader = ShardFormatReader.from_index(dataset(tmp_path), read_ahead=12345)
    reader.plan(reader.shards)
    reader.take(reader.shards[0], np.array([0]))
    back = pickle.loads(pickle.dumps(reader))
    assert back.read_ahead == 12345 and back._ahead._reads == {}
    assert int(back.take(back.shards[1], np.array([2]))[0]["id"]) == 22


def test_without_populate_nothing_is_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(readahead, "_LIBC", None)  # a system without MADV_POPULATE_READ
    (p,) = files(tmp_path, 1)
    assert populate(str(p)) == 0
    ahead = ReadAhead(lambda s: os.path.getsize(s))
    assert not ahead.enabled
    ahead.plan([str(p)])
    ahead.opened(str(p))
    assert ahead._reads == {}


def _take_in_child(reader: ShardFormatReader, out: mp.Queue) -> None:  # type: ignore[type-arg]
    t = time.perf_counter()
    row = reader.take(reader.shards[2], np.array([1]))[0]
    out.put((int(row["id"]), dict(reader._ahead._at), time.perf_counter() - t))


@needs_populate
def test_a_forked_worker_starts_with_no_plan_and_never_waits_on_its_parents_threads(
    tmp_path: Path,
) -> None:
    reader = ShardFormatReader.from_index(dataset(tmp_path), read_ahead=1 << 30)
    reader.plan(reader.shards)
    reader.take(reader.shards[0], np.array([0]))
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_take_in_child, args=(reader, out))
    with reader._ahead._lock:  # a fork while a read-ahead thread holds the lock
        child.start()
    try:
        got, plan, took = out.get(timeout=20)
    finally:
        child.join(20)
    assert (got, plan) == (41, {}) and took < 10


def _ids_of(batch: list[dict[str, Any]]) -> list[int]:
    return [int(s["id"]) for s in batch]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stream_reading_ahead_resumes_exactly_from_every_recorded_state(
    tmp_path: Path, num_workers: int
) -> None:
    reader = ShardFormatReader.from_index(dataset(tmp_path, rows=120), read_ahead=1 << 20)
    stream = ShardedStream(reader.shards, reader=reader, shuffle_buffer=30)

    def make() -> StreamLoader:
        return StreamLoader(
            stream, batch_size=8, num_workers=num_workers, seed=5, shuffle=True, collate_fn=_ids_of
        )

    assert_resume_equivalence(make, num_items=20, every=4, cleanup=lambda lo: lo.shutdown())


def test_a_kernel_without_populate_read_turns_read_ahead_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def mincore(address: int, size: int, vec: int) -> int:
        return 0  # every page missing (vec stays zero)

    def madvise(address: int, size: int, advice: int) -> int:
        assert advice == readahead._MADV_POPULATE_READ
        ctypes.set_errno(errno.EINVAL)  # as Linux before 5.14 answers
        return -1

    monkeypatch.setattr(readahead, "_LIBC", (mincore, madvise))
    monkeypatch.setattr(readahead, "_UNSUPPORTED", threading.Event())
    (p,) = files(tmp_path, 1)
    ahead = ReadAhead(lambda s: os.path.getsize(s))
    assert ahead.enabled
    assert populate(str(p)) == 0
    assert not ahead.enabled
    ahead.plan([str(p)])
    assert ahead._reads == {}
