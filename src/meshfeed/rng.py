"""Per-sample randomness after the sharding point, and what a fetch knows about itself.

Randomness *before* the sharding point (the order) is shared by every rank and worker.
Randomness *after* it (augmentation) must be per sample and deterministic, so that it does not
depend on which rank or worker happens to fetch the sample, or on resumption:
:func:`sample_rng` is keyed on ``(seed, epoch, sample index)``.

Inside a dataset's ``__getitem__`` call :func:`fetch_info` to learn the loader's seed and epoch:

>>> def __getitem__(self, i):                      # doctest: +SKIP
...     rng = sample_rng(i)                        # seed and epoch of the current fetch
...     return augment(self.data[i], rng)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from meshfeed.order.permutation import derive_seed

_SAMPLE_OP = 0x5A4D  # keeps per-sample streams apart from order seeds derived from the same seed


@dataclass(frozen=True, kw_only=True, slots=True)
class FetchInfo:
    """Where the current fetch runs: the loader's seed and epoch, the step, the worker."""

    seed: int
    epoch: int
    step: int
    worker_id: int = 0
    num_workers: int = 0


class _Current(threading.local):
    """The fetch running in this thread: a :class:`FetchInfo`, its fields as a tuple (made
    into one when asked: most fetches never ask), or None (a class default: no
    ``AttributeError`` per fetch on a thread that never fetched)."""

    info: FetchInfo | tuple[int, int, int, int, int] | None = None


_local = _Current()


def fetch_info() -> FetchInfo | None:
    """The :class:`FetchInfo` of the fetch running in this thread, or None outside a fetch."""
    info = _local.info
    if isinstance(info, tuple):
        seed, epoch, step, worker_id, num_workers = info
        info = _local.info = FetchInfo(
            seed=seed, epoch=epoch, step=step, worker_id=worker_id, num_workers=num_workers
        )
    return info


class fetching:
    """``with fetching(info):`` makes ``info`` the current :func:`fetch_info` in the block:
    a :class:`FetchInfo`, or its fields ``(seed, epoch, step, worker_id, num_workers)``.

    A small class rather than ``@contextmanager``: it runs once per batch, and a generator
    context manager costs several microseconds there.
    """

    __slots__ = ("_info", "_previous")

    def __init__(self, info: FetchInfo | tuple[int, int, int, int, int]) -> None:
        self._info = info
        self._previous: FetchInfo | tuple[int, int, int, int, int] | None = None

    def __enter__(self) -> None:
        self._previous = _local.info
        _local.info = self._info

    def __exit__(self, *exc: object) -> None:
        _local.info = self._previous


def _key(index: int, seed: int | None, epoch: int | None) -> int:
    if seed is None or epoch is None:
        info = fetch_info()
        if info is None:
            raise ValueError(
                "sample_rng(index) without seed= and epoch= works only inside a fetch made by a "
                "meshfeed DataLoader; pass seed= and epoch= explicitly elsewhere"
            )
        seed = info.seed if seed is None else seed
        epoch = info.epoch if epoch is None else epoch
    return derive_seed(_SAMPLE_OP, seed, epoch, index)


def sample_rng(
    index: int, *, seed: int | None = None, epoch: int | None = None
) -> np.random.Generator:
    """A numpy Generator keyed on ``(seed, epoch, index)``: the same on every rank and resume."""
    return np.random.Generator(np.random.PCG64(_key(int(index), seed, epoch)))


def sample_generator(
    index: int, *, seed: int | None = None, epoch: int | None = None
) -> torch.Generator:
    """A ``torch.Generator`` keyed on ``(seed, epoch, index)``."""
    return torch.Generator().manual_seed(_key(int(index), seed, epoch))
