"""A remote token corpus whose ``.bin`` is read by ranges instead of downloaded whole.

The ``.idx`` (8 to 20 bytes per document) is always cached whole. The ``.bin`` is downloaded
whole into the node's shard cache (one GET per file per node, then local memory-mapped reads)
unless ``ranged`` asks for ranges, or, with ``ranged=None`` (the default), the ``.bin`` is
larger than ``cache_limit`` (it could never be cached: :class:`TooLargeForCache`). By ranges,
tokens come from a :class:`~meshfeed.storage.RangedFile`: blocks of ``block_size`` bytes by
ranged GETs, the last ``max_blocks`` kept in memory per process. A batch of shuffled windows
then costs about one block GET per window that misses (every epoch), where the whole file was
one GET per node: use ranges for what cannot be cached, and a small ``block_size`` for shuffled
reads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshfeed.storage import Ranged, RangedFile, ShardCache, local_or_ranged

__all__ = ["RangedTokens", "open_remote"]


def open_remote(
    url: str, cache: ShardCache, ranged: Ranged, version: str | None
) -> tuple[str, RangedFile | None]:
    """The local prefix of the cached ``.idx`` (with the ``.bin`` beside it when cached whole),
    and the ``.bin`` as a :class:`RangedFile` when it is read by ranges."""
    url = url.removesuffix(".bin").removesuffix(".idx")
    prefix = cache.local_path(url + ".idx")[: -len(".idx")]
    bin_ = local_or_ranged(url + ".bin", cache, ranged, version=version)
    return prefix, bin_ if isinstance(bin_, RangedFile) else None


class RangedTokens:
    """The tokens of a ``.bin`` read by ranges: a read-only, 1-D array-like of ``dtype``.

    ``tokens[a:b]`` is a fresh numpy array of those tokens (the blocks they lie in, fetched
    once); :meth:`spans` and :meth:`windows` read many ranges with one pass over the missing
    blocks. ``numpy.asarray(tokens)`` reads the whole file.
    """

    ndim = 1

    def __init__(self, file: RangedFile, dtype: np.dtype[Any]) -> None:
        self.file = file
        self.dtype = dtype
        self.shape = (len(file) // dtype.itemsize,)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"RangedTokens({self.file.url!r}, {self.shape[0]} x {self.dtype})"

    def __getitem__(self, key: slice | int) -> Any:
        n = self.shape[0]
        if isinstance(key, (int, np.integer)):
            if not -n <= key < n:
                raise IndexError(f"token {key} out of range for {n} tokens")
            return self.spans([int(key) % n], [1])[0][0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(
                f"tokens read by ranges take an int or a contiguous slice (got {key!r})"
            )
        start, stop, _ = key.indices(n)
        return self.spans([start], [max(0, stop - start)])[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def spans(self, starts: list[int], lengths: list[int]) -> list[np.ndarray]:
        """The tokens ``[starts[k], starts[k] + lengths[k])`` for each ``k`` (read-only)."""
        item = self.dtype.itemsize
        views = self.file.read_many(
            [(s * item, (s + n) * item) for s, n in zip(starts, lengths, strict=True)]
        )
        return [np.frombuffer(v, self.dtype) for v in views]

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """A fresh ``[len(starts), length]`` array: row ``k`` is the tokens from ``starts[k]``."""
        rows = self.spans(starts.tolist(), [length] * int(starts.shape[0]))
        return np.stack(rows) if rows else np.empty((0, length), self.dtype)
