"""DefaultReader.close(): the files it keeps open for reading by index are closed (idempotent;
reading again re-opens), and ShardedStream.close() closes them through the reader hook."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from meshfeed.protocols import ClosingReader
from meshfeed.sources import DefaultReader, ShardedStream
from tests.sources.open_files import open_files, text_shards

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc/self/fd"
)


def test_close_releases_the_open_files_and_reading_again_reopens(tmp_path: Path) -> None:
    paths = text_shards(tmp_path, 5)
    reader = DefaultReader()
    assert isinstance(reader, ClosingReader)
    for p in paths:
        assert reader.take(p, np.array([3, 1])) == [f"{p.stem[1:]}-3", f"{p.stem[1:]}-1"]
    assert open_files(paths) == len(paths)
    reader.close()
    assert open_files(paths) == 0
    reader.close()  # idempotent
    assert open_files(paths) == 0
    assert reader.take(paths[2], np.array([7])) == ["2-7"]  # re-opened
    assert open_files(paths) == 1
    reader.close()
    assert open_files(paths) == 0


def test_a_stream_close_closes_its_default_readers_files(tmp_path: Path) -> None:
    paths = text_shards(tmp_path, 5)
    stream = ShardedStream([str(p) for p in paths])
    assert stream.__getitems__([0, 15, 33]) == ["0-0", "1-5", "3-3"]
    assert open_files(paths) == 3
    stream.close()
    assert open_files(paths) == 0
    assert stream.__getitems__([42]) == ["4-2"]
    stream.close()
    assert open_files(paths) == 0
