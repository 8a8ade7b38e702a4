"""A store loader's checkpoint: its state's layout and checks, and resuming it on another
number of data ranks (elastic resume).

With a rank-aware sampler over ``D`` data ranks, batch index ``j`` of a
:class:`~meshfeed.queue.loading.loader.StoreLoader` is one *round* the store planned once for all of
them, and the store keeps that plan until every reader has passed it (its checkpoint keeps the
plans too). So a loader's state names no sample: ``next``, the first batch index not returned,
and ``requested``, how far it had asked; every data rank writes the same state, whatever the
number of ranks (a few hundred bytes). A loader loaded from it asks again from ``next``: the
batches that were in flight are read back from their plans, the same batches. Loaded on ``D'``
data ranks with the same global batch (``D * batch_size == D' * batch_size'``), the loader
first has the store move the plans from ``next`` on to the new layout
(:meth:`SampleStore.replan <meshfeed.queue.SampleStore.replan>`: each round split into ``D'``
contiguous parts, the sampler's rule); every sample is still served once.
"""

from __future__ import annotations

from typing import Any

from meshfeed.state import open_envelope

__all__ = ["KIND", "VERSION", "check_moment", "check_resize", "open_state", "unit_of"]

KIND = "store_loader"
#: 3: the one state envelope (kind + version); prefetch counts the batch returned.
#: 4: pending batches name their whole round (every data rank's ids) and the state names the
#: global batch (data_world_size, batch_size, unit), not a data rank: resumable on another
#: data-parallel size.
#: 5: no sample ids: the batches in flight are read back from the store's plans (``next``,
#: ``requested``, and the policy version each was asked with); the state's size no longer
#: grows with the data ranks or the batch.
VERSION = 5


def unit_of(sampler: Any) -> int:
    """The samples a sampler keeps together: its ``group_size`` (a ``GroupSampler``, inside a
    rank-aware one or not, or a ``LengthBalancedSampler``), else 1."""
    inner = getattr(sampler, "inner", sampler)
    size = getattr(inner, "group_size", None)
    if size is None:
        size = getattr(sampler, "group_size", 1)
    return size if type(size) is int and size >= 1 else 1


def check_resize(
    *, ranks: int, batch_size: int, unit: int, new_ranks: int, new_batch_size: int, new_unit: int
) -> None:
    """Refuse loading a state of ``ranks`` x ``batch_size`` on ``new_ranks`` x
    ``new_batch_size`` when the global batch differs or a group would be split."""
    total = ranks * batch_size
    if total != new_ranks * new_batch_size:
        fix = (
            f"resume with batch_size={total // new_ranks} on {new_ranks} data ranks"
            if total % new_ranks == 0
            else f"use a number of data ranks that divides {total}"
        )
        raise ValueError(
            f"the StoreLoader state was taken with a global batch of {total} samples "
            f"({ranks} data ranks x batch_size={batch_size}), but this loader's is "
            f"{new_ranks * new_batch_size} ({new_ranks} x batch_size={new_batch_size}); a "
            f"store round is one global batch, so it must stay the same: {fix}"
        )
    if unit != new_unit:
        raise ValueError(
            f"the StoreLoader state was taken with groups of {unit} samples, but this loader's "
            f"sampler keeps groups of {new_unit}; resume with the same sampler (group_size="
            f"{unit})"
        )
    if new_batch_size % unit:
        raise ValueError(
            f"batch_size={new_batch_size} on {new_ranks} data ranks would split groups of "
            f"{unit} samples of the checkpoint's rounds; use a number of data ranks for "
            f"which {total} // ranks is a multiple of {unit}"
        )


def check_moment(consumed: int, task: str, nxt: int, st: dict[str, Any]) -> None:
    """Refuse a store that cannot be the one state ``st`` was taken with: every batch below
    ``next`` consumed at least one sample per data rank, so a store whose ``consumed`` count
    for ``task`` is lower (a fresh one) would serve other batches silently."""
    least = nxt * st["data_world_size"]
    if consumed < least:
        raise ValueError(
            f"the StoreLoader state is at batch {nxt} of task {task!r}, but this store has "
            f"consumed {consumed} sample(s) for it (at least {least} were): it is not the "
            "store the state was taken with. Restore the store from the checkpoint saved "
            "with this state (SampleStore.load or load_state_dict) before loading the "
            "loader's state"
        )


def open_state(
    state: Any,
    *,
    task: str,
    partition: str,
    ranks: int,
    batch_size: int,
    unit: int,
) -> dict[str, Any]:
    """The fields of a StoreLoader ``state``, every one checked: the envelope (kind, version),
    against the loading loader (``task``, ``partition``; its ``ranks`` x ``batch_size`` and
    group ``unit``: :func:`check_resize`) and itself (``next`` <= ``requested``)."""
    st = open_envelope(
        state,
        kind=KIND,
        version=VERSION,
        fields={
            "task": str,
            "partition": str,
            "data_world_size": int,
            "batch_size": int,
            "unit": int,
            "replica_size": int,
            "next": int,
            "requested": int,
            "ended": bool,
            "asked_versions": list,
        },
        what="StoreLoader state",
    )
    for key, mine in (("task", task), ("partition", partition)):
        if st[key] != mine:
            raise ValueError(
                f"the StoreLoader state is for {key}={st[key]!r} but this loader has "
                f"{key}={mine!r}; resume with the same configuration"
            )
    nxt, old_ranks = st["next"], st["data_world_size"]
    sizes = (old_ranks, st["batch_size"], st["unit"], st["replica_size"])
    if not nxt <= st["requested"] < 1 << 53 or min(sizes) < 1:
        raise ValueError(
            f"StoreLoader state has next={nxt}, requested={st['requested']}, "
            f"data_world_size={old_ranks}, batch_size="
            f"{st['batch_size']}, unit={st['unit']}, replica_size={st['replica_size']}: beyond "
            "any real stream, or not positive; the checkpoint is corrupted"
        )
    asked = st["asked_versions"]
    if len(asked) != st["requested"] - nxt or not all(
        v is None or (type(v) is int and 0 <= v < 1 << 62) for v in asked
    ):
        raise ValueError(
            f"StoreLoader state field 'asked_versions' is {asked!r:.80} (one policy version, "
            f"an int >= 0 or None, per batch from next={nxt} to requested={st['requested']}); "
            "the checkpoint is corrupted"
        )
    check_resize(
        ranks=old_ranks,
        batch_size=st["batch_size"],
        unit=st["unit"],
        new_ranks=ranks,
        new_batch_size=batch_size,
        new_unit=unit,
    )
    return st
