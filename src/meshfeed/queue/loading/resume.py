"""A store loader's checkpoint: its state's layout and checks, and resuming it on another
number of data ranks (elastic resume).

With a rank-aware sampler over ``D`` data ranks, batch index ``j`` of a
:class:`~meshfeed.queue.loading.loader.StoreLoader` is one *round* the store planned once for all of
them: ``D`` contiguous parts of whole units (samples, or groups of a ``GroupSampler``). A
loader's state names, for every round fetched but not returned, the whole round (every data
rank's part, in data-rank order, as the store's shared plan holds it), so every data rank
writes the same state. Loaded on ``D'`` data ranks with the same global batch
(``D * batch_size == D' * batch_size'``), each new rank takes its contiguous part of each such
round (:func:`split_round`: the sampler's rule, so an unchanged ``D`` gets its own part back)
and then continues with the rounds from ``next``: every sample is served once.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from meshfeed.queue.rounds import split_round
from meshfeed.state import open_envelope

__all__ = [
    "KIND",
    "VERSION",
    "check_pending",
    "check_resize",
    "open_state",
    "resplit",
    "unit_of",
]

KIND = "store_loader"
#: 3: the one state envelope (kind + version); prefetch counts the batch returned.
#: 4: pending batches name their whole round (every data rank's ids) and the state names the
#: global batch (data_world_size, batch_size, unit), not a data rank: resumable on another
#: data-parallel size.
VERSION = 4

Key = Hashable
#: A pending batch in a state: ``[index, parts]`` (``parts`` None: the stream ended there).
Pending = list[Any]


def unit_of(sampler: Any) -> int:
    """The samples a sampler keeps together: its ``group_size`` (a ``GroupSampler``, inside a
    rank-aware one or not, or a ``LengthBalancedSampler``), else 1."""
    inner = getattr(sampler, "inner", sampler)
    size = getattr(inner, "group_size", None)
    if size is None:
        size = getattr(sampler, "group_size", 1)
    return size if type(size) is int and size >= 1 else 1


def _round_ok(parts: Any, ranks: int) -> bool:
    if not (isinstance(parts, list) and len(parts) == ranks):
        return False
    if not all(isinstance(p, list) for p in parts):
        return False
    ids = [k for p in parts for k in p]
    return bool(ids) and all(type(k) in (int, str) for k in ids) and len(set(ids)) == len(ids)


def check_pending(pending: list[Any], nxt: int, ranks: int) -> None:
    """The batches a saved state names as in flight: ``[index, parts]`` with distinct
    indices below ``nxt``, each ``parts`` a list of ``ranks`` lists of distinct int/str ids
    (or ``None``: the end); ``ValueError`` otherwise."""
    seen: set[int] = set()
    for item in pending:
        ok = isinstance(item, list) and len(item) == 2
        if ok:
            index, parts = item
            ok = type(index) is int and 0 <= index < nxt and index not in seen
            ok = ok and (parts is None or _round_ok(parts, ranks))
        if not ok:
            raise ValueError(
                f"StoreLoader state field 'pending' has a bad entry {item!r:.120} (each is "
                f"[batch index < next={nxt}, the round's ids as {ranks} lists, one per data "
                "rank, or None], indices distinct); the checkpoint is corrupted"
            )
        seen.add(item[0])


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


def resplit(index: int, parts: list[list[Key]], new_ranks: int, unit: int) -> list[list[Key]]:
    """A pending round's parts for ``new_ranks`` data ranks (unchanged if the count is the
    same); ``ValueError`` when a rank would get no sample (the last, short round)."""
    if len(parts) == new_ranks:
        return parts
    ids = [k for p in parts for k in p]
    units = len(ids) // unit
    if len(ids) % unit:
        raise ValueError(
            f"StoreLoader state's batch {index} has {len(ids)} samples, not whole groups of "
            f"{unit}; the checkpoint is corrupted"
        )
    if units < new_ranks:
        raise ValueError(
            f"the StoreLoader state's batch {index} (the stream's last, short round) has "
            f"{units} unit(s) of {unit} sample(s), fewer than the {new_ranks} data ranks to "
            f"resume on: a data rank would get an empty batch and the ranks would take "
            f"different numbers of steps; resume on at most {units} data ranks (e.g. the "
            f"{len(parts)} the state was taken on)"
        )
    return split_round(ids, new_ranks, unit)


def open_state(
    state: Any,
    *,
    task: str,
    partition: str,
    ranks: int,
    batch_size: int,
    unit: int,
    replicas: int,
    evicting: bool,
) -> dict[str, Any]:
    """The fields of a StoreLoader ``state``, every one checked: the envelope (kind, version),
    against the loading loader (``task``, ``partition``; its ``ranks`` x ``batch_size`` and
    group ``unit``: :func:`check_resize`; its ``replicas`` per data rank when the store is
    ``evicting``: samples fetched ahead are held once per replica) and itself
    (:func:`check_pending`)."""
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
            "ended": bool,
            "pending": list,
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
    if nxt >= 1 << 53 or min(sizes) < 1:
        raise ValueError(
            f"StoreLoader state has next={nxt}, data_world_size={old_ranks}, batch_size="
            f"{st['batch_size']}, unit={st['unit']}, replica_size={st['replica_size']}: beyond "
            "any real stream, or not positive; the checkpoint is corrupted"
        )
    check_resize(
        ranks=old_ranks,
        batch_size=st["batch_size"],
        unit=st["unit"],
        new_ranks=ranks,
        new_batch_size=batch_size,
        new_unit=unit,
    )
    if evicting and st["replica_size"] != replicas:
        raise ValueError(
            f"the StoreLoader state was taken with {st['replica_size']} rank(s) per data rank "
            f"(replica peers) and this loader has {replicas}; its store drops consumed samples "
            "(tasks=...), so the batches fetched ahead are held once per peer and another "
            "number of peers would free them too early or never: resume with "
            f"{st['replica_size']} rank(s) per data rank (the data-parallel size may change)"
        )
    check_pending(st["pending"], nxt, old_ranks)
    return st
