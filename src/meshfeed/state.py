"""The one state envelope of meshfeed: small, explicit, JSON-serialisable, validated on load.

Every stateful part writes ``envelope(kind, version, **fields)`` and reads with
``open_envelope(state, kind=..., version=..., fields=...)``, which refuses another part's state,
a whole training checkpoint, and an older or newer layout by name, never misreading one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, TypeGuard

from meshfeed.protocols import FingerprintedSource

__all__ = ["dataset_fingerprint", "envelope", "fingerprint_hash", "open_envelope"]


def dataset_fingerprint(dataset: Any) -> str:
    """A cheap identity for a dataset, stored in checkpoints to refuse another dataset's state.

    A dataset may define ``fingerprint`` (a property or method returning a string, e.g. file
    sizes and a header hash); otherwise it is the class name and length. Keep it cheap: it is
    computed once per loader.
    """
    if _fingerprinted(dataset):
        fp = dataset.fingerprint
        if callable(fp):
            fp = fp()
        if isinstance(fp, str) and fp:
            return fp
    cls = type(dataset)
    return f"{cls.__module__}.{cls.__qualname__}:{len(dataset)}"


_FINGERPRINTED_TYPES: set[type] = set()  # classes one of whose instances had a fingerprint


def _fingerprinted(dataset: Any) -> bool:
    """``isinstance(dataset, FingerprintedSource)``, the Protocol check (~50 us) made once per
    class: a mixture of 10,000 sources asks 10,000 times (#32)."""
    cls = type(dataset)
    if cls in _FINGERPRINTED_TYPES:
        return True
    if isinstance(dataset, FingerprintedSource):
        if isinstance(cls.__dict__.get("fingerprint"), property):
            _FINGERPRINTED_TYPES.add(cls)  # a class property: every instance has it
        return True
    return False


def fingerprint_hash(fingerprint: str) -> int:
    """63-bit hash of a fingerprint, for comparing across ranks in one int64 collective."""
    return (
        int.from_bytes(hashlib.blake2b(fingerprint.encode(), digest_size=8).digest(), "little") >> 1
    )


# ---------------------------------------------------------------------------------------------
# The one state envelope every stateful part uses: {"kind": ..., "version": ..., **fields}.

#: Which meshfeed release wrote which envelope version (for the message when refusing one):
#: meshfeed 0.1 wrote version 1 of every part except the store loader, which was at 2.
_RELEASES = {1: "meshfeed 0.1"}
_RELEASES_OF_KIND = {"store_loader": {2: "meshfeed 0.1"}}


def envelope(kind: str, version: int, **fields: Any) -> dict[str, Any]:
    """A state dict: ``{"kind": kind, "version": version, **fields}`` (JSON values only)."""
    return {"kind": kind, "version": version, **fields}


def _is_int(value: object) -> TypeGuard[int]:
    """``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_is_part_state(state: Any, name: str) -> None:
    """Refuse a non-dict and a whole training checkpoint (no kind, no version, nested dicts)."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"a {name} must be a dict (got {type(state).__name__}); pass the dict that "
            "state_dict() returned"
        )
    if (
        state.get("kind") is None
        and state.get("version") is None
        and any(isinstance(v, Mapping) for v in state.values())
    ):
        raise ValueError(
            f"this looks like a whole training checkpoint (keys {sorted(map(str, state))[:8]}), "
            f"not a {name}; pass the part that this object's state_dict() returned, e.g. "
            'load_state_dict(checkpoint["data"])'
        )


def _check_kind(
    state: Mapping[str, Any],
    name: str,
    *,
    kind: str,
    version: int,
    legacy_kinds: tuple[str, ...],
) -> None:
    """Refuse another part's state; an older layout (no kind, or a legacy kind) passes on to
    the version check, which refuses it with the version message."""
    got_kind, got_version = state.get("kind"), state.get("version")
    older_layout = (
        _is_int(got_version)
        and got_version < version
        and (got_kind is None or got_kind in legacy_kinds)
    )
    if got_kind != kind and not older_layout:
        raise ValueError(
            f"not a {name}: it has kind={got_kind!r}, expected kind={kind!r}; pass the dict "
            "that this object's state_dict() returned"
        )


def _check_version(got_version: Any, name: str, *, kind: str, version: int) -> None:
    """Refuse a missing or non-int version (malformed) and an older or newer one."""
    if not _is_int(got_version):
        raise ValueError(
            f"{name} is malformed: it has no int 'version' (got version={got_version!r}); pass "
            "the whole dict that state_dict() returned (a version is never missing from it)"
        )
    if got_version == version:
        return
    if got_version < version:
        release = _RELEASES_OF_KIND.get(kind, _RELEASES).get(got_version)
        hint = (
            f"it was written by {release or 'an older meshfeed'}, whose positions this version "
            "does not read; resume it with that release, or start this part fresh (a fresh "
            "loader can begin at any epoch with set_epoch)"
        )
    else:
        hint = "it was written by a newer meshfeed; upgrade meshfeed to resume it"
    raise ValueError(
        f"{name} has version={got_version!r}, this meshfeed reads version {version}; {hint}"
    )


def _check_field(
    out: Mapping[str, Any], key: str, types: type | tuple[type, ...], name: str
) -> None:
    """Refuse a missing field, a value of the wrong type (a bool is not an int unless ``bool``
    is named) and a negative int."""
    if key not in out:
        raise ValueError(
            f"{name} is missing {key!r} (keys: {sorted(map(str, out))}); the checkpoint is "
            "corrupted or from another part"
        )
    value = out[key]
    expected = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
        names = "/".join(t.__name__ for t in expected)
        raise ValueError(
            f"{name} field {key!r} has {value!r} of type {type(value).__name__}, expected "
            f"{names}; the checkpoint is corrupted"
        )
    if _is_int(value) and value < 0:
        raise ValueError(f"{name} field {key!r} is negative ({value}); the checkpoint is corrupted")


def _check_json(out: dict[str, Any], name: str) -> None:
    """Refuse a state that is not JSON-serialisable."""
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{name} is not JSON-serialisable ({exc}); the checkpoint is corrupted"
        ) from exc


def open_envelope(
    state: Any,
    *,
    kind: str,
    version: int,
    fields: Mapping[str, type | tuple[type, ...]] = {},
    what: str | None = None,
    legacy_kinds: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Check ``state`` is a ``kind`` envelope of ``version`` with ``fields`` of these types.

    Returns a plain dict copy. Raises ``ValueError`` naming the field, the value and the fix:
    a non-dict (or a whole training checkpoint), another kind, a missing or non-int version
    (malformed), an older or newer version (never misread), a missing field, a wrong type (``bool`` is not an ``int``), a negative int, or a
    value that is not JSON-serialisable. ``what`` names the part in messages (default: kind).
    A state of an older version that had no ``kind`` (or one of ``legacy_kinds``, the names
    earlier releases wrote) is refused with the version message, not as another part's state.
    """
    name = what or f"{kind} state"
    _check_is_part_state(state, name)
    _check_kind(state, name, kind=kind, version=version, legacy_kinds=legacy_kinds)
    _check_version(state.get("version"), name, kind=kind, version=version)
    out = dict(state)
    for key, types in fields.items():
        _check_field(out, key, types, name)
    _check_json(out, name)
    return out


#: Upper bound for any counter in a state: a count beyond it is corruption, not progress.
MAX_COUNT = 2**62


def check_count(value: object, *, name: str, what: str, upper: int = MAX_COUNT) -> int:
    """A counter read from a state: an int in ``[0, upper]``, else ``ValueError`` naming the
    field, the value and the bound."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{what} field {name!r} is {value!r} of type {type(value).__name__}, not an int; "
            "the checkpoint is corrupted"
        )
    if not 0 <= value <= upper:
        raise ValueError(
            f"{what} field {name!r} is {value}, outside [0, {upper}]; the checkpoint is "
            "corrupted or from another pipeline"
        )
    return value
