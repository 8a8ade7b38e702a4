"""Store state as a versioned plain dict, and atomic checkpoint files.

``dump`` splits a :class:`StoreCore` into *metadata* (JSON-serialisable: options, per sample
its id, group and field names, per task the consumed ids, closed flags, shared-batch cache
entries, counters; with ``format`` and ``version``) and a *payload* (per partition, one dict
of field values per sample, in the metadata's order). ``restore`` rebuilds a core from both.

Checkpoint files never need to unpickle arbitrary objects. A file is
``torch.save({"format", "meta": <JSON text>, "values": <JSON text>, "tensors": [...]})`` and
is read with ``torch.load(weights_only=True)``, which only rebuilds tensors and plain
containers (a crafted pickle raises instead of running). Each stored value is a tensor, a
numpy array (stored as a tensor, its dtype in the JSON), or a JSON value that reads back
exactly (None, bool, int, float, str, lists, dicts with str keys: no tuples, no numpy
scalars); anything else is refused at ``save`` naming the partition, sample and field, unless
``allow_pickle=True`` is given to ``save`` *and* to ``load`` (the value is then pickled into a
byte tensor: load such files only from a source you trust). Loading checks the file's
bookkeeping before rebuilding anything (:mod:`meshfeed.queue.checkpoints.bookkeeping`): unique ids,
``next_id`` above every id, every field and tensor index present and in range, consistent
counts; ``ValueError`` naming the fault and the file otherwise.

Writes are atomic: a temporary file in the target directory, ``fsync``, then ``os.replace``,
so a reader sees the old file or the new one, never half of one. Temporary files are named
``.samplestore-<host>-<pid>-<random>.tmp``; a save removes the ones a killed save left in the
same directory: those of this host whose process is gone, and any older than
:data:`STALE_SECONDS` (a writer on another host, or a reused pid).
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshfeed.queue.checkpoints.bookkeeping import check_state, check_values
from meshfeed.queue.engine.columns import resolve
from meshfeed.queue.engine.core import KIND, VERSION, StoreCore
from meshfeed.queue.engine.plans import pin
from meshfeed.queue.engine.records import Entry, Partition, Ref, Sample, StoreOptions, nbytes_of
from meshfeed.queue.engine.versions import Book
from meshfeed.queue.rounds import Round
from meshfeed.state import envelope, open_envelope

__all__ = ["STALE_SECONDS", "dump", "read_checkpoint", "restore", "write_checkpoint"]

#: Age after which any leftover ``.samplestore-*.tmp`` is removed by the next save.
STALE_SECONDS = 24 * 3600.0
_FILE_FORMAT = "meshfeed.queue.SampleStore/file"


def dump(core: StoreCore, *, with_payload: bool = True) -> tuple[dict[str, Any], list[list[dict]]]:
    """The core's metadata and (optionally) payload; values stay as stored (maybe ``Ref``).

    Outstanding leases are not saved: their samples are written as not consumed by the
    lease's task (so the restored store delivers them again, counted in ``lease_expired``), as
    a consumer that has not acknowledged a batch may not have used it."""
    returned, consumed_total, lease_expired = _return_leases(core)
    partitions = [_partition_meta(name, part, returned) for name, part in core.partitions.items()]
    payload = [
        [{f: resolve(v) for f, v in s.cells(k).items()} for k, s in part.samples.items()]
        for part in core.partitions.values()
        if with_payload
    ]
    meta = envelope(
        KIND,
        VERSION,
        options=core.options.to_dict(),
        produced=core.produced,
        consumed=consumed_total,
        lease_expired=lease_expired,
        partitions=partitions,
    )
    return meta, payload


def _return_leases(
    core: StoreCore,
) -> tuple[dict[tuple[str, str], set[Any]], dict[str, int], int]:
    """The outstanding leases' ids by ``(partition, task)``, and the consumption and
    ``lease_expired`` counts as if those leases had expired."""
    returned: dict[tuple[str, str], set[Any]] = {}
    for lease in core.leases:
        returned.setdefault((lease.partition, lease.task), set()).update(lease.ids)
    consumed_total = dict(core.consumed_total)
    lease_expired = core.lease_expired
    for (name, task), ids in returned.items():
        leased = core.partitions.get(name)
        if leased is None:
            continue
        done = leased.consumed.get(task, set())
        n = sum(1 for k in ids if k in done and k in leased.samples)
        consumed_total[task] = consumed_total.get(task, 0) - n
        lease_expired += n
    return returned, consumed_total, lease_expired


def _partition_meta(
    name: str, part: Partition, returned: dict[tuple[str, str], set[Any]]
) -> dict[str, Any]:
    """One partition's metadata, its leased samples written as not consumed."""
    return {
        "name": name,
        "closed": part.closed,
        "next_id": part.next_id,
        "seen": sorted(part.seen),
        "samples": [[k, s.group, list(s.fields)] for k, s in part.samples.items()],
        "consumed": {
            t: [k for k in part.samples if k in c and k not in returned.get((name, t), ())]
            for t, c in part.consumed.items()
        },
        "held": [[k, n] for k, n in part.held.items()],
        "asked": [
            [list(prefix), [[r, i] for r, i in asked.items()]]
            for prefix, asked in part.asked.items()
        ],
        "cache": [_entry_meta(key, e) for key, e in part.cache.items()],
        "book": None if part.book is None else part.book.to_meta(),
    }


def _entry_meta(key: tuple[Any, ...], e: Entry) -> dict[str, Any]:
    return {
        "key": list(key),
        "parts": e.round.lists(),
        "fields": list(e.fields),
        "read": sorted(e.read),
        "readers": e.readers,
        "batch_size": e.batch_size,
        "agree": e.agree,
    }


def check_meta(meta: Any, *, what: str = "SampleStore state") -> None:
    """Raise ``ValueError`` unless ``meta`` is store state of this version (the one envelope)
    whose bookkeeping holds together (:func:`meshfeed.queue.checkpoints.bookkeeping.check_state`)."""
    open_envelope(
        meta,
        kind=KIND,
        version=VERSION,
        fields={"options": dict, "produced": int, "consumed": dict, "partitions": list},
        what=what,
    )
    check_state(meta, where=what)


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
    core.lease_expired = int(meta.get("lease_expired", 0))  # states before leases: none
    for i, pm in enumerate(meta["partitions"]):
        name = pm["name"]
        part = Partition(
            closed=bool(pm["closed"]), next_id=int(pm["next_id"]), seen=set(pm["seen"])
        )
        rows = payload[i] if payload is not None else _current_rows(current, name, pm)
        _restore_samples(part, pm, rows)
        _restore_progress(part, pm)
        _restore_cache(part, pm, evicting=bool(core.options.tasks))
        if pm.get("book") is not None:  # states before policy versions have none
            part.book = Book.from_meta(pm["book"], part.samples)
        core.partitions[name] = part
        core.held += len(part.samples)
    return core


def _current_rows(current: StoreCore | None, name: str, pm: Mapping[str, Any]) -> list[dict]:
    """The values ``current`` holds for partition ``name``; they must be exactly the samples
    the state names."""
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
    return [dict(s.cells(k)) for k, s in old.samples.items()]


def _restore_samples(part: Partition, pm: Mapping[str, Any], rows: list[dict]) -> None:
    for (key, group, names), values in zip(pm["samples"], rows, strict=True):
        sample = Sample(group)
        for f in names:
            sample.fields[f] = values[f]
            part.field_counts[f] = part.field_counts.get(f, 0) + 1
        sample.nbytes = sum(nbytes_of(v) for v in sample.fields.values())
        sample.remote = sum(v.nbytes for v in sample.fields.values() if isinstance(v, Ref))
        part.samples[key] = sample


def _restore_progress(part: Partition, pm: Mapping[str, Any]) -> None:
    """Each task's consumed and pending samples, the held counts and the asked positions."""
    for task, consumed in pm["consumed"].items():
        done = set(consumed)
        part.consumed[task] = done
        part.pending[task] = {k: None for k in part.samples if k not in done}
    part.held = {k: int(n) for k, n in pm.get("held", []) if k in part.samples}
    part.asked = {
        tuple(_key(x) for x in prefix): {int(r): int(i) for r, i in asked}
        for prefix, asked in pm.get("asked", [])
    }


def _restore_cache(part: Partition, pm: Mapping[str, Any], *, evicting: bool) -> None:
    """The partition's cached batches, each pinning the samples it names (``evicting``: a
    store that drops consumed samples)."""
    for em in pm["cache"]:
        entry = Entry(
            Round.of([list(p) for p in em["parts"]]),
            tuple(em["fields"]),
            int(em["readers"]),
            em.get("batch_size"),
            em.get("agree"),
        )
        entry.read = set(em["read"])
        part.cache[tuple(_key(x) for x in em["key"])] = entry
        if evicting:
            pin(part, list(filter(part.samples.__contains__, entry.round.ids)))


def _json_exact(value: Any) -> bool:
    """Whether ``value`` reads back from JSON as itself (same types, same structure)."""
    t = type(value)
    if t in (str, int, bool, float) or value is None:
        return True
    if t is list:
        return all(_json_exact(v) for v in value)
    if t is dict:
        return all(type(k) is str and _json_exact(v) for k, v in value.items())
    return False


def _encode(value: Any, tensors: list[Any], allow_pickle: bool, where: str) -> dict[str, Any]:
    import torch

    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu())
        return {"t": len(tensors) - 1}
    if isinstance(value, np.ndarray) and value.dtype != object:
        try:
            tensors.append(torch.from_numpy(np.array(value, order="C", copy=True)))
            return {"a": len(tensors) - 1, "dtype": value.dtype.str}
        except TypeError:
            pass  # a dtype torch cannot hold (strings, ...): JSON-exact check below
    if _json_exact(value):
        return {"j": value}
    if allow_pickle:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        tensors.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return {"p": len(tensors) - 1}
    raise ValueError(
        f"{where} is a {type(value).__name__} ({value!r:.80}), which a SampleStore checkpoint "
        "stores only as a tensor, a numpy array or a JSON value (None, bool, int, float, str, "
        "list, dict with str keys); convert it (e.g. a tuple to a list), or pass "
        "save(..., allow_pickle=True) and load(..., allow_pickle=True) for files you trust"
    )


def _decode(code: Mapping[str, Any], tensors: list[Any], allow_pickle: bool, path: str) -> Any:
    if "j" in code:
        return code["j"]
    if "t" in code:
        return tensors[code["t"]]
    if "a" in code:
        return tensors[code["a"]].numpy().view(np.dtype(code["dtype"]))
    if not allow_pickle:
        raise ValueError(
            f"{path!r} holds pickled values (saved with allow_pickle=True); loading them runs "
            "code from the file: pass SampleStore.load(..., allow_pickle=True) only for a file "
            "you trust"
        )
    return pickle.loads(tensors[code["p"]].numpy().tobytes())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def host_tag() -> str:
    """This host's name as temporary file names carry it: ``-`` (the names' separator)
    becomes ``_``. Writer and cleanup both call this, so they always agree."""
    return socket.gethostname().replace("-", "_")


def clean_stale(directory: str, *, now: float | None = None) -> list[str]:
    """Remove temporary files killed saves left in ``directory``; the removed paths.

    Stale: written on this host by a process that no longer runs, or older than
    :data:`STALE_SECONDS` whoever wrote it. A save in progress is never stale (its process
    runs, and it is younger than a day)."""
    now = time.time() if now is None else now
    host = host_tag()
    removed = []
    for tmp in glob.glob(os.path.join(glob.escape(directory), ".samplestore-*.tmp")):
        parts = os.path.basename(tmp)[len(".samplestore-") :].rsplit("-", 2)
        mine_dead = (
            len(parts) == 3
            and parts[0] == host
            and parts[1].isdigit()
            and not _alive(int(parts[1]))
        )
        try:
            old = now - os.path.getmtime(tmp) > STALE_SECONDS
            if mine_dead or old:
                os.unlink(tmp)
                removed.append(tmp)
        except FileNotFoundError:
            pass  # another save cleaned it meanwhile
    return removed


def write_checkpoint(
    path: str | os.PathLike[str],
    meta: dict[str, Any],
    payload: list[list[dict]],
    *,
    allow_pickle: bool = False,
) -> None:
    """Write metadata and payload atomically (see the module docstring for the format)."""
    import torch

    tensors: list[Any] = []
    names = [pm["name"] for pm in meta["partitions"]]
    values = [
        [
            {
                f: _encode(v, tensors, allow_pickle, f"field {f!r} of sample {sm[0]!r} of {name!r}")
                for f, v in row.items()
            }
            for sm, row in zip(pm["samples"], rows, strict=True)
        ]
        for name, pm, rows in zip(names, meta["partitions"], payload, strict=True)
    ]
    blob = {
        "format": _FILE_FORMAT,
        "meta": json.dumps(meta),
        "values": json.dumps(values),
        "tensors": tensors,
    }
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    clean_stale(directory)
    prefix = f".samplestore-{host_tag()}-{os.getpid()}-"
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_checkpoint(
    path: str | os.PathLike[str], *, allow_pickle: bool = False
) -> tuple[dict[str, Any], list[list[dict]]]:
    """Read a checkpoint file without unpickling objects; ``ValueError`` for anything else."""
    import torch

    where = os.fspath(path)
    if not os.path.exists(where):
        raise ValueError(f"no SampleStore checkpoint at {where!r}; pass the save() path")
    try:
        blob = torch.load(where, weights_only=True, map_location="cpu")
    except Exception as exc:  # a crafted pickle stops here, before any of it runs
        raise ValueError(
            f"{where!r} is not a SampleStore checkpoint this meshfeed can read safely "
            f"({type(exc).__name__}: {str(exc)[:200]}); pass a file written by "
            "SampleStore.save (older files are refused: they needed unsafe unpickling)"
        ) from None
    if not isinstance(blob, dict) or blob.get("format") != _FILE_FORMAT:
        raise ValueError(f"{where!r} is not a SampleStore checkpoint; pass a save() path")
    meta, values, tensors = _parts(blob, where)
    check_meta(meta, what=f"SampleStore checkpoint {where!r}")
    check_values(meta, values, tensors, where=f"SampleStore checkpoint {where!r}")
    payload = [
        [{f: _decode(c, tensors, allow_pickle, where) for f, c in row.items()} for row in rows]
        for rows in values
    ]
    return meta, payload


def _parts(blob: dict[str, Any], where: str) -> tuple[Any, Any, list[Any]]:
    """The metadata, value codes and tensors of a checkpoint file's blob, or ``ValueError``."""
    missing = [k for k in ("meta", "values", "tensors") if k not in blob]
    if missing or not isinstance(blob["tensors"], list):
        raise ValueError(
            f"SampleStore checkpoint {where!r} lacks {missing or 'a tensor list'}; the file is "
            "corrupted or was edited, restore an intact checkpoint"
        )
    try:
        meta, values = json.loads(blob["meta"]), json.loads(blob["values"])
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"SampleStore checkpoint {where!r} has unreadable metadata ({exc}); the file is "
            "corrupted or was edited, restore an intact checkpoint"
        ) from None
    return meta, values, blob["tensors"]
