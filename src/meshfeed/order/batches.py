"""Global batches: which dataset indices each data rank reads at each step.

Everything here is a pure function of ``(seed, epoch, position)``. An epoch is a sequence of
global sample *positions* ``0 .. epoch_length - 1``; an :class:`Order` maps positions to dataset
indices. The global batch that starts at position ``p`` covers ``[p, p + G)`` and data rank
``d`` of ``D`` takes the contiguous slice ``[p + d*len//D, p + (d+1)*len//D)`` (balanced to
within one sample when the final batch is short). Because the sequence of global batches never
depends on ``D``, a run can resume on a different number of data ranks and see the same data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshfeed.order.permutation import Permutation, check_seed, derive_seed
from meshfeed.protocols import Order, OrderBase

__all__ = [
    "BatchPlan",
    "Order",
    "OrderHooks",
    "ShuffledOrder",
    "Step",
    "order_hooks",
    "rank_bounds",
]


class ShuffledOrder(OrderBase):
    """The default order: a fresh :class:`Permutation` of the dataset per epoch.

    The permutation of epoch ``e`` is seeded by ``derive_seed(seed, e)``, so every rank and
    every worker computes the same order with no communication, and none is ever stored.
    """

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True) -> None:
        self.num_samples = int(num_samples)
        self.seed = check_seed(seed)
        self.shuffle = bool(shuffle)
        self._perm: tuple[int, Permutation] | None = None

    def epoch_length(self, epoch: int) -> int:
        return self.num_samples

    def permutation(self, epoch: int) -> Permutation:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, Permutation(self.num_samples, derive_seed(self.seed, epoch)))
        return self._perm[1]

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return positions.copy()
        return self.permutation(epoch)[positions]


@dataclass(frozen=True, slots=True)
class Step:
    """One global batch: positions ``[start, end)`` of ``epoch`` (``end - start`` real samples)."""

    epoch: int
    start: int
    end: int
    index: int  # the global step number within the epoch (start // G for aligned runs)


def rank_bounds(batch_len: int, data_rank: int, data_world_size: int) -> tuple[int, int]:
    """DeepSpeed's ``get_start_end_idx`` rule with integer arithmetic: balanced to +-1."""
    return (
        data_rank * batch_len // data_world_size,
        (data_rank + 1) * batch_len // data_world_size,
    )


class BatchPlan:
    """Walks an :class:`Order` in global batches of ``global_batch_size`` positions.

    With ``drop_last=True`` the final incomplete global batch of an epoch is dropped. With
    ``drop_last=False`` it is served split as evenly as possible (to within one sample per
    rank), and what happens when it does not divide among the data ranks depends on
    ``pad_last``:

    - ``pad_last=True`` (default): every sample of the epoch is served. A final batch with
      fewer samples than data ranks is padded up to one sample per rank by wrapping around to
      the start of the epoch order (:meth:`padding` counts those), so every rank takes the
      same number of steps.
    - ``pad_last=False``: the final batch is truncated to a multiple of ``data_world_size`` (it
      is dropped when fewer samples than ranks remain), so every rank reads the same number of
      samples and none twice; up to ``data_world_size - 1`` samples are left out. This is
      torchdata ``DataLoader2``'s distributed behaviour (41 items on 4 readers: 10 each). Only
      the last batch depends on ``data_world_size`` then.
    """

    def __init__(
        self,
        order: Order,
        *,
        global_batch_size: int,
        drop_last: bool = True,
        pad_last: bool = True,
        data_world_size: int = 1,
    ) -> None:
        self.order = order
        self.global_batch_size = int(global_batch_size)
        self.drop_last = bool(drop_last)
        self.pad_last = bool(pad_last)
        self.data_world_size = int(data_world_size)
        if self.data_world_size < 1:
            raise ValueError(f"data_world_size must be >= 1 (got {data_world_size=!r})")

    def _last_len(self, remaining: int) -> int:
        """Samples served by a final batch with ``remaining`` (< G) samples left."""
        if self.drop_last:
            return 0
        if self.pad_last:
            return remaining
        return remaining - remaining % self.data_world_size

    def _step_end(self, epoch: int, position: int, size: int) -> int:
        """Where a step of ``size`` samples at ``position`` ends (at ``position`` or before it
        when the epoch is over)."""
        end = min(position + size, self.order.epoch_length(epoch))
        if end - position < size:
            end = position + self._last_len(max(0, end - position))
        return end

    def step_at(self, epoch: int, position: int) -> Step | None:
        """The global batch starting at ``position``, or None when the epoch is over."""
        end = self._step_end(epoch, position, self.global_batch_size)
        if end <= position:
            return None
        return Step(epoch, position, end, position // self.global_batch_size)

    def steps(self, epoch: int, position: int = 0) -> int:
        """How many global batches remain in ``epoch`` from ``position``."""
        remaining = max(0, self.order.epoch_length(epoch) - position)
        full, rest = divmod(remaining, self.global_batch_size)
        return full + (1 if self._last_len(rest) > 0 else 0)

    def consumed(self, epoch: int) -> int:
        """Samples the steps of ``epoch`` cover (its full batches and its last batch's real
        samples; a batch dropped by ``drop_last`` is not consumed)."""
        full, rest = divmod(self.order.epoch_length(epoch), self.global_batch_size)
        return full * self.global_batch_size + self._last_len(rest)

    def unserved(self, epochs: int) -> int:
        """Samples of epochs ``0 .. epochs - 1`` no step served (a dropped last batch, or one
        truncated to the data ranks); every epoch has epoch 0's length here."""
        return epochs * (self.order.epoch_length(0) - self.consumed(0))

    def padding(self, step: Step, data_world_size: int) -> int:
        """How many wrapped-around samples pad ``step`` (non-zero only for a tiny last batch)."""
        return max(0, data_world_size - (step.end - step.start))

    def rank_padding(self, step: Step, data_rank: int, data_world_size: int) -> int:
        """How many of ``data_rank``'s samples in ``step`` are wrapped-around padding."""
        real = step.end - step.start
        lo, hi = rank_bounds(max(real, data_world_size), data_rank, data_world_size)
        return max(0, hi - max(lo, real))

    def rank_positions(self, step: Step, data_rank: int, data_world_size: int) -> np.ndarray:
        """The epoch positions data rank ``data_rank`` reads in ``step``."""
        real = step.end - step.start
        lo, hi = rank_bounds(max(real, data_world_size), data_rank, data_world_size)
        slots = np.arange(lo, hi, dtype=np.int64)
        positions = step.start + slots
        wrapped = slots >= real
        if wrapped.any():
            positions[wrapped] = (slots[wrapped] - real) % self.order.epoch_length(step.epoch)
        return positions

    def rank_indices(self, step: Step, data_rank: int, data_world_size: int) -> np.ndarray:
        return self.order.indices(step.epoch, self.rank_positions(step, data_rank, data_world_size))

    def rank_block(
        self, step: Step, data_rank: int, data_world_size: int, max_steps: int
    ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """``data_rank``'s (positions, indices) for up to ``max_steps`` steps from ``step``.

        Keyed by each step's start position. Full global batches (all but possibly an epoch's
        last) are computed in one vectorised shot: positions as a 2-D array, one order call,
        per-step rows as views; a short last batch (``drop_last=False``) is computed alone.
        """
        G = self.global_batch_size
        full = min(max_steps, (self.order.epoch_length(step.epoch) - step.start) // G)
        if full > 0:
            lo, hi = rank_bounds(G, data_rank, data_world_size)
            starts = step.start + G * np.arange(full, dtype=np.int64)
            positions = starts[:, None] + np.arange(lo, hi, dtype=np.int64)[None, :]
            indices = self.order.indices(step.epoch, positions.ravel()).reshape(positions.shape)
            return {s: (positions[k], indices[k]) for k, s in enumerate(starts.tolist())}
        positions = self.rank_positions(step, data_rank, data_world_size)
        return {step.start: (positions, self.order.indices(step.epoch, positions))}

    def facts(self) -> dict[str, int]:
        """What a loader's state and the ranks' agreement record of the plan beyond the global
        batch (a ramp's numbers; none here)."""
        return {}

    def _options(self, data_world_size: int) -> dict[str, Any]:
        """The keywords of this plan's constructor, over ``data_world_size`` data ranks."""
        return {
            "global_batch_size": self.global_batch_size,
            "drop_last": self.drop_last,
            "pad_last": self.pad_last,
            "data_world_size": data_world_size,
        }

    def with_ranks(self, data_world_size: int) -> BatchPlan:
        """This plan over ``data_world_size`` data ranks (a live resize)."""
        return BatchPlan(self.order, **self._options(data_world_size))

    def check_resume_from(self, data_world_size: int) -> None:
        """Refuse a checkpoint of ``data_world_size`` data ranks this plan cannot continue
        (none here: the global batch was checked; a rounded ramp refuses some)."""

    def global_indices(
        self, step: Step, data_world_size: int = 1
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every data rank's (positions, indices) for ``step``, with one order call in all."""
        slices = [self.rank_positions(step, d, data_world_size) for d in range(data_world_size)]
        flat = self.order.indices(step.epoch, np.concatenate(slices))
        parts = np.split(flat, np.cumsum([len(s) for s in slices])[:-1])
        return list(zip(slices, parts, strict=True))


@dataclass(frozen=True, slots=True)
class OrderHooks:
    """An order's checkpoint and re-planning hooks, resolved once when the loader is built."""

    describe: Callable[[int, int], Mapping[str, Any] | None]
    validate: Callable[[Mapping[str, Any]], None]
    #: None where the order overrides neither (the loader then skips them per batch).
    returned: Callable[[int, int], None] | None
    replanned: Callable[[int], int | None] | None


def _nothing(epoch: int, position: int) -> None:
    return None


def _accept(described: Mapping[str, Any]) -> None:
    return None


def order_hooks(order: Order) -> OrderHooks:
    """``describe(epoch, position)`` and ``validate(described)`` of ``order``, with defaults.

    An :class:`~meshfeed.protocols.OrderBase` declares both; an order that only satisfies the
    :class:`~meshfeed.protocols.Order` protocol records nothing and accepts any facts on resume.
    """
    if isinstance(order, OrderBase):
        replans = type(order).replanned is not OrderBase.replanned
        hears = replans or type(order).returned is not OrderBase.returned
        return OrderHooks(
            describe=order.describe,
            validate=order.validate,
            returned=order.returned if hears else None,
            replanned=order.replanned if replans else None,
        )
    return OrderHooks(describe=_nothing, validate=_accept, returned=None, replanned=None)
