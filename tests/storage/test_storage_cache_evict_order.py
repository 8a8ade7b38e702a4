"""A limited cache shared by readers of several processes evicts what was read before what will be
read (#29): a demanded download waits a moment for shards read to their end that another reader
still holds rather than evict the last shard downloaded ahead (the one a lagging worker reads
next: it downloaded it twice in one epoch); the main process's download-ahead hears of such a
shard let go; and a booking whose download ends while the cache is listed is no error."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshfeed.storage import ShardCache, _ahead, _fill, _layout
from meshfeed.storage._layout import BOOKING, Entry, book

SIZE = 1000


@pytest.fixture
def put() -> Iterator[Callable[[str], str]]:
    """Puts SIZE random bytes in fsspec's in-memory file system: ``put(name)`` -> its URL."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"mf-{uuid.uuid4().hex[:12]}"

    def put(name: str) -> str:
        fs.pipe(f"/{root}/d/{name}", os.urandom(SIZE))
        return f"memory://{root}/d/{name}"

    yield put
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


def _left(cache_dir: Path) -> set[str]:
    return {p.name.removesuffix(".meshfeed.json") for p in cache_dir.glob("*/*.meshfeed.json")}


def _caches(tmp_path: Path, limit: int) -> tuple[ShardCache, ShardCache]:
    """Two readers of one cache (two worker processes of a node: ``flock`` excludes two
    caches of one process as it does two processes)."""
    return ShardCache(tmp_path, cache_limit=limit), ShardCache(tmp_path, cache_limit=limit)


def _read_held_and_two_ahead(
    put: Callable[[str], str], worker: ShardCache, cache: ShardCache
) -> tuple[str, str]:
    """A full cache: a shard ``worker`` read to its end and still holds, and two downloaded
    ahead by ``cache`` and not read yet; returns the URLs of the read one and of a new one."""
    read, soon, later, new = (put(n) for n in ("read", "soon", "later", "new"))
    worker.local_path(read, until_finished=True)
    worker.finished(read)  # its rows are all returned; its reader lets go of it a moment later
    for url in (soon, later):  # one after the other: `later` is the last downloaded ahead
        assert [f.result(timeout=30) for f in cache.prefetch([url])] == [True]
    return read, new


def test_a_demanded_download_waits_for_a_read_shard_another_reader_holds_not_evicting_ahead(
    tmp_path: Path, put: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_fill, "READ_GRACE", 60.0)  # the release below comes within it
    worker, cache = _caches(tmp_path, 3 * SIZE)
    with worker, cache:
        read, new = _read_held_and_two_ahead(put, worker, cache)
        stop = threading.Event()

        def let_go() -> None:  # the worker's holds let go of it once the download waits
            deadline = time.monotonic() + 30
            while cache.stats()["waits"] < 1 and time.monotonic() < deadline:
                if stop.wait(0.001):
                    return
            worker.release(read)

        thread = threading.Thread(target=let_go)
        thread.start()
        made_room: list[int] = []
        try:
            cache.local_path(new, make_room=lambda: made_room.append(1))
        finally:
            stop.set()
            thread.join()
        # the read one went, not `later` (the last downloaded ahead: the next one read)
        assert _left(tmp_path) == {"soon", "later", "new"}
        assert made_room == [1]  # its caller let go of what it holds first
        assert cache.stats()["evictions"] == 1


def test_a_demanded_download_evicts_a_shard_downloaded_ahead_once_the_grace_ends(
    tmp_path: Path, put: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_fill, "READ_GRACE", 0.2)
    worker, cache = _caches(tmp_path, 3 * SIZE)
    with worker, cache:
        _, new = _read_held_and_two_ahead(put, worker, cache)
        start = time.monotonic()
        cache.local_path(new)  # the worker never lets go: the order of old
        assert time.monotonic() - start >= 0.2
        assert _left(tmp_path) == {"read", "soon", "new"}


def test_a_demanded_download_does_not_wait_for_a_plain_readers_idle_file(
    tmp_path: Path, put: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file a plain reader holds, unread for IN_USE seconds, is idle but not read to its end:
    it may stay held for the whole job, so nobody waits for it."""
    monkeypatch.setattr(_layout, "IN_USE", 0.05)
    monkeypatch.setattr(_fill, "READ_GRACE", 60.0)
    plain, soon, later, new = (put(n) for n in ("plain", "soon", "later", "new"))
    worker, cache = _caches(tmp_path, 3 * SIZE)
    with worker, cache:
        worker.local_path(plain)
        time.sleep(0.1)
        for url in (soon, later):
            assert [f.result(timeout=30) for f in cache.prefetch([url])] == [True]
        cache.local_path(new)
        assert cache.stats()["waits"] == 0
        assert _left(tmp_path) == {"plain", "soon", "new"}


def test_a_download_ahead_that_found_a_read_shard_held_elsewhere_runs_once_it_is_let_go(
    tmp_path: Path, put: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main process hears that a shard was read (the stream's order) while a worker still
    holds it; the worker's release kicks no queue of the main process."""
    monkeypatch.setattr(_ahead, "READ_GRACE", 60.0)  # the release below comes within it
    read, ahead = put("read"), put("ahead")
    worker, main = _caches(tmp_path, SIZE)
    with worker, main:
        worker.local_path(read, until_finished=True)
        assert [f.result(timeout=30) for f in main.prefetch([ahead])] == [False]  # no room
        full = main._last_full
        main.finished(read)
        deadline = time.monotonic() + 30
        while main._last_full == full:  # the queue was tried: the read shard is held
            assert time.monotonic() < deadline, "the queue was not tried after finished()"
            time.sleep(0.005)
        worker.release(read)
        deadline = time.monotonic() + 10
        while not Path(main.entry_path(ahead) + ".meshfeed.json").exists():
            assert time.monotonic() < deadline, "the download-ahead still waits"
            time.sleep(0.01)
        assert _left(tmp_path) == {"ahead"}


@pytest.fixture
def vanishing_booking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A booking of a download in flight (its entry locked: a new cache's sweep keeps it)
    that ends (its booking removed, without the cache-wide lock) between the cache's listing
    and the read of its size."""
    other = Entry.of(tmp_path, "memory://elsewhere/d/other", {})
    lock = other.open_lock()
    assert lock.try_acquire(exclusive=True)
    booking = other.temp(BOOKING)
    with open(booking, "wb") as f:
        f.truncate(SIZE)
    stat = Path.stat

    def stat_after_its_end(self: Path, **kwargs: bool) -> os.stat_result:
        if self == booking:
            self.unlink(missing_ok=True)
        return stat(self, **kwargs)

    monkeypatch.setattr(Path, "stat", stat_after_its_end)
    yield booking
    lock.close()


def test_a_booking_removed_while_the_cache_is_listed_is_skipped(
    tmp_path: Path, vanishing_booking: Path
) -> None:
    new = Entry.of(tmp_path, "memory://elsewhere/d/new", {})
    booked, evicted = book(tmp_path, new, SIZE, limit=SIZE, deadline=time.monotonic() + 5)
    assert booked is not None and evicted == 0
    assert not os.path.exists(vanishing_booking)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_download_racing_a_finished_one_is_neither_missing_nor_dropped(
    tmp_path: Path, put: Callable[[str], str], vanishing_booking: Path, ahead: bool
) -> None:
    """Demanded, it was a SourceError "missing from the bucket"; ahead, its future failed and
    it left the queue for good."""
    url = put("new")
    with ShardCache(tmp_path, cache_limit=2 * SIZE) as cache:
        assert os.path.exists(vanishing_booking)  # not swept: its download is in flight
        if ahead:
            assert [f.result(timeout=30) for f in cache.prefetch([url])] == [True]
        else:
            cache.local_path(url)
        assert cache.stats()["downloads"] == 1
        assert _left(tmp_path) == {"new"}
