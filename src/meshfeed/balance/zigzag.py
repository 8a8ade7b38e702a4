"""Zigzag split of one document over its context-parallel group, with the padding it needs.

With causal attention the end of a document is more expensive than its start, so a document
on ``c`` ranks is padded to a multiple of ``2*c`` (times ``tp`` under sequence parallelism),
cut into ``2*c`` equal chunks, and rank ``r`` of the group keeps chunks ``r`` and
``2*c - 1 - r``: every rank gets one cheap and one expensive chunk. A document on one rank is
padded to a multiple of ``tp`` only.

>>> padded_length(10, cp=2)
12
>>> zigzag_positions(12, cp=2, cp_rank=0).tolist()
[0, 1, 2, 9, 10, 11]
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["pad_unit", "padded_length", "zigzag_positions"]


def pad_unit(cp: int, tp: int = 1) -> int:
    """The multiple a document on ``cp`` ranks is padded to: ``2*cp*tp``, or ``tp`` if cp == 1."""
    if cp < 1 or tp < 1:
        raise ValueError(f"cp and tp must be >= 1 (got {cp=}, {tp=})")
    return 2 * cp * tp if cp > 1 else tp


def padded_length(length: Any, cp: Any, tp: int = 1) -> Any:
    """``length`` rounded up to :func:`pad_unit` (vectorised over numpy arrays)."""
    s = np.asarray(length, dtype=np.int64)
    c = np.asarray(cp, dtype=np.int64)
    unit = np.where(c > 1, 2 * c * tp, tp)
    out = -(-s // unit) * unit
    return int(out) if out.ndim == 0 else out


def zigzag_positions(padded: int, cp: int, cp_rank: int) -> np.ndarray:
    """Positions (within the padded document) that rank ``cp_rank`` of ``cp`` holds, in order."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank must be in [0, {cp}) (got {cp_rank=})")
    if cp == 1:
        return np.arange(padded, dtype=np.int64)
    if padded % (2 * cp):
        raise ValueError(
            f"a document split over cp={cp} ranks must be padded to a multiple of {2 * cp} "
            f"(got padded={padded}); pad it with padded_length()"
        )
    chunk = padded // (2 * cp)
    first = np.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=np.int64)
    last = 2 * cp - 1 - cp_rank
    second = np.arange(last * chunk, (last + 1) * chunk, dtype=np.int64)
    return np.concatenate([first, second])
