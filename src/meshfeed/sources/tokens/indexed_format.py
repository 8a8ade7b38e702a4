"""The Megatron indexed format's constants and file helpers, shared by the reader and the writer.

See :mod:`meshfeed.sources.tokens.indexed` for the format itself.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from meshfeed.errors import SourceError

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "IndexedFormatError",
    "dtype_code",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
HEADER_SIZE = _HEADER.size  # 34 bytes

DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
_INT32_MAX = np.iinfo(np.int32).max


class IndexedFormatError(SourceError, ValueError):
    """A ``.idx`` / ``.bin`` pair that is not a valid indexed corpus; the message names the file.

    A :class:`~meshfeed.errors.SourceError`: a damaged corpus is never treated as a bad sample.
    """


@contextlib.contextmanager
def _publish_lock(folder: Path, *, exclusive: bool) -> Iterator[None]:
    """Serialise meshfeed's two-file publish against meshfeed readers of the same folder.

    A writer renames ``.bin`` then ``.idx`` under an exclusive ``flock`` of the folder; a reader
    maps both under a shared one, so it never pairs one writer's ``.bin`` with another's
    ``.idx``. Where ``flock`` is unavailable (no ``fcntl``, some network file systems) this
    does nothing and the size checks on open are the remaining guard.
    """
    try:
        # the cache's lock: a worker forked while a thread holds it does not keep it
        from meshfeed.storage._lock import FileLock

        lock = FileLock(str(folder), directory=True)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            deadline = time.monotonic() + 600.0
            lock.acquire(exclusive=exclusive, deadline=deadline, what="a corpus publish")
        yield
    finally:
        lock.close()  # closing the descriptor releases the lock


def _paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    # accept either file name as well as the bare prefix
    p = os.fspath(prefix).removesuffix(".bin").removesuffix(".idx")
    return Path(p + ".idx"), Path(p + ".bin")


def dtype_code(dtype: DTypeLike) -> int:
    """The Megatron dtype code of ``dtype``; raises ``ValueError`` for unsupported dtypes."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        names = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise ValueError(f"dtype {dt} has no Megatron code (got {dtype=}); use one of {names}")
    return _CODE_OF[dt]
