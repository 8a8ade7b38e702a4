"""Distinct values of an int array, without ``np.unique``.

``np.unique``'s first call in a process imports ``numpy.ma`` (20-50 ms), which a loader's
first batch would wait for (a mixture's, a resumed stream's, a worker's). These are the same
answers from a sort and one comparison pass (``tests/order/test_order_distinct.py`` checks them
against ``np.unique``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["distinct", "distinct_inverse"]


def _firsts(ordered: np.ndarray) -> np.ndarray:
    """Where each run of equal values of the sorted ``ordered`` starts (a mask)."""
    first = np.empty(ordered.shape, dtype=bool)
    if ordered.size:
        first[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return first


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of ``values`` (flattened), in increasing order: ``np.unique``."""
    ordered = np.sort(np.asarray(values).ravel())
    return ordered[_firsts(ordered)]


def distinct_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``distinct(values)`` and, for each value (flattened), its index there:
    ``np.unique(values.ravel(), return_inverse=True)``."""
    flat = np.asarray(values).ravel()
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    first = _firsts(ordered)
    inverse = np.empty(flat.shape, dtype=np.intp)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse
