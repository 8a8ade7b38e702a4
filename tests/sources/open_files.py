"""Helpers of the tests that check a reader's open files: small text shards, and how many
descriptors of this process are open on them (``/proc/self/fd``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def open_files(paths: list[Path]) -> int:
    """How many descriptors of this process are open on ``paths``."""
    wanted = {os.path.realpath(p) for p in paths}
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used, closed since
            n += os.readlink(f"/proc/self/fd/{fd}") in wanted
    return n


def text_shards(tmp_path: Path, n: int, rows: int = 10) -> list[Path]:
    """``n`` text shards of ``rows`` lines: line j of shard i is ``"i-j"``."""
    paths = []
    for i in range(n):
        p = tmp_path / f"s{i}.txt"
        p.write_text("".join(f"{i}-{j}\n" for j in range(rows)))
        paths.append(p)
    return paths
