"""Every collective meshfeed makes, with the device rule written once and every wait bounded.

The rest of the library never calls ``torch.distributed`` directly: it asks this module to
check that ranks agree, to reduce a few ints, to gather int arrays of different lengths (or
pickled objects), or to exchange rows with ``all_to_all_single``.

- **Device rule** (:func:`device_for_backend`): an NCCL group gets tensors on the current CUDA
  device, every other backend (gloo, mpi, ...) CPU tensors. Results come back on the CPU.
- **Bounded waits**: every collective runs asynchronously and is waited on with
  ``work.wait(timeout=...)``; a rank that stalled, died or stopped iterating becomes a
  :class:`~meshfeed.errors.CollectiveError` on the others, saying whether a peer's connection
  closed (at once) or ``timeout`` passed, and naming this rank.
- **A group of its own**: without an explicit ``group``, the control collectives (reductions,
  gathers, agreements, barriers) run on a gloo group of meshfeed's own whose timeout is the
  caller's ``timeout`` (:func:`control_group`), not on the default group, whose timeout is the
  job's (30 minutes by default). So a collective abandoned after ``timeout`` also ends inside
  the backend at ``timeout``, and a survivor of a dead peer can exit: a collective still pending
  on a group blocks the process's exit until that group's timeout. ``all_to_all_single`` moves
  data and stays on the caller's group (NCCL for GPU tensors).
- **One process**: without an initialised process group, or with one rank, every function is a
  local no-op with the same result shape, so single-process simulations run the same code.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import math
import pickle
import threading
import time
from collections.abc import (
    Callable,
    Generator,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Literal, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from meshfeed.errors import CollectiveError, RankError

__all__ = [
    "all_gather_ints",
    "all_gather_objects",
    "all_max",
    "all_min",
    "all_ranks_have_a_batch",
    "all_to_all_single",
    "barrier",
    "check_agreement",
    "control_group",
    "device_for_backend",
    "fail_together",
    "first_failed_rank",
    "free_thread_groups",
    "gather_agreement",
    "global_rank",
    "group_device",
    "group_ranks",
    "is_distributed",
    "is_initialized",
    "mark_delivery_thread",
    "on_delivery_thread",
    "rank",
    "refuse_disagreement",
    "thread_group",
    "world_size",
]

#: Default bound on every wait, in seconds (torch.distributed's own default is 30 minutes).
DEFAULT_TIMEOUT = 300.0
_AGREEMENT_FIX = (
    "every rank must build its DataLoader with the same dataset, seed and global batch size"
)
#: The loader argument behind each fact a DataLoader's ranks agree on, for the fix of a
#: disagreement (a fact not listed here gets :data:`_AGREEMENT_FIX`).
_ARGUMENT_OF = {
    "seed": "seed=",
    "global_batch_size": "global batch size (batch_size x data-parallel size)",
    "dataset_length": "dataset",
    "dataset_fingerprint": "dataset",
    "shuffle": "shuffle=",
    "drop_last": "drop_last=",
    "pad_last": "pad_last=",
    "on_error": (
        "on_error= ('raise', held as 1, on every rank or on none: it makes one collective per "
        "step that every rank must join)"
    ),
}
#: Ints of an agreement's first all-gather, the same on every rank whatever it checks: the
#: number of facts, a hash of their names, then as many values as fit (the rest follow in a
#: second all-gather, only where every rank has more facts than fit).
_AGREEMENT_WIDTH = 32


def device_for_backend(backend: str, *, cuda_device: int | None = None) -> torch.device:
    """The device a collective's tensors must live on for a group of this backend.

    ``"nccl"`` → ``cuda:<cuda_device>`` (default: ``torch.cuda.current_device()``); any other
    backend → CPU. A pure function of its arguments when ``cuda_device`` is given.

    >>> device_for_backend("gloo")
    device(type='cpu')
    >>> device_for_backend("nccl", cuda_device=3)
    device(type='cuda', index=3)
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str such as 'nccl' or 'gloo' (got {backend!r})")
    if backend.lower() == "nccl":
        index = torch.cuda.current_device() if cuda_device is None else int(cuda_device)
        return torch.device("cuda", index)
    return torch.device("cpu")


def is_distributed(group: Any = None) -> bool:
    """True when a process group is initialised and ``group`` has more than one rank."""
    return is_initialized() and dist.get_world_size(group) > 1


def is_initialized() -> bool:
    """True when torch.distributed has a default process group."""
    return bool(dist.is_available() and dist.is_initialized())


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return int(dist.get_rank(group)) if is_initialized() else 0


def world_size(group: Any = None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return int(dist.get_world_size(group)) if is_initialized() else 1


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (itself for the default group)."""
    if group is None or not is_initialized():
        return int(group_rank)
    return int(dist.get_global_rank(group, group_rank))


def group_ranks(group: Any = None) -> list[int]:
    """The global ranks of ``group``, in group-rank order (``[0]`` without a process group)."""
    if not is_initialized():
        return [0]
    return [int(r) for r in dist.get_process_group_ranks(group or dist.group.WORLD)]


def group_device(group: Any = None) -> torch.device:
    """:func:`device_for_backend` of ``group``'s backend (CPU without a process group)."""
    if not is_initialized():
        return torch.device("cpu")
    return device_for_backend(str(dist.get_backend(group)))


def _check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds as a number (got {timeout!r})")
    if math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be positive seconds (got {timeout=}); e.g. timeout=300")
    # timedelta overflows near 1e9 days; a year is "no limit" for a collective.
    return min(float(timeout), 365 * 86400.0)


def control_group(timeout: float, group: Any = None, *, side: bool = False) -> Any:
    """The group meshfeed's control collectives run on: ``group`` when one is given, else a
    gloo group over every rank whose timeout is ``timeout`` (see the module docstring).

    ``side=True``: a second such group, for collectives a loop's thread makes while another
    of its threads makes the loader's own (``delivery_stats(across_ranks=True)`` beside the
    delivery thread's per-step checks): on one group, a rank whose thread ran ahead would pair
    its collective with a different one of its peer's.

    Created on first use, both at once (in the same order on every rank, whichever thread
    asks first), once per timeout value and default group; creating them is itself a
    collective of every rank (``torch.distributed.new_group``), which the first collective of
    that timeout is on every rank in the same order. A rank that never arrives makes it a
    :class:`~meshfeed.errors.CollectiveError` within about ``timeout``.

    On a delivery thread (:func:`mark_delivery_thread`: ``Delivered`` runs its inner iterator
    there, e.g. ``BalancedBatches``, while the loop's thread may iterate another loader) the
    control collectives run on a group of that thread's own (:func:`thread_group`), taken at
    its first collective: the loop thread's collectives and another delivery thread's never
    pair with its own. A walk that ended frees it for the next; one abandoned part way (the
    ranks' threads may be a collective apart) retires it (:func:`free_thread_groups`), so
    nothing left there pairs with a later walk's collectives. ``torch.distributed`` names a
    new group by a count of the groups each process made, so every rank must make it at the
    same point of that count: an inner iterator's first collective comes with its first item,
    while the loop waits for that item (and makes no group). Another thread that makes a
    group at that very moment on some ranks only (a loop that builds a loader with a new
    timeout while a walk's first item is made) would pair the wrong groups.
    """
    if group is not None or not is_distributed():
        return group
    timeout = _check_timeout(timeout)
    if not side and on_delivery_thread():
        return thread_group(
            ("control", timeout), lambda: _make_groups(timeout, ("meshfeed-delivery",))[0]
        )
    with _OWN_LOCK:
        if _OWN_WORLD[0] is not dist.group.WORLD:  # a new default group: new groups too
            _OWN_GROUPS.clear()
            _OWN_WORLD[0] = dist.group.WORLD
        if timeout not in _OWN_GROUPS:
            _OWN_GROUPS[timeout] = _make_groups(timeout, ("meshfeed", "meshfeed-side"))
        return _OWN_GROUPS[timeout][side]


def _make_groups(timeout: float, descs: tuple[str, ...]) -> tuple[Any, ...]:
    """gloo groups over every rank with ``timeout``, one per description."""
    start = time.monotonic()
    try:
        return tuple(
            dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout), group_desc=desc
            )
            for desc in descs
        )
    except RuntimeError as exc:  # gloo's rendezvous: a rank never came
        what = f"setting up meshfeed's process group {descs[0]!r} (its first collective)"
        raise _failure(exc, time.monotonic() - start, timeout, what) from exc


_THREAD = threading.local()  # .groups: the groups a delivery thread took (None elsewhere)
#: Delivery threads' groups free for the next walk, per key, in the order the loop freed them.
_POOL: dict[Hashable, list[Any]] = {}
_POOL_WORLD: list[Any] = [None]
_POOL_LOCK = threading.Lock()


def mark_delivery_thread() -> dict[Hashable, Any]:
    """Called first thing on a delivery thread (:mod:`meshfeed.delivery`): meshfeed's
    collectives made on this thread run on groups of its own (:func:`thread_group`). Returns
    the table of the groups it takes, for the loop to hand back (:func:`free_thread_groups`)."""
    _THREAD.groups = {}
    return _THREAD.groups


def on_delivery_thread() -> bool:
    """Whether this thread is a delivery thread (:func:`mark_delivery_thread`)."""
    return getattr(_THREAD, "groups", None) is not None


def thread_group(key: Hashable, make: Callable[[], Any]) -> Any:
    """On a delivery thread, its group for ``key``: one an earlier walk left clean, else
    ``make()`` (at the first call: every rank's thread makes the same calls in the same order,
    while its loop waits for the walk's first item)."""
    groups: dict[Hashable, Any] = _THREAD.groups
    if key not in groups:
        with _POOL_LOCK:
            if _POOL_WORLD[0] is not dist.group.WORLD:  # a new default group: new groups too
                _POOL.clear()
                _POOL_WORLD[0] = dist.group.WORLD
            free = _POOL.get(key)
            group = free.pop() if free else None
        groups[key] = make() if group is None else group
    return groups[key]


def free_thread_groups(groups: Mapping[Hashable, Any] | None, clean: bool) -> None:
    """On the loop's thread, once a walk's delivery thread is done: its groups go back for
    the next walk when the walk was ``clean`` (the loop took its end: every collective of it
    completed, on every rank alike), in the loop's order, the same on every rank. Those of a
    walk left part way (ranks' threads may be a collective apart, or one still in one) are
    never used again; never destroyed either: ``torch.distributed`` names a group by a count
    of the groups a process holds, and a destroyed one would give its name to the next."""
    if not groups or not clean:
        return
    with _POOL_LOCK:
        if _POOL_WORLD[0] is not dist.group.WORLD:
            return
        for key, group in groups.items():
            _POOL.setdefault(key, []).append(group)


_OWN_GROUPS: dict[float, tuple[Any, ...]] = {}
_OWN_WORLD: list[Any] = [None]
_OWN_LOCK = threading.Lock()


#: What a backend's error says when the peer refused or closed the connection.
_PEER_GONE = ("connection refused", "connection closed", "connection reset", "broken pipe")


def _failure(exc: BaseException | None, elapsed: float, timeout: float, what: str) -> Exception:
    """The error of a collective that failed after ``elapsed`` s: closed, or timed out."""
    me = f"rank {dist.get_rank()} of {dist.get_world_size()}"
    text = "" if exc is None else " ".join(str(exc).split())
    lowered, text = text.lower(), text[:300]
    # A peer that refused or closed the connection is gone or gave up (its own timeout passed
    # before this rank came), also where the backend calls that "timed out connecting".
    gone = any(sign in lowered for sign in _PEER_GONE)
    timed_out = exc is None or elapsed >= 0.95 * timeout or ("timed out" in lowered and not gone)
    if timed_out:
        message = (
            f"{me} waited more than timeout={timeout}s for the other ranks in {what}; a rank "
            "has stalled, stopped or is busy elsewhere (raise the loader's timeout= if a step "
            "legitimately takes longer)"
        )
    else:
        peer = (
            "a peer rank refused the connection"
            if "refused" in lowered
            else "a peer rank's connection closed"
        )
        message = (
            f"{me}: {peer} after {elapsed:.1f}s in {what}: it died or exited, or it gave up "
            "waiting for this rank (its own timeout passed before this rank came); see the "
            "other ranks' logs, and raise the loaders' timeout= if this rank legitimately "
            "comes later"
        )
    if text:
        message += f" (backend: {text})"
    return CollectiveError(
        message,
        this_rank=int(dist.get_rank()),
        reason="timeout" if timed_out else "closed",
        elapsed=elapsed,
    )


def _wait(work: Any, timeout: float, what: str) -> None:
    """Wait for an async collective at most ``timeout`` seconds, or raise naming ``what``."""
    start = time.monotonic()
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # the backend's own error: a closed connection, or a timeout
        raise _failure(exc, time.monotonic() - start, timeout, what) from exc
    if done is False:
        raise _failure(None, time.monotonic() - start, timeout, what)


def _all_reduce(
    values: Sequence[int], op: Literal["min", "max"], timeout: float, group: Any, what: str
) -> list[int]:
    timeout = _check_timeout(timeout)
    ints = [int(v) for v in values]
    if not is_distributed(group):
        return ints
    group = control_group(timeout, group)
    t = torch.tensor(ints, dtype=torch.int64, device=group_device(group))
    reduce_op = dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX
    _wait(dist.all_reduce(t, op=reduce_op, group=group, async_op=True), timeout, what)
    return [int(x) for x in t.cpu().tolist()]


def all_min(
    values: Sequence[int], *, timeout: float = DEFAULT_TIMEOUT, group: Any = None
) -> list[int]:
    """Element-wise minimum of a few ints over ``group`` (one all_reduce, bounded wait)."""
    return _all_reduce(values, "min", timeout, group, "all_min")


def all_max(
    values: Sequence[int], *, timeout: float = DEFAULT_TIMEOUT, group: Any = None
) -> list[int]:
    """Element-wise maximum of a few ints over ``group`` (one all_reduce, bounded wait)."""
    return _all_reduce(values, "max", timeout, group, "all_max")


def all_ranks_have_a_batch(mine: bool, timeout: float, *, group: Any = None) -> bool:
    """True when every rank has a next batch: one ``all_reduce(MIN)`` of one int.

    torchdata's ``fullsync`` at one collective per batch: ranks of a stream of unknown length
    stop at the same step.
    """
    return bool(_all_reduce([1 if mine else 0], "min", timeout, group, "the end-of-data check")[0])


def first_failed_rank(
    failed: bool, *, timeout: float = DEFAULT_TIMEOUT, group: Any = None
) -> int | None:
    """The lowest rank of ``group`` that says it ``failed`` at this step, else None.

    One ``all_reduce(MIN)`` of one int: every rank calls it once per step, failed or not, so
    all of them learn of a failure at the same step and none is left waiting in its next
    collective. Without a process group, or alone: ``0`` if ``failed``, else None (no call).
    """
    if not is_distributed(group):
        _check_timeout(timeout)
        return 0 if failed else None
    size = world_size(group)
    mine = rank(group) if failed else size
    lowest = _all_reduce([mine], "min", timeout, group, "the per-step error check")[0]
    return None if lowest >= size else lowest


T = TypeVar("T")


def fail_together(
    items: Iterable[T],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    where: Callable[[], str] = lambda: "this step",
    group: Any = None,
) -> Iterator[T]:
    """``items``, with one :func:`first_failed_rank` per item: an item that raises on one rank
    raises there and :class:`~meshfeed.errors.RankError` on every other rank, at the same item.

    Every rank must take the same number of items (the map-style loader's steps are equal by
    construction); ``where()`` names the item in the message (e.g. ``"step 3 of epoch 0"``).
    """
    source = iter(items)
    try:
        while True:
            try:
                item = next(source)
            except StopIteration:
                return
            except Exception as exc:
                # Tell the others first (a dead peer must not hide this rank's own error).
                with contextlib.suppress(CollectiveError):
                    first_failed_rank(True, timeout=timeout, group=group)
                raise exc
            failed = first_failed_rank(False, timeout=timeout, group=group)
            if failed is not None:
                raise RankError(
                    f"rank {failed} failed to make its batch at {where()} (this is rank "
                    f"{rank(group)}); see that rank's error. Every rank stops here so that none "
                    "waits in its next collective",
                    rank=failed,
                )
            yield item
    finally:
        if isinstance(source, Generator):  # a service's map: stop what it has in flight
            source.close()


def barrier(*, timeout: float = DEFAULT_TIMEOUT, group: Any = None) -> None:
    """Wait until every rank of ``group`` gets here (bounded, unlike ``dist.barrier``)."""
    _all_reduce([0], "min", timeout, group, "a barrier")


def _all_gather_fixed(t: torch.Tensor, timeout: float, group: Any, what: str) -> torch.Tensor:
    """All-gather one same-shape tensor per rank; returns ``(world, *t.shape)`` on the CPU."""
    world = dist.get_world_size(group)
    t = t.to(group_device(group))
    out = [torch.empty_like(t) for _ in range(world)]
    _wait(dist.all_gather(out, t, group=group, async_op=True), timeout, what)
    return torch.stack(out).cpu()


def all_gather_ints(
    values: Any,
    *,
    max_len: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    group: Any = None,
) -> list[np.ndarray]:
    """Every rank's 1-D int64 array (lengths may differ), in rank order.

    With ``max_len`` (an upper bound on every rank's length) this is one collective of
    ``max_len + 1`` ints; without it, two (the lengths, then the arrays padded to the longest).
    """
    timeout = _check_timeout(timeout)
    arr = np.ascontiguousarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"values must be 1-D (got shape {arr.shape}); flatten them first")
    if max_len is not None and arr.size > max_len:
        raise ValueError(f"values hold {arr.size} ints, more than {max_len=}; raise max_len")
    if not is_distributed(group):
        return [arr.copy()]
    group = control_group(timeout, group)
    if max_len is None:
        sizes = _all_gather_fixed(
            torch.tensor([arr.size], dtype=torch.int64), timeout, group, "all_gather_ints"
        )
        width = int(sizes.max())
    else:
        width = int(max_len)
    buf = torch.zeros(width + 1, dtype=torch.int64)
    buf[0] = arr.size
    buf[1 : 1 + arr.size] = torch.from_numpy(arr)
    rows = _all_gather_fixed(buf, timeout, group, "all_gather_ints").numpy()
    return [rows[r, 1 : 1 + int(rows[r, 0])].copy() for r in range(rows.shape[0])]


def all_gather_objects(
    obj: Any, *, timeout: float = DEFAULT_TIMEOUT, group: Any = None
) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (two collectives, bounded waits).

    Like ``dist.all_gather_object`` but with the device rule and a timeout. Only for objects
    this library made itself on the ranks of one job: it unpickles what the other ranks send.
    """
    if not is_distributed(group):
        _check_timeout(timeout)
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    parts = all_gather_ints(data.astype(np.int64), timeout=timeout, group=group)
    return [pickle.loads(p.astype(np.uint8).tobytes()) for p in parts]


def check_agreement(
    values: Mapping[str, int],
    timeout: float = DEFAULT_TIMEOUT,
    *,
    group: Any = None,
    what: str = "data loaders",
    fix: str | None = None,
) -> None:
    """Raise ``ValueError`` on every rank if any of these small ints differs across ranks.

    One all-gather of a few int64s with a bounded wait (:func:`gather_agreement`). The message
    names the field and the value each rank holds (``"data loaders disagree on seed: rank i
    holds [0, 1]"``), so a misconfigured job stops at its first batch instead of hanging or
    training on overlapping shards.
    """
    refuse_disagreement(
        gather_agreement(values, timeout, group=group, what=what), what=what, fix=fix
    )


def gather_agreement(
    values: Mapping[str, int],
    timeout: float = DEFAULT_TIMEOUT,
    *,
    group: Any = None,
    what: str = "data loaders",
) -> dict[str, list[int]]:
    """Every rank's value of each of these small ints, in rank order.

    One all-gather of the same number of int64s on every rank (the number of facts, a hash of
    their names, then their values; a second one only for more than 30 facts), with a bounded
    wait. Ranks that check different facts (built with different arguments: a ramp on some
    only) raise ``ValueError`` on every rank, naming the facts each rank has: never a
    collective whose sizes differ between ranks, which the backend may answer by aborting a
    process.
    """
    timeout = _check_timeout(timeout)
    names = sorted(values)  # compared by name, whatever the order they were given in
    mine = [int(values[n]) for n in names]
    if not is_distributed(group):
        return {name: [int(values[name])] for name in values}
    fit = _AGREEMENT_WIDTH - 2
    rows = all_gather_ints(
        [len(names), _names_hash(names), *mine[:fit]],
        max_len=_AGREEMENT_WIDTH,
        timeout=timeout,
        group=group,
    )
    if len({(int(row[0]), int(row[1])) for row in rows}) > 1:  # every rank sees this alike
        held = all_gather_objects(names, timeout=timeout, group=group)
        raise ValueError(_different_facts(held, what))
    table = np.stack([row[2:] for row in rows])
    if len(names) > fit:
        rest = all_gather_ints(mine[fit:], max_len=len(names) - fit, timeout=timeout, group=group)
        table = np.concatenate([table, np.stack(rest)], axis=1)
    columns = {name: table[:, j].tolist() for j, name in enumerate(names)}
    return {name: columns[name] for name in values}


def _names_hash(names: Sequence[str]) -> int:
    """63-bit hash of a list of names, the same in every process."""
    digest = hashlib.blake2b("\0".join(names).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _different_facts(held: Sequence[Sequence[str]], what: str) -> str:
    """The message for ranks that check different facts: ``held[r]`` is rank r's."""
    common = set.intersection(*(set(names) for names in held))
    extra = [sorted(set(names) - common) for names in held]
    by_extra: dict[tuple[str, ...], list[int]] = {}
    for r, names in enumerate(extra):
        by_extra.setdefault(tuple(names), []).append(r)
    shown = ", ".join(
        f"{_ranks_text(ranks)} {'has' if len(ranks) == 1 else 'have'} "
        + (f"facts {list(names)}" if names else "none of them")
        for names, ranks in by_extra.items()
    )
    differ = sorted({name for names in extra for name in names})
    return (
        f"{what} were built with different arguments: the ranks check different facts "
        f"(beyond the {len(common)} every rank has, {shown}); {_fix_for(differ)}"
    )


def _ranks_text(ranks: Sequence[int]) -> str:
    """``"rank 0"``, ``"ranks 1-7"`` or ``"ranks [1, 3]"``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {list(ranks)}"


def _fix_for(names: Sequence[str]) -> str:
    """The fix for ranks that differ in the facts ``names``: the loader arguments they come
    from (the generic fix where one is not a DataLoader's)."""
    arguments: list[str] = []
    for name in names:
        argument = _ARGUMENT_OF.get(name, "rampup=" if name.startswith("rampup_") else None)
        if argument is None:
            return _AGREEMENT_FIX
        if argument not in arguments:
            arguments.append(argument)
    return "every rank must build its DataLoader with the same " + ", ".join(arguments)


def refuse_disagreement(
    columns: Mapping[str, Sequence[int]], *, what: str = "data loaders", fix: str | None = None
) -> None:
    """``ValueError`` naming the first of ``columns`` (each rank's value, in rank order) whose
    ranks differ, with every rank's value and ``fix`` (default: the loader argument that
    fact comes from); nothing when they all agree."""
    for name, column in columns.items():
        if len(set(column)) > 1:
            hint = _fix_for([name]) if fix is None else fix
            raise ValueError(f"{what} disagree on {name}: rank i holds {list(column)}; {hint}")


def all_to_all_single(
    send: torch.Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    group: Any = None,
) -> torch.Tensor:
    """Exchange rows: ``send_rows[r]`` rows of ``send`` go to rank r, ``recv_rows[r]`` come back.

    ``send`` is 2-D (rows x columns, the same columns and dtype on every rank); it is moved to
    the group's device and the received rows are returned on the CPU. One rank: the rows it
    sends to itself.
    """
    timeout = _check_timeout(timeout)
    if send.ndim != 2:
        raise ValueError(f"send must be 2-D rows x columns (got shape {tuple(send.shape)})")
    if sum(send_rows) != send.shape[0]:
        raise ValueError(
            f"send_rows must add up to the rows of send (got sum {sum(send_rows)} for "
            f"{send.shape[0]} rows)"
        )
    if not is_distributed(group):
        if list(send_rows) != list(recv_rows):
            raise ValueError(
                f"one rank receives what it sends (got {list(send_rows)=}, {list(recv_rows)=})"
            )
        return send.clone()
    device = group_device(group)
    recv = torch.empty((sum(recv_rows), send.shape[1]), dtype=send.dtype, device=device)
    work = dist.all_to_all_single(
        recv,
        send.to(device),
        [int(x) for x in recv_rows],
        [int(x) for x in send_rows],
        group=group,
        async_op=True,
    )
    _wait(work, timeout, "all_to_all_single")
    return recv.cpu()
