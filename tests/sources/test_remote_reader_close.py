"""CachedReader.close() closes the reader it wraps too (the files a DefaultReader keeps open),
after letting go of its holds; ShardedStream.close() reaches it through the reader hook."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed.sources import DefaultReader, ShardedStream
from meshfeed.sources.streams.remote import CachedReader
from meshfeed.storage import ShardCache
from tests.sources.open_files import open_files, text_shards


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files")
def test_close_closes_the_wrapped_readers_files_and_reading_again_reopens(tmp_path: Path) -> None:
    paths = text_shards(tmp_path, 3)
    shards = [str(p) for p in paths]
    reader = CachedReader(DefaultReader(), ShardCache(tmp_path / "cache"), shards=shards)
    for i, s in enumerate(shards):
        assert reader.take(s, np.array([3, 1])) == [f"{i}-3", f"{i}-1"]
    assert open_files(paths) == len(paths)
    reader.close()
    assert open_files(paths) == 0
    reader.close()  # idempotent
    assert reader.take(shards[1], np.array([7])) == ["1-7"]  # re-opened
    assert open_files(paths) == 1
    reader.close()
    assert open_files(paths) == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files")
def test_a_stream_close_reaches_the_reader_inside_the_cached_reader(tmp_path: Path) -> None:
    paths = text_shards(tmp_path, 3)
    shards = [str(p) for p in paths]
    cached = CachedReader(DefaultReader(), ShardCache(tmp_path / "cache"), shards=shards)
    stream = ShardedStream(shards, cached)
    assert stream.reader is cached  # it reads URLs itself: not wrapped again
    assert stream.__getitems__([0, 15, 22]) == ["0-0", "1-5", "2-2"]
    assert open_files(paths) == 3
    stream.close()
    assert open_files(paths) == 0


class Recording:
    """A reader with ``take``, ``forget`` and ``close`` that logs the hooks called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, shard: Any, start: int, stop: int | None) -> Any:
        return iter(range(start, 10 if stop is None else stop))

    def take(self, shard: Any, rows: np.ndarray) -> list[Any]:
        return rows.tolist()

    def forget(self, shard: Any) -> None:
        self.calls.append("forget")

    def close(self) -> None:
        self.calls.append("close")


def test_close_closes_the_wrapped_reader_once_per_call_and_a_reader_without_close_is_fine(
    tmp_path: Path,
) -> None:
    inner = Recording()
    reader = CachedReader(inner, ShardCache(tmp_path / "cache"), shards=["s0"])
    assert reader.take("s0", np.array([2, 1])) == [2, 1]
    reader.close()
    reader.close()
    assert inner.calls == ["close", "close"]

    def plain(shard: Any, start: int, stop: int | None) -> Any:
        return iter(range(start, 10 if stop is None else stop))

    bare = CachedReader(plain, ShardCache(tmp_path / "cache2"), shards=["s0"])
    assert bare.take("s0", np.array([4])) == [4]
    bare.close()  # nothing to close inside
