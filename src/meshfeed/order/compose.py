"""Which order a loader walks: the dataset's own (a mixture), a curriculum's, or a shuffle.

The loader calls :func:`build_order` once; nothing else decides the order. A source that has
an order of its own (e.g. :class:`~meshfeed.sources.Mixture`) declares ``make_order``; a
curriculum wraps whatever order is below it.
"""

from __future__ import annotations

from typing import Any

from meshfeed.order.batches import Order, ShuffledOrder


def build_order(
    dataset: Any,
    *,
    curriculum: Any,
    dataset_length: int,
    global_batch_size: int,
    seed: int,
    shuffle: bool,
) -> Order:
    """The order of ``dataset`` under ``curriculum`` (None: no curriculum)."""
    maker = getattr(curriculum, "make_order", None) or getattr(dataset, "make_order", None)
    if curriculum is not None and maker is None:
        raise ValueError(
            f"curriculum={curriculum!r} has no make_order(); pass a meshfeed curriculum"
        )
    if maker is None:
        return ShuffledOrder(dataset_length, seed=seed, shuffle=shuffle)
    order = maker(dataset_length=dataset_length, global_batch_size=global_batch_size, seed=seed)
    if not isinstance(order, Order):
        raise TypeError(f"make_order() returned {type(order).__name__}, which is not an Order")
    return order
