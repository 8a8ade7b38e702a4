"""DefaultReader.close(): the files it keeps open for reading by index are closed (idempotent;
reading again re-opens), and ShardedStream.close() closes them through the reader hook."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

from meshfeed.protocols import ClosingReader
from meshfeed.sources import DefaultReader, ShardedStream

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc/self/fd"
)


def _open_files(paths: list[Path]) -> int:
    """How many descriptors of this process are open on ``paths``."""
    wanted = {os.path.realpath(p) for p in paths}
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used, closed since
            n += os.readlink(f"/proc/self/fd/{fd}") in wanted
    return n


def _shards(tmp_path: Path, n: int = 5, rows: int = 10) -> list[Path]:
    paths = []
    for i in range(n):
        p = tmp_path / f"s{i}.txt"
        p.write_text("".join(f"{i}-{j}\n" for j in range(rows)))
        paths.append(p)
    return paths


def test_close_releases_the_open_files_and_reading_again_reopens(tmp_path: Path) -> None:
    paths = _shards(tmp_path)
    reader = DefaultReader()
    assert isinstance(reader, ClosingReader)
    for p in paths:
        assert reader.take(p, np.array([3, 1])) == [f"{p.stem[1:]}-3", f"{p.stem[1:]}-1"]
    assert _open_files(paths) == len(paths)
    reader.close()
    assert _open_files(paths) == 0
    reader.close()  # idempotent
    assert _open_files(paths) == 0
    assert reader.take(paths[2], np.array([7])) == ["2-7"]  # re-opened
    assert _open_files(paths) == 1
    reader.close()
    assert _open_files(paths) == 0


def test_a_stream_close_closes_its_default_readers_files(tmp_path: Path) -> None:
    paths = _shards(tmp_path)
    stream = ShardedStream([str(p) for p in paths])
    assert stream.__getitems__([0, 15, 33]) == ["0-0", "1-5", "3-3"]
    assert _open_files(paths) == 3
    stream.close()
    assert _open_files(paths) == 0
    assert stream.__getitems__([42]) == ["4-2"]
    stream.close()
    assert _open_files(paths) == 0
