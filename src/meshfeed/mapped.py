"""Arrays read through a memory map of a file: a size check before reading them.

Reading a mapped page past the end of a file that was truncated in place kills the process
with SIGBUS: no exception, no message (with worker processes: "exit code -7"). A reader that
keeps an array from ``np.load(path, mmap_mode="r")`` (or any view of one) calls
:func:`check_mapped` before it reads, and a shortened file becomes a
:class:`~meshfeed.errors.SourceError` naming it. Cost: one ``fstat`` on the mapping's own
descriptor (about 1 µs) plus a walk up the array's ``base`` chain; an in-memory array costs
the walk only. A file replaced by rename is not a change (the old one stays mapped and whole).
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from meshfeed.errors import SourceError

__all__ = ["check_mapped"]


def _mapping(array: Any) -> tuple[mmap.mmap, int, str] | None:
    """The mmap under ``array``, the file offset where it starts and the file's name."""
    start, name = 0, "a mapped file"
    a = array
    while isinstance(a, np.ndarray):
        if isinstance(a, np.memmap):
            offset = int(a.offset)
            start = offset - offset % mmap.ALLOCATIONGRANULARITY  # how np.memmap maps it
            name = str(a.filename)
        a = a.base
    if isinstance(a, mmap.mmap):
        return a, start, name
    return None


def check_mapped(array: Any, *, what: str = "") -> None:
    """Raise :class:`SourceError` if the file mapped under ``array`` is now shorter than the
    mapping (truncated in place since it was opened); nothing for an in-memory array.

    ``what`` names the array's role in the message (e.g. "the metric index's order.npy")."""
    found = _mapping(array)
    if found is None:
        return
    mapping, start, name = found
    size = mapping.size()
    if size < start + len(mapping):
        raise SourceError(
            f"{name}{f' ({what})' if what else ''} changed size while open ({start + len(mapping)} "
            f"bytes mapped, {size} now): it was truncated or rewritten in place under a running "
            "reader; write it under a new name or by rename, then reopen"
        )
