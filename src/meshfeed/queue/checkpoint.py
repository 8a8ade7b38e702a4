"""Store state as a versioned plain dict, and atomic checkpoint files.

``dump`` splits a :class:`StoreCore` into *metadata* (JSON-serialisable: options, per sample
its id, group and field names, per task the consumed ids, closed flags, shared-batch cache
entries, counters; with ``format`` and ``version``) and a *payload* (per partition, one dict
of field values per sample, in the metadata's order). ``restore`` rebuilds a core from both.
A checkpoint file is ``torch.save({"meta": ..., "payload": ...})`` written to a temporary file
in the target directory and renamed over the target with ``os.replace``, so a reader sees the
old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

from meshfeed.queue.core import FORMAT, VERSION, StoreCore
from meshfeed.queue.records import Entry, Partition, Ref, Sample, StoreOptions, nbytes_of

__all__ = ["dump", "read_checkpoint", "restore", "write_checkpoint"]


def dump(core: StoreCore, *, with_payload: bool = True) -> tuple[dict[str, Any], list[list[dict]]]:
    """The core's metadata and (optionally) payload; values stay as stored (maybe ``Ref``)."""
    partitions = []
    payload: list[list[dict]] = []
    for name, part in core.partitions.items():
        partitions.append(
            {
                "name": name,
                "closed": part.closed,
                "next_id": part.next_id,
                "seen": sorted(part.seen),
                "samples": [[k, s.group, list(s.fields)] for k, s in part.samples.items()],
                "consumed": {
                    t: [k for k in part.samples if k in c] for t, c in part.consumed.items()
                },
                "held": [[k, n] for k, n in part.held.items()],
                "cache": [
                    {
                        "key": list(key),
                        "parts": e.parts,
                        "fields": list(e.fields),
                        "read": sorted(e.read),
                        "readers": e.readers,
                        "batch_size": e.batch_size,
                        "agree": e.agree,
                    }
                    for key, e in part.cache.items()
                ],
            }
        )
        if with_payload:
            payload.append([dict(s.fields) for s in part.samples.values()])
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "options": core.options.to_dict(),
        "produced": core.produced,
        "consumed": dict(core.consumed_total),
        "partitions": partitions,
    }
    return meta, payload


def check_meta(meta: Any) -> None:
    """Raise ``ValueError`` unless ``meta`` is store metadata of this version."""
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        raise ValueError(
            "not a meshfeed SampleStore checkpoint (missing format tag); pass a file written "
            "by SampleStore.save"
        )
    if meta.get("version") != VERSION:
        raise ValueError(
            f"SampleStore checkpoint version {meta.get('version')!r} is not supported (this "
            f"meshfeed reads version {VERSION}); load it with the meshfeed that wrote it"
        )


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def restore(
    meta: Mapping[str, Any],
    payload: list[list[dict]] | None,
    *,
    current: StoreCore | None = None,
    options: StoreOptions | None = None,
) -> StoreCore:
    """Rebuild a core from ``meta`` and ``payload``; with ``payload=None`` take the values of
    the samples ``current`` holds (they must be exactly the samples ``meta`` names)."""
    check_meta(meta)
    core = StoreCore(options or StoreOptions.from_dict(meta["options"]))
    core.produced = int(meta["produced"])
    core.consumed_total = {str(t): int(n) for t, n in meta["consumed"].items()}
    for i, pm in enumerate(meta["partitions"]):
        name = pm["name"]
        part = Partition()
        part.closed = bool(pm["closed"])
        part.next_id = int(pm["next_id"])
        part.seen = set(pm["seen"])
        if payload is not None:
            rows = payload[i]
        else:
            old = current.partitions.get(name) if current is not None else None
            old_ids = list(old.samples) if old is not None else []
            new_ids = [s[0] for s in pm["samples"]]
            if old is None or old_ids != new_ids:
                raise ValueError(
                    f"the state names samples of partition {name!r} this store does not hold "
                    f"({len(new_ids)} in the state, {len(old_ids)} here); load_state_dict "
                    "restores consumption over the same puts; use SampleStore.load(path) to "
                    "restore the data as well"
                )
            rows = [dict(s.fields) for s in old.samples.values()]
        for (key, group, names), values in zip(pm["samples"], rows, strict=True):
            sample = Sample(group)
            for f in names:
                sample.fields[f] = values[f]
                part.field_counts[f] = part.field_counts.get(f, 0) + 1
            sample.nbytes = sum(nbytes_of(v) for v in sample.fields.values())
            sample.remote = sum(v.nbytes for v in sample.fields.values() if isinstance(v, Ref))
            part.samples[key] = sample
        for task, consumed in pm["consumed"].items():
            done = set(consumed)
            part.consumed[task] = done
            part.pending[task] = {k: None for k in part.samples if k not in done}
        part.held = {k: int(n) for k, n in pm.get("held", []) if k in part.samples}
        for em in pm["cache"]:
            entry = Entry(
                [list(p) for p in em["parts"]],
                tuple(em["fields"]),
                int(em["readers"]),
                em.get("batch_size"),
                em.get("agree"),
            )
            entry.read = set(em["read"])
            part.cache[tuple(_key(x) for x in em["key"])] = entry
            for p in entry.parts:
                for k in p:
                    if k in part.samples:
                        part.samples[k].pins += 1
        core.partitions[name] = part
        core.held += len(part.samples)
    return core


def write_checkpoint(path: str | os.PathLike[str], meta: dict[str, Any], payload: Any) -> None:
    """Write ``{"meta", "payload"}`` atomically: temp file in the same directory + rename."""
    import torch

    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".samplestore-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"meta": meta, "payload": payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[list[dict]]]:
    """Read a checkpoint file; raises ``ValueError`` for another format or version."""
    import torch

    if not os.path.exists(path):
        raise ValueError(f"no SampleStore checkpoint at {os.fspath(path)!r}; pass the save() path")
    blob = torch.load(path, weights_only=False)
    if not isinstance(blob, dict) or "meta" not in blob:
        raise ValueError(f"{os.fspath(path)!r} is not a SampleStore checkpoint; pass a save() path")
    check_meta(blob["meta"])
    return blob["meta"], blob["payload"]
