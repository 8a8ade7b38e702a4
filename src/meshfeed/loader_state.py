"""The layout of a DataLoader state (``kind="loader"``, version 2) and its checks.

Version 2 is the one envelope of :mod:`meshfeed.state`; every list in it is a leaf for
``torch.distributed.checkpoint`` (failures are rows ``[index, position, attempt, error,
message]``, not dicts), so a loader round-trips through DCP as a ``Stateful``.
"""

from __future__ import annotations

from typing import Any, Protocol

from meshfeed.curriculum.order import GatedOrder
from meshfeed.fetch import MAX_REPORTED_FAILURES
from meshfeed.loader_base import check_epoch
from meshfeed.mesh import data_sizes_dividing
from meshfeed.order.batches import BatchPlan, OrderHooks
from meshfeed.ordering import CurriculumMixtureOrder
from meshfeed.protocols import ExplainedSource, Order
from meshfeed.sources.mixture_order import MixtureOrder
from meshfeed.state import check_count, open_envelope


class ReadingLoader(Protocol):
    """What :func:`read_state` checks a state against (a :class:`meshfeed.DataLoader`)."""

    seed: int
    shuffle: bool
    drop_last: bool
    pad_last: bool
    batch_size: int
    data_world_size: int
    global_batch_size: int
    dataset: Any
    dataset_length: int
    fingerprint: str
    order: Order
    hooks: OrderHooks
    plan: BatchPlan


__all__ = [
    "COUNTS",
    "FIELDS",
    "LOADER_STATE_VERSION",
    "decode_stats",
    "encode_stats",
    "read_state",
]

#: Version 2 (meshfeed 0.2): the one envelope (``kind="loader"``), failures stored as rows, and
#: ``pad_last`` (how a last batch that does not divide among the ranks is served).
LOADER_STATE_VERSION = 2
COUNTS = ("retries", "substituted", "skipped", "padded")
FAILURE_KEYS = ("index", "position", "attempt", "error", "message")
#: The loader state's fields and their types (checked by ``open_envelope``).
FIELDS: dict[str, type | tuple[type, ...]] = {
    "seed": int,
    "epoch": int,
    "position": int,
    "global_batch_size": int,
    "data_world_size": int,
    "dataset_length": int,
    "fingerprint": str,
    "shuffle": bool,
    "drop_last": bool,
    "pad_last": bool,
    "stats": dict,
}


def encode_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The loader's stats as stored in its state (failures as rows)."""
    out: dict[str, Any] = {key: stats[key] for key in COUNTS}
    out["failures"] = [[f[k] for k in FAILURE_KEYS] for f in stats["failures"]]
    return out


def decode_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The ``stats`` of a loader state, checked field by field (refused by name)."""
    if set(stats) != {*COUNTS, "failures"}:
        raise ValueError(
            f"loader state field 'stats' has keys {sorted(map(str, stats))}, expected "
            f"{sorted([*COUNTS, 'failures'])}; the checkpoint is corrupted"
        )
    out: dict[str, Any] = {
        key: check_count(stats[key], name=key, what="loader stats") for key in COUNTS
    }
    rows = stats["failures"]
    if not isinstance(rows, list) or len(rows) > MAX_REPORTED_FAILURES:
        raise ValueError(
            f"loader stats field 'failures' is {rows!r}, not a list of at most "
            f"{MAX_REPORTED_FAILURES} rows; the checkpoint is corrupted"
        )
    failures = []
    for row in rows:
        ok = (
            isinstance(row, list)
            and len(row) == len(FAILURE_KEYS)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row[:3])
            and all(isinstance(x, str) for x in row[3:])
        )
        if not ok:
            raise ValueError(
                f"loader stats failure {row!r} is not [index, position, attempt, error, "
                "message]; the checkpoint is corrupted"
            )
        failures.append(dict(zip(FAILURE_KEYS, row, strict=True)))
    out["failures"] = failures
    return out


def _check_settings(loader: ReadingLoader, state: dict[str, Any]) -> None:
    """The seed and the shuffle, drop_last and pad_last switches match the loader's."""
    for key in ("seed", "shuffle", "drop_last", "pad_last"):
        mine = getattr(loader, key)
        if state[key] != mine:
            raise ValueError(
                f"checkpoint has {key}={state[key]!r} but this loader has {key}={mine!r}; "
                f"build the loader with {key}={state[key]!r} to resume this run"
            )


def _check_dataset(loader: ReadingLoader, state: dict[str, Any]) -> None:
    """The dataset length and fingerprint match the loader's (the dataset explains a
    differing fingerprint if it can)."""
    if (
        state["dataset_length"] == loader.dataset_length
        and state["fingerprint"] == loader.fingerprint
    ):
        return
    dataset = loader.dataset
    why = ""
    if isinstance(dataset, ExplainedSource):
        why = f" ({dataset.explain_fingerprint(state['fingerprint'])})"
    raise ValueError(
        f"checkpoint is from another dataset (length {state['dataset_length']}, "
        f"fingerprint {state['fingerprint']!r}) than this loader's (length "
        f"{loader.dataset_length}, fingerprint {loader.fingerprint!r}){why}; resume with the "
        "same dataset"
    )


def _check_global_batch(
    loader: ReadingLoader, state: dict[str, Any], *, allow_global_batch_change: bool
) -> None:
    """The global batch size and data world size are >= 1, and the global batch is the
    loader's unless a change is allowed (never for an order that counts its steps in global
    batches: a curriculum, a Mixture weight schedule)."""
    for key in ("global_batch_size", "data_world_size"):
        if state[key] < 1:
            raise ValueError(
                f"loader state field {key!r} must be >= 1 (got {state[key]}); the "
                "checkpoint is corrupted"
            )
    gbs, dp = state["global_batch_size"], loader.data_world_size
    if gbs == loader.global_batch_size:
        return
    counted = _steps_in_global_batches(loader.order, state.get("order"))
    if counted is not None:
        what, moved = counted
        keep = (
            f"batch_size={gbs // dp} on these {dp} data ranks"
            if gbs % dp == 0
            else f"a data-parallel size in {data_sizes_dividing(gbs)} with batch_size=G/dp"
        )
        raise ValueError(
            f"checkpoint global batch size {gbs} differs from this loader's "
            f"{loader.global_batch_size}, and this loader's order has {what}, whose steps are "
            f"counted in global batches of {gbs}: with another global batch {moved}, so it is "
            f"refused even with allow_global_batch_change=True; resume with the same global "
            f"batch size {gbs} ({keep})"
        )
    if allow_global_batch_change:
        return
    if gbs % dp:
        # The global batch is the unit: ranks with unequal shares would take unequal steps (#32).
        raise ValueError(
            f"checkpoint global batch size {gbs} does not divide among this loader's {dp} data "
            f"ranks, so it cannot resume exactly here; resume on a data-parallel size in "
            f"{data_sizes_dividing(gbs)} with batch_size=G/dp, or pass "
            "allow_global_batch_change=True to continue from the same sample position with "
            f"this loader's global batch {loader.global_batch_size}"
        )
    raise ValueError(
        f"checkpoint global batch size {gbs} differs from this loader's "
        f"{loader.global_batch_size} (batch_size={loader.batch_size} x data_world_size={dp}); "
        f"keep the global batch (e.g. batch_size={gbs // dp} if it divides) or pass "
        "allow_global_batch_change=True to continue from the same sample position"
    )


def _steps_in_global_batches(order: Order, facts: Any) -> tuple[str, str] | None:
    """What of ``order`` counts its steps in global batches of a fixed size (a curriculum, a
    Mixture's weight schedule, also one the checkpoint's ``facts`` restore), and what another
    global batch would do to it; None for an order without such steps."""
    if isinstance(order, (GatedOrder, CurriculumMixtureOrder)):
        return "a curriculum", "its step, and so its difficulty, would jump"
    if isinstance(order, MixtureOrder):
        recorded = facts.get("schedule") if isinstance(facts, dict) else None
        if len(order.mixture.schedule_json()) > 1 or (
            isinstance(recorded, list) and len(recorded) > 1
        ):
            return "a Mixture weight schedule", "its weight changes would move to other samples"
    return None


def _check_rampup(
    loader: ReadingLoader, state: dict[str, Any], *, allow_global_batch_change: bool
) -> None:
    """The batch-size ramp (``rampup_*`` fields, absent without one) is the loader's, and a
    rounded ramp rounds the same on this loader's data ranks (#32)."""
    mine = loader.plan.facts()
    theirs = {key: value for key, value in state.items() if key.startswith("rampup_")}
    if state.get("ramped") and not theirs:  # e.g. dropped by torch.distributed.checkpoint
        raise ValueError(
            f"checkpoint was taken with a batch-size ramp whose fields are missing from this "
            f"state (a loader without the ramp loads only the fields its own state has), and "
            f"this loader has {mine or None}; build the loader with the checkpoint's rampup"
        )
    if theirs != mine and not allow_global_batch_change:
        raise ValueError(
            f"checkpoint has batch-size ramp {theirs or None} but this loader has "
            f"{mine or None}; build the loader with the checkpoint's rampup (its batch sizes "
            "depend on it), or pass allow_global_batch_change=True to continue from the same "
            "sample position with this loader's"
        )
    if theirs == mine:
        loader.plan.check_resume_from(state["data_world_size"])


def _check_order_facts(loader: ReadingLoader, state: dict[str, Any]) -> None:
    """The order facts, if any, are a dict the loader's order accepts, and are present exactly
    when the loader's order describes its position."""
    if "order" in state:
        if not isinstance(state["order"], dict):
            raise ValueError(
                f"loader state field 'order' is {state['order']!r}, not a dict; the "
                "checkpoint is corrupted"
            )
        # Validate first: it re-seeds an order that walks (an earliest-deadline mixture) from
        # the checkpoint's facts, so describing the position below costs O(1), not O(position).
        loader.hooks.validate(state["order"])
    described = loader.hooks.describe(state["epoch"], state["position"])
    # ``order_facts`` (states since it was added) says whether the writer's order had facts:
    # through torch.distributed.checkpoint an ``order`` the loading loader lacks is dropped.
    if state.get("order_facts") and "order" not in state:
        raise ValueError(
            f"loader state says its order has facts, but they are missing; this loader's "
            f"order ({type(loader.order).__name__}) has "
            f"{'none' if described is None else 'some'}: resume with the dataset and "
            "curriculum that wrote the checkpoint"
        )
    if (described is None) != ("order" not in state):
        raise ValueError(
            f"loader state {'lacks' if described is not None else 'has'} order facts "
            f"({state.get('order')!r}) but this loader's order "
            f"({type(loader.order).__name__}) {'has' if described is not None else 'has none'}"
            "; resume with the dataset and curriculum that wrote the checkpoint"
        )


def read_state(
    loader: ReadingLoader, state: Any, *, allow_global_batch_change: bool
) -> dict[str, Any]:
    """``state`` checked field by field against ``loader``, its stats decoded; ValueError
    names what differs."""
    state = open_envelope(
        state, kind="loader", version=LOADER_STATE_VERSION, fields=FIELDS, what="loader state"
    )
    check_epoch(state["epoch"], "loader state")
    _check_settings(loader, state)
    _check_dataset(loader, state)
    _check_global_batch(loader, state, allow_global_batch_change=allow_global_batch_change)
    _check_rampup(loader, state, allow_global_batch_change=allow_global_batch_change)
    if state["position"] > loader.order.epoch_length(state["epoch"]):
        raise ValueError(
            f"checkpoint position {state['position']} is beyond the epoch length "
            f"{loader.order.epoch_length(state['epoch'])}; the checkpoint is corrupted"
        )
    state["stats"] = decode_stats(state["stats"])
    _check_order_facts(loader, state)
    return state
