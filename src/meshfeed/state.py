"""Loader checkpoints: small, explicit, JSON-serialisable, validated on load."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

STATE_VERSION = 1

#: Keys every loader state carries, with their types.
REQUIRED: dict[str, type | tuple[type, ...]] = {
    "version": int,
    "seed": int,
    "epoch": int,
    "position": int,
    "global_batch_size": int,
    "data_world_size": int,
    "dataset_length": int,
    "fingerprint": str,
    "shuffle": bool,
    "drop_last": bool,
}


def dataset_fingerprint(dataset: Any) -> str:
    """A cheap identity for a dataset, stored in checkpoints to refuse another dataset's state.

    A dataset may define ``fingerprint`` (a property or method returning a string, e.g. file
    sizes and a header hash); otherwise it is the class name and length. Keep it cheap: it is
    computed once per loader.
    """
    fp = getattr(dataset, "fingerprint", None)
    if callable(fp):
        fp = fp()
    if isinstance(fp, str) and fp:
        return fp
    cls = type(dataset)
    return f"{cls.__module__}.{cls.__qualname__}:{len(dataset)}"


def fingerprint_hash(fingerprint: str) -> int:
    """63-bit hash of a fingerprint, for comparing across ranks in one int64 collective."""
    return (
        int.from_bytes(hashlib.blake2b(fingerprint.encode(), digest_size=8).digest(), "little") >> 1
    )


def validate_state(state: Any) -> dict[str, Any]:
    """Check shape and types of a loader state; raise ValueError naming what is wrong."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"a loader state must be a dict (got {type(state).__name__}); pass the dict that "
            "DataLoader.state_dict() returned"
        )
    version = state.get("version")
    if version != STATE_VERSION:
        raise ValueError(
            f"loader state has version={version!r}, this meshfeed reads version {STATE_VERSION}; "
            "resume with the meshfeed version that wrote the checkpoint"
        )
    for key, kind in REQUIRED.items():
        if key not in state:
            raise ValueError(
                f"loader state is missing {key!r} (keys: {sorted(state)}); the checkpoint is corrupted"
            )
        value = state[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(
                f"loader state field {key!r} has {value!r} of type {type(value).__name__}, "
                f"expected {getattr(kind, '__name__', kind)}; the checkpoint is corrupted"
            )
    for key in ("epoch", "position", "seed"):
        if state[key] < 0:
            raise ValueError(
                f"loader state field {key!r} is negative ({state[key]}); the checkpoint is corrupted"
            )
    for key in ("global_batch_size", "data_world_size", "dataset_length"):
        if state[key] < 1:
            raise ValueError(
                f"loader state field {key!r} must be >= 1 (got {state[key]}); the checkpoint is corrupted"
            )
    try:
        json.dumps(dict(state))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"loader state is not JSON-serialisable ({exc}); the checkpoint is corrupted"
        ) from exc
    return dict(state)
