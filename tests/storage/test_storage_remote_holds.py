"""What a limited stream reader holds in the shard cache between reads, in every process, and
when the stream tells the cache a shard is read to its end (#29), against a real S3 API (moto)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed import StreamLoader
from meshfeed.errors import SourceError
from meshfeed.sources import ShardedStream
from meshfeed.storage import ShardCache
from meshfeed.storage._layout import Entry
from tests.storage.conftest import S3, options_for


def _ids(rows: list[dict[str, int]]) -> list[int]:
    return [r["id"] for r in rows]


def _shard_dataset(s3: S3, tmp: Path, rows: int, *, per_shard: int = 100) -> list[int]:
    """Rows ``0..rows`` as a shard dataset in the bucket (index.json last); the shard sizes."""
    from meshfeed.sources import write_shards

    index = write_shards(
        [{"id": i, "x": np.full(50, i, np.int32)} for i in range(rows)],
        tmp / "w",
        rows_per_shard=per_shard,
    )
    sizes = []
    for f in sorted(index.parent.iterdir()):
        if f.name != "index.json":
            s3.put(f"ds/{f.name}", f.read_bytes())
            sizes.append(f.stat().st_size)
    s3.put("ds/index.json", index.read_bytes())
    return sizes


def _free_within(entry: Entry, seconds: float) -> float | None:
    """Seconds until no process of the node holds ``entry`` (None: still held after
    ``seconds``)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        lock = entry.open_lock()
        try:
            if lock.try_acquire(exclusive=True):
                return time.monotonic() - start
        finally:
            lock.close()
        time.sleep(0.01)
    return None


def test_a_worker_copy_keeps_its_shard_between_reads_and_lets_it_go_once_idle(
    s3: S3, tmp_path: Path
) -> None:
    """Holding nothing between reads re-held and re-opened every shard on every read (two
    thirds of a worker's read time); an idle worker must still let go, or a process waiting
    for room would wait for it."""
    import pickle

    _shard_dataset(s3, tmp_path, 200)
    stream = ShardedStream.from_index(
        s3.url("ds"), cache_dir=tmp_path / "cache", cache_limit=1 << 20, storage_options=s3.options
    )
    url = stream.shards[0]
    worker = pickle.loads(pickle.dumps(stream.reader))  # as a worker process gets it
    for half in (np.arange(50), np.arange(50, 100)):
        assert [r["id"] for r in worker.take(url, half)] == half.tolist()
    stats = worker.cache.stats()
    assert stats["hits"] + stats["downloads"] == 1  # held from one read to the next
    assert worker._holds.urls() == [url]
    entry = Entry.of(worker.cache.cache_dir, url, worker.cache.storage_options)
    waited = _free_within(entry, 10.0)
    assert waited is not None  # let go once idle, by the process's own watcher
    assert len(worker._holds) == 0


def _read_in_a_forked_worker(stream: Any, url: str, out: Any) -> None:
    """In a forked child: read all rows of ``url`` through the inherited reader, in two reads
    as a worker does; report the ids, what it held then, and how soon the entry was free."""
    reader = stream.reader
    ids = [r["id"] for half in (np.arange(50), np.arange(50, 100)) for r in reader.take(url, half)]
    held = reader._holds.urls()
    entry = Entry.of(reader.cache.cache_dir, url, reader.cache.storage_options)
    out.put((ids, held, _free_within(entry, 10.0), len(reader._holds)))


def test_a_forked_worker_copy_holds_its_own_shards_never_the_parents(
    s3: S3, tmp_path: Path
) -> None:
    """A worker forked from the process that built the reader (the default start method)
    inherits its reader without unpickling it: it must forget the parent's holds (kept, they
    filled a limited cache with shards no process read, and workers waiting for room waited
    for each other: a 2-rank x 2-worker epoch hung), hold its own, and let them go once idle."""
    import multiprocessing as mp

    _shard_dataset(s3, tmp_path, 200)
    stream = ShardedStream.from_index(
        s3.url("ds"), cache_dir=tmp_path / "cache", cache_limit=1 << 20, storage_options=s3.options
    )
    first, second = stream.shards[:2]
    stream.reader.take(first, np.arange(10))  # the parent reads, and keeps, the first shard
    assert stream.reader._holds.urls() == [first]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_a_forked_worker, args=(stream, second, out))
    child.start()
    ids, held, waited, left = out.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert ids == list(range(100, 200))
    assert held == [second]  # its own shard only, kept between its two reads
    assert waited is not None and left == 0  # let go once idle
    stream.reader.close()


def test_a_two_worker_epoch_tells_the_cache_each_shard_is_finished_once_per_pass(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker processes read only some rows of each shard; the process that walks the order
    tells the cache, as batches are returned, that a shard's rows are all read (before, with
    workers, a shard was evictable only once idle for seconds: download-ahead stalled, and a
    shard read partly, then left for a moment, could be evicted and downloaded again)."""
    _shard_dataset(s3, tmp_path, 600)  # 6 shards of 100 rows
    finished: list[str] = []
    real = ShardCache.finished
    monkeypatch.setattr(
        ShardCache, "finished", lambda self, url: (finished.append(url), real(self, url))[1]
    )
    stream = ShardedStream.from_index(
        s3.url("ds"),
        cache_dir=tmp_path / "cache",
        cache_limit=1 << 20,
        storage_options=s3.options,
        shuffle_buffer=50,
        samples_per_epoch=900,  # an epoch and a half: the second pass is cut mid-way
    )
    read: list[int] = []
    with StreamLoader(
        stream, seed=3, collate_fn=_ids, batch_size=4, drop_last=False, num_workers=2
    ) as lo:
        for epoch in range(2):
            lo.set_epoch(epoch)
            for batch in lo:
                read.extend(batch)
    assert sorted(read) == sorted([*range(600)] * 3)
    shard_of = {url: i for i, url in enumerate(stream.shards)}
    expect = []  # each shard once per pass, in the order the passes read their last rows
    for p in range(3):
        last = {i // 100: k for k, i in enumerate(read[600 * p : 600 * (p + 1)])}
        expect += sorted(last, key=last.__getitem__)
    assert [shard_of[u] for u in finished] == expect


def _epoch_gets(s3: S3, cache: Path, limit: int, window: int) -> dict[str, int]:
    """Whole-object GETs per shard (downloads) of one 2-worker epoch through a limited cache
    (the index's excluded), read in a fresh process: threads and clients left by earlier tests
    of this process re-sent GETs under load. A ranged GET (s3fs resuming a stalled body) is not
    a second download; the client waits 30 s for a body, not 2."""
    import multiprocessing as mp

    from tests.storage._procs import read_limited_epoch

    s3.proxy.reset()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    options = options_for(s3.proxy.endpoint, read_timeout=30.0)
    args = (s3.url("ds"), options, str(cache), limit, window, out)
    proc = ctx.Process(target=read_limited_epoch, args=args)
    proc.start()
    ids = out.get(timeout=300)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and ids == list(range(2400))
    return {k: n for k, n in s3.proxy.whole_gets.items() if not k.endswith("index.json")}


def test_a_limited_two_worker_epoch_downloads_each_shard_once_cold_and_warm(
    s3: S3, tmp_path: Path
) -> None:
    """The benchmark's limited rows in small: a limit of 40 % of the data, a window of a
    quarter of the rows it holds. A shard is downloaded once per epoch, never twice (a warm
    2-worker epoch made 23 GETs for 22 shards when unread shards went idle after 2 s)."""
    sizes = _shard_dataset(s3, tmp_path, 2400)  # 24 shards
    limit = int(0.4 * sum(sizes))
    window = int(2400 * 0.4 * 0.25)
    cache = tmp_path / "cache"
    for temp in ("cold", "warm"):
        gets = _epoch_gets(s3, cache, limit, window)
        assert len(gets) <= len(sizes) and max(gets.values()) == 1, (temp, gets)


def test_a_shard_a_worker_read_in_part_and_left_idle_is_not_downloaded_again(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads half a shard it fetched itself (its download-ahead not run yet), lets it
    go once idle, and is slow to come back (a loaded machine: longer than IN_USE); a
    download-ahead meanwhile must not evict it, or the worker downloads it again for its other
    rows (a warm 2-worker limited epoch made 25 GETs for 24 shards in CI)."""
    import pickle

    from meshfeed.storage import _layout

    monkeypatch.setattr(_layout, "IN_USE", 0.05)  # the worker's pause, made short
    sizes = _shard_dataset(s3, tmp_path, 200)
    stream = ShardedStream.from_index(
        s3.url("ds"),
        cache_dir=tmp_path / "cache",
        cache_limit=max(sizes),
        storage_options=s3.options,
    )
    first, second = stream.shards
    worker = pickle.loads(pickle.dumps(stream.reader))  # as a worker process gets it
    s3.proxy.reset()
    assert _ids(worker.take(first, np.arange(50))) == list(range(50))
    entry = Entry.of(worker.cache.cache_dir, first, worker.cache.storage_options)
    assert _free_within(entry, 10.0) is not None  # let go once idle
    time.sleep(0.2)
    main = stream.reader.cache
    before = main.stats()  # the index's download
    stream.reader.plan([second])  # the main process plans the next steps: no room yet
    deadline = time.monotonic() + 30
    while main.stats()["skipped_prefetch"] + main.stats()["downloads"] == before["downloads"]:
        assert time.monotonic() < deadline, main.stats()
        time.sleep(0.01)
    stats = main.stats()
    assert (stats["skipped_prefetch"], stats["evictions"]) == (1, 0), stats
    assert _ids(worker.take(first, np.arange(50, 100))) == list(range(50, 100))
    stream.reader.finished([first])  # its rows all returned: the waiting one goes
    assert _ids(worker.take(second, np.arange(100))) == list(range(100, 200))
    gets = {k: n for k, n in s3.proxy.whole_gets.items() if not k.endswith("index.json")}
    assert sorted(gets.values()) == [1, 1], gets
    worker.close()
    stream.reader.close()


# ------------------------------------------------------------ readers of one process, unlimited
def _json_rows(first: int, n: int = 10) -> bytes:
    return "".join(json.dumps({"id": first + r}) + "\n" for r in range(n)).encode()


def _rewritten_while_held(s3: S3, tmp_path: Path, use: str) -> tuple[list[str], StreamLoader]:
    """Two JSON-lines shards, a first loader over them (no cache limit) that ``use`` says how
    far it went, then both objects rewritten in the bucket."""
    urls = [s3.put(f"j/part-{s}.jsonl", _json_rows(100 * s)) for s in range(2)]

    def loader() -> StreamLoader:
        stream = ShardedStream(urls, cache_dir=tmp_path / "cache", storage_options=s3.options)
        return StreamLoader(stream, batch_size=5, shuffle=False, collate_fn=_ids, timeout=20)

    first = loader()
    if use == "stopped early":
        for _ in first:
            break
    time.sleep(0.01)  # a newer write time
    for s, url in enumerate(urls):
        s3.put(url.split("/", 3)[3], _json_rows(1000 + 100 * s))
    return urls, loader()


@pytest.mark.parametrize("use", ["built, never read", "stopped early"])
def test_a_reader_left_open_keeps_no_later_reader_of_the_process_waiting(
    s3: S3, tmp_path: Path, use: str
) -> None:
    """A stream held every shard it counted or read until its order finished it, so a second
    loader in the same process, needing the rewritten objects, waited for the first one's
    shared locks for its whole timeout, then blamed its reader."""
    _, second = _rewritten_while_held(s3, tmp_path, use)
    start = time.monotonic()
    rows = [i for batch in second for i in batch]
    assert rows == [1000 + r for r in range(10)] + [1100 + r for r in range(10)]
    assert time.monotonic() - start < 10


def test_counting_holds_nothing_and_a_closed_or_collected_stream_holds_nothing(
    s3: S3, tmp_path: Path
) -> None:
    url = s3.put("j/part-0.jsonl", _json_rows(0))
    cache = tmp_path / "cache"
    entry = Entry.of(cache, url, s3.options)
    stream = ShardedStream([url], cache_dir=cache, storage_options=s3.options)
    assert len(stream) == 10  # counted: its shard read once, then let go
    assert _free_within(entry, 0.5) is not None
    assert stream[3] == {"id": 3}
    assert _free_within(entry, 0.5) is None  # held between reads (no cache limit)
    stream.close()
    stream.close()  # idempotent
    assert _free_within(entry, 0.5) is not None
    assert stream[4] == {"id": 4}  # read again: held anew
    assert _free_within(entry, 0.5) is None
    del stream
    gc.collect()
    assert _free_within(entry, 0.5) is not None


def test_a_wait_for_an_entry_this_process_holds_names_the_cause(s3: S3, tmp_path: Path) -> None:
    url = s3.put("j/part-0.jsonl", _json_rows(0))
    first = ShardCache(tmp_path / "cache", storage_options=s3.options)
    first.local_path(url)  # held, and its holder cannot be asked to let go
    time.sleep(0.01)
    s3.put("j/part-0.jsonl", _json_rows(100))
    second = ShardCache(tmp_path / "cache", storage_options=s3.options, lock_timeout=0.5)
    with pytest.raises(SourceError, match=r"another reader of this same process holds .* close"):
        second.local_path(url)
    first.close()
    with open(second.local_path(url)) as f:
        assert json.loads(f.readline()) == {"id": 100}
    second.close()
