"""Live resizing: a reading loader moves to a new data-parallel layout at a step boundary.

A job whose data-parallel size changes while it runs (a replica group leaves or joins, as
torchft and elastic launchers do) keeps its :class:`~meshfeed.DataLoader` /
:class:`~meshfeed.StreamLoader` object: ``loader.resize(mesh)`` (or ``loader.resize()`` to read
the new process group) re-slices from the next global batch. The global batch is the unit
(see :mod:`meshfeed.order.batches`): the sequence of global batches does not depend on the
number of data ranks, so the layout can change between any two of them and every sample is
still served once: the batches already returned are behind the position, the next global
batch is cut among the new data ranks. What the old layout prefetched is dropped (its workers
are stopped and start again on the next ``iter()``), and the per-rank batch becomes
``global_batch_size / new data ranks``.

The sample store's :class:`~meshfeed.queue.StoreLoader` resizes through its elastic resume
(:func:`rebuild`): its ``state_dict()``, then the same object built again on the new layout
from its arguments and the state loaded (see :mod:`meshfeed.queue.loading.resume`). It needs
``prefetch=1``: rounds fetched ahead live in the running store, and a layout change could lose
them (refused by name).

A rank that joins has not followed the position; it takes a peer's ``state_dict()`` with
``load_state_dict`` after resizing (what a torchft replica does with the model's state).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshfeed.loader_base import LoaderBase
from meshfeed.mesh import DataMesh, data_sizes_dividing

__all__ = ["check_divides", "rebuild", "relayout"]


def check_divides(global_batch_size: int, mesh: DataMesh, what: str) -> int:
    """The per-rank batch of ``global_batch_size`` over ``mesh``'s data ranks, refused by name
    when they do not divide it."""
    dp = mesh.data_world_size
    if global_batch_size % dp:
        raise ValueError(
            f"{what}: the global batch of {global_batch_size} samples does not divide among "
            f"{dp} data ranks (mesh {mesh.sizes}), so ranks would get unequal batches; use a "
            f"data-parallel size in {data_sizes_dividing(global_batch_size)} or a global "
            f"batch that {dp} divides"
        )
    return global_batch_size // dp


def relayout(loader: LoaderBase, mesh: DataMesh, rank: int, global_batch_size: int) -> None:
    """Move ``loader``'s placement to ``mesh`` / ``rank`` (see the module docstring).

    The loader is stopped (nothing planned for the old layout is served), then its mesh, rank,
    data rank and size, per-rank batch and options are those of the new layout; the door
    recomputes what depends on them (``DataLoader``: its plan, and its service over the current
    process group, whose agreement is checked again before the next first batch).
    """
    batch = check_divides(global_batch_size, mesh, f"resize of {loader.name}")
    loader.shutdown()
    loader.mesh, loader.rank = mesh, rank
    loader.data_rank, loader.data_world_size = mesh.data_rank(rank), mesh.data_world_size
    loader.batch_size = batch
    loader.options = dataclasses.replace(loader.options, batch_size=batch)


def rebuild(loader: Any, mesh: DataMesh, rank: int, state: dict[str, Any] | None) -> None:
    """Move a :class:`~meshfeed.queue.StoreLoader` to ``mesh`` / ``rank``: its state (or
    ``state``, a peer's), the same object built again from its arguments
    (``loader._arguments``) on the new layout, the state loaded (the store's elastic resume).
    A refused ``state`` (checked before the loader stops) or replan leaves the loader on its
    layout at its position, as a refused ``DataLoader.resize`` does."""
    batch = check_divides(
        loader.batch_size * loader.data_world_size, mesh, f"resize of {loader.name}"
    )
    ahead = "" if loader._keeps == 1 else f"its service ({type(loader.service).__name__})"
    if loader.prefetch != 1:
        ahead = f"prefetch={loader.prefetch}"
    if loader.delivery.ahead:  # pin_memory / device: the delivery thread takes batches ahead
        ahead = f"device={loader.options.device!r} / pin_memory={loader.pin_memory}"
    if ahead:
        # Measured: rounds fetched ahead by the old layout's threads could be consumed in the
        # live store after the state was taken, and a round was lost; refused until exact.
        raise ValueError(
            f"resize of {loader.name} with {ahead}: batches fetched ahead are taken from the "
            "live store and a leaving rank's are lost; build the loader with prefetch=1, "
            "without workers and device= / pin_memory to resize it live, or resume elastically "
            "(restore the store and the loader from one checkpoint on the new layout)"
        )
    here = loader.state_dict()
    state = here if state is None else state
    # Checked as the new layout will load it, before the loader stops: a refused state (a
    # peer's from another run, a stale one) leaves the loader reading where it was.
    loader._checked_state(state, mesh.data_world_size, batch)
    old = (loader.batch_size, loader.mesh, loader.rank)
    loader.shutdown()
    try:
        _build(loader, batch, mesh, rank)
        loader.load_state_dict(state)
    except BaseException:  # refused by the store (a replan): back on the old layout, as it was
        _build(loader, *old)
        loader.load_state_dict(here)
        raise


def _build(loader: Any, batch: int, mesh: DataMesh, rank: int) -> None:
    """Build the store loader again, on the same object, from its arguments on this layout."""
    walks = loader._walks  # the walk generation goes on: an iterator taken before stops
    type(loader).__init__(
        loader, loader.store, batch_size=batch, mesh=mesh, rank=rank, **loader._arguments
    )
    loader._walks = walks
