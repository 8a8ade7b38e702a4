"""Checks of a store state's bookkeeping, before a core is rebuilt from it.

A checkpoint file is read without unpickling objects, but its metadata is still the file's word:
a lower ``next_id`` would make new puts overwrite held samples, a repeated id would silently
drop a sample, an index past the tensor list or a missing field would surface as a bare
``IndexError`` / ``KeyError`` deep in the restore. :func:`check_state` checks the metadata and
:func:`check_values` the file's value codes against it, each raising ``ValueError`` that names
the fault, the partition or sample, and ``where`` (the file, or "SampleStore state").

What holds for every state :func:`meshfeed.queue.checkpoints.state.dump` writes: options of the
right types; per partition a unique name, unique sample ids (ints or strs), ``next_id`` above
every int id, sample fields among the partition's ``seen`` fields, consumed and held ids among
the held samples; no more samples held than ``produced``; per task no more consumed samples
held than its ``consumed`` count; with declared ``tasks``, no sample consumed by all of them
unless a loader holds it or a shared plan pins it. Cost: O(samples), a few dict/set operations per sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from meshfeed.queue.engine.records import StoreOptions

__all__ = ["check_state", "check_values"]

_ID_TYPES = (int, str)


def _fail(where: str, fault: str) -> NoReturn:
    raise ValueError(
        f"{where} is inconsistent: {fault}; the file is corrupted or was edited, restore an "
        "intact checkpoint"
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, _ID_TYPES) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(f, str) for f in value)


def _check_options(meta: Mapping[str, Any], where: str) -> None:
    opts = meta["options"]
    for key in ("capacity", "fields", "tasks"):
        if key not in opts:
            _fail(where, f"options lack {key!r} (options: {sorted(map(str, opts))})")
    for key in ("fields", "tasks"):
        if opts[key] is not None and not _names(opts[key]):
            _fail(where, f"options {key!r} is {opts[key]!r}, not a list of names or None")
    try:
        StoreOptions.from_dict(opts)
    except (TypeError, ValueError) as exc:
        _fail(where, f"options {opts!r} are invalid ({exc})")
    for task, n in meta["consumed"].items():
        if not _is_count(n):
            _fail(where, f"consumed count of task {task!r} is {n!r}, not an int >= 0")
    expired = meta.get("lease_expired", 0)
    if not _is_count(expired):
        _fail(where, f"lease_expired is {expired!r}, not an int >= 0")


_PARTITION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "closed": bool,
    "next_id": int,
    "seen": list,
    "samples": list,
    "consumed": dict,
    "cache": list,
}


def _check_fields(pm: Any, i: int, where: str) -> None:
    if not isinstance(pm, Mapping):
        _fail(where, f"partition {i} is a {type(pm).__name__}, not a dict")
    for key, types in _PARTITION_FIELDS.items():
        if key not in pm:
            _fail(where, f"partition {i} ({pm.get('name')!r}) lacks field {key!r}")
        if not isinstance(pm[key], types) or (isinstance(pm[key], bool) and types is int):
            _fail(where, f"partition {i} field {key!r} is {pm[key]!r:.80}, of the wrong type")
    if pm["next_id"] < 0:
        _fail(where, f"partition {pm['name']!r} has a negative next_id {pm['next_id']}")
    for key in ("held", "asked"):
        if not isinstance(pm.get(key, []), list):
            _fail(where, f"partition {pm['name']!r} field {key!r} is not a list")


def _check_samples(pm: Mapping[str, Any], where: str) -> set[Any]:
    """The partition's sample ids, checked: unique, below ``next_id``, fields all seen."""
    name, next_id = pm["name"], pm["next_id"]
    if not _names(pm["seen"]):
        _fail(where, f"partition {name!r} 'seen' is not a list of field names")
    seen = set(pm["seen"])
    ids: set[Any] = set()
    for s in pm["samples"]:
        if not (isinstance(s, list) and len(s) == 3 and _is_id(s[0])):
            _fail(
                where, f"partition {name!r} has a sample record {s!r:.80}, not [id, group, fields]"
            )
        key, group, fields = s
        if key in ids:
            _fail(where, f"partition {name!r} lists sample id {key!r} twice")
        ids.add(key)
        if type(key) is int and key >= next_id:
            _fail(
                where,
                f"partition {name!r} holds sample id {key} but its next_id is {next_id} (fresh "
                "ids would overwrite held samples)",
            )
        if group is not None and not _is_id(group):
            _fail(where, f"sample {key!r} of partition {name!r} has group {group!r}")
        if not _names(fields) or len(set(fields)) != len(fields):
            _fail(where, f"sample {key!r} of partition {name!r} has field names {fields!r:.80}")
        unseen = set(fields) - seen
        if unseen:
            _fail(
                where,
                f"sample {key!r} of partition {name!r} has fields {sorted(unseen)} the "
                f"partition never saw (seen: {sorted(seen)})",
            )
    return ids


def _check_ids(name: str, ids: set[Any], listed: Any, what: str, where: str) -> None:
    if not isinstance(listed, list):
        _fail(where, f"{what} of partition {name!r} is not a list")
    unknown = [k for k in listed if not _is_id(k) or k not in ids]
    if unknown:
        _fail(where, f"{what} of partition {name!r} names samples it does not hold: {unknown[:10]}")
    if len(set(listed)) != len(listed):
        _fail(where, f"{what} of partition {name!r} lists a sample twice")


def _key_ok(key: Any) -> bool:
    """Whether a shared-plan key (a list; inner lists become tuples on restore) is hashable."""
    if not isinstance(key, list):
        return False
    try:
        hash(tuple(tuple(x) if isinstance(x, list) else x for x in key))
    except TypeError:
        return False
    return True


def _check_cache(pm: Mapping[str, Any], where: str) -> None:
    name = pm["name"]
    for prefix_asked in pm.get("asked", []):
        if not _asked_ok(prefix_asked):
            _fail(where, f"partition {name!r} has an 'asked' record {prefix_asked!r:.80}")
    for em in pm["cache"]:
        if not _entry_ok(em):
            _fail(where, f"partition {name!r} has a malformed shared-batch entry {em!r:.120}")


def _asked_ok(prefix_asked: Any) -> bool:
    """Whether an 'asked' record is ``[key prefix, [[rank, index], ...]]``."""
    if not (isinstance(prefix_asked, list) and len(prefix_asked) == 2):
        return False
    prefix, asked = prefix_asked
    ok = _key_ok(prefix) and isinstance(asked, list)
    ok = ok and all(isinstance(a, list) and len(a) == 2 for a in asked)
    return ok and all(_is_int(x) for a in asked for x in a)


def _entry_ok(em: Any) -> bool:
    """Whether a shared-batch entry has every field, each of its type."""
    ok = isinstance(em, Mapping) and all(
        k in em for k in ("key", "parts", "fields", "read", "readers")
    )
    ok = ok and _key_ok(em["key"]) and _names(em["fields"]) and isinstance(em["parts"], list)
    ok = ok and all(isinstance(p, list) and all(map(_is_id, p)) for p in em["parts"])
    ok = ok and isinstance(em["read"], list) and all(map(_is_int, em["read"]))
    ok = ok and _is_count(em["readers"]) and em["readers"] >= 1
    return ok and (em.get("batch_size") is None or _is_count(em["batch_size"]))


def check_state(meta: Mapping[str, Any], *, where: str) -> None:
    """Raise ``ValueError`` naming the fault and ``where`` unless ``meta`` (an envelope already
    checked for kind, version and top-level types) is bookkeeping a store could have written."""
    _check_options(meta, where)
    names: set[str] = set()
    held_total = 0
    consumed_held: dict[str, int] = {}
    for i, pm in enumerate(meta["partitions"]):
        _check_fields(pm, i, where)
        name = pm["name"]
        if name in names:
            _fail(where, f"partition {name!r} appears twice")
        names.add(name)
        ids = _check_samples(pm, where)
        held_total += len(ids)
        for task, consumed in pm["consumed"].items():
            _check_ids(name, ids, consumed, f"task {task!r}'s consumed list", where)
            consumed_held[task] = consumed_held.get(task, 0) + len(consumed)
        held = pm.get("held", [])
        if not all(isinstance(h, list) and len(h) == 2 and _is_count(h[1]) for h in held):
            _fail(where, f"partition {name!r} has a malformed 'held' list {held!r:.80}")
        _check_ids(name, ids, [h[0] for h in held], "the held list", where)
        _check_cache(pm, where)
        _check_undelivered(pm, meta["options"].get("tasks"), where)
        _check_book(pm, where)
    if held_total > meta["produced"]:
        _fail(where, f"it holds {held_total} samples but counts only {meta['produced']} produced")
    for task, n in consumed_held.items():
        total = meta["consumed"].get(task, 0)
        if n > total:
            _fail(
                where,
                f"task {task!r} has {n} held samples marked consumed but a consumed count of "
                f"{total}",
            )


def _check_book(pm: Mapping[str, Any], where: str) -> None:
    """The partition's policy versions (:mod:`meshfeed.queue.engine.versions`), if any: well formed."""
    book = pm.get("book")
    if book is None:
        return
    name = pm["name"]
    ok = (
        isinstance(book, Mapping)
        and all(isinstance(book.get(k), list) for k in ("versions", "groups"))
        and all(isinstance(book.get(k), Mapping) for k in ("trainers", "stale", "filtered"))
        and all(
            isinstance(r, list)
            and len(r) == 3
            and _is_id(r[0])
            and _is_count(r[1])
            and _is_count(r[2])
            and r[1] <= r[2]
            for r in book["versions"]
        )
        and all(
            isinstance(t, list)
            and len(t) == 3
            and _is_count(t[0])
            and _is_count(t[2])
            and (t[1] is None or _is_count(t[1]))
            for t in book["trainers"].values()
        )
        and all(_is_count(n) for k in ("stale", "filtered") for n in book[k].values())
        and all(isinstance(g, list) and len(g) == 2 and _is_count(g[1]) for g in book["groups"])
    )
    if not ok:
        _fail(where, f"partition {name!r} has malformed policy versions {book!r:.120}")


def _check_undelivered(pm: Mapping[str, Any], tasks: Any, where: str) -> None:
    """With declared tasks, a sample every one of them consumed is dropped unless a loader
    holds it or a shared plan pins it: a state that keeps one otherwise marks a sample
    consumed that no task received (a crafted or damaged file), so it would never be
    delivered (#28)."""
    if not tasks:
        return
    done = set.intersection(*(set(pm["consumed"].get(t, ())) for t in tasks))
    if not done:
        return
    kept = {h[0] for h in pm.get("held", [])}
    for em in pm["cache"]:
        kept.update(k for part in em["parts"] for k in part)
    stray = sorted(map(repr, done - kept))
    if stray:
        _fail(
            where,
            f"partition {pm['name']!r} holds samples {stray[:10]} marked consumed by every "
            f"task {list(tasks)} but neither held by a loader nor pinned by a plan; a store "
            "drops such samples, so these were never delivered",
        )


def check_values(meta: Mapping[str, Any], values: Any, tensors: list[Any], *, where: str) -> None:
    """Raise ``ValueError`` unless ``values`` (the file's per-partition, per-sample value codes)
    has one row per sample of ``meta`` with exactly its fields, each code naming a tensor of
    ``tensors`` in range (a byte tensor for a pickled value)."""
    import torch

    parts = meta["partitions"]
    if not isinstance(values, list) or len(values) != len(parts):
        n = len(values) if isinstance(values, list) else type(values).__name__
        _fail(where, f"it has values for {n} partitions but metadata for {len(parts)}")
    for pm, rows in zip(parts, values, strict=True):
        name, samples = pm["name"], pm["samples"]
        if not isinstance(rows, list) or len(rows) != len(samples):
            n = len(rows) if isinstance(rows, list) else type(rows).__name__
            _fail(where, f"partition {name!r} has values for {n} samples but lists {len(samples)}")
        for (key, _, fields), row in zip(samples, rows, strict=True):
            if not isinstance(row, Mapping) or sorted(row) != sorted(fields):
                got = sorted(row) if isinstance(row, Mapping) else type(row).__name__
                _fail(
                    where,
                    f"sample {key!r} of partition {name!r} lists fields {sorted(fields)} but "
                    f"has values for {got}",
                )
            for f, code in row.items():
                fault = _code_fault(code, tensors, torch)
                if fault:
                    _fail(where, f"field {f!r} of sample {key!r} of partition {name!r} {fault}")


def _code_fault(code: Any, tensors: list[Any], torch: Any) -> str | None:
    """What is wrong with one value code (``None``: nothing)."""
    if not isinstance(code, Mapping) or len(set(code) & {"j", "t", "a", "p"}) != 1:
        return f"has the value code {code!r:.80}, not one of j/t/a/p"
    if "j" in code:
        return None
    tag = next(k for k in ("t", "a", "p") if k in code)
    index = code[tag]
    if not _is_count(index) or index >= len(tensors):
        return f"names tensor {index!r}, outside the file's {len(tensors)} tensors"
    tensor = tensors[index]
    if not isinstance(tensor, torch.Tensor):
        return f"names tensor {index}, which is a {type(tensor).__name__}"
    if tag == "p" and tensor.dtype != torch.uint8:
        return f"names pickled bytes in tensor {index} of dtype {tensor.dtype}"
    if tag == "a":
        if not isinstance(code.get("dtype"), str):
            return f"has no dtype string for array tensor {index}"
        try:
            tensor.numpy().view(code["dtype"])
        except (TypeError, ValueError, RuntimeError) as exc:
            return f"cannot view tensor {index} as dtype {code.get('dtype')!r} ({exc})"
    return None
