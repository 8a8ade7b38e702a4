"""Test helpers every stateful part of meshfeed goes through.

:func:`assert_resume_equivalence` is the checkpoint-equivalence harness: run a fresh object to
the end, record its state after every item (the state must survive a JSON round trip), then for
every recorded state restore a fresh object and check that the remaining output is identical.

It speaks the one state protocol, :class:`meshfeed.protocols.Stateful` (``state_dict()`` /
``load_state_dict(state)``); an object without it is refused with ``TypeError``.
Objects that are iterables but not iterators (a DataLoader) are iterated epoch after epoch:
when one epoch ends the harness calls ``iter()`` again, so runs cross epoch boundaries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from meshfeed.protocols import Stateful

__all__ = ["assert_resume_equivalence", "assert_same", "take"]


def assert_same(a: Any, b: Any, path: str = "item") -> None:
    """Recursively assert two outputs are identical (tensors, arrays, mappings, sequences)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        _assert_same_tensors(a, b, path)
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        _assert_same_arrays(a, b, path)
    elif isinstance(a, Mapping) and isinstance(b, Mapping):
        _assert_same_mappings(a, b, path)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        _assert_same_sequences(a, b, path)
    elif not _both_nan(a, b) and a != b:
        raise AssertionError(f"{path}: {a!r} != {b!r}")


def _assert_same_tensors(a: Any, b: Any, path: str) -> None:
    """Both must be tensors of one dtype and shape with equal values."""
    for x in (a, b):
        if not isinstance(x, torch.Tensor):
            raise AssertionError(f"{path}: tensor vs {type(x).__name__}")
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        raise AssertionError(f"{path}: tensors differ\n{a}\n!=\n{b}")


def _assert_same_arrays(a: Any, b: Any, path: str) -> None:
    """Both, as numpy arrays, must have one shape and equal values."""
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    if a_arr.shape != b_arr.shape or not np.array_equal(a_arr, b_arr):
        raise AssertionError(f"{path}: arrays differ\n{a_arr}\n!=\n{b_arr}")


def _assert_same_mappings(a: Mapping[Any, Any], b: Mapping[Any, Any], path: str) -> None:
    """Same keys, and the same value under each key."""
    if set(a) != set(b):
        raise AssertionError(f"{path}: keys differ {sorted(map(str, a))} != {sorted(map(str, b))}")
    for k in a:
        assert_same(a[k], b[k], f"{path}[{k!r}]")


def _assert_same_sequences(
    a: list[Any] | tuple[Any, ...], b: list[Any] | tuple[Any, ...], path: str
) -> None:
    """Same type (list or tuple), same length, and the same item at each position."""
    if type(a) is not type(b) or len(a) != len(b):
        raise AssertionError(
            f"{path}: {type(a).__name__}[{len(a)}] != {type(b).__name__}[{len(b)}]"
        )
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_same(x, y, f"{path}[{i}]")


def _both_nan(a: Any, b: Any) -> bool:
    """Both are float NaN (which compare unequal yet are the same output)."""
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


class _Cursor:
    """Pulls items one at a time from an iterator, or epoch after epoch from an iterable."""

    def __init__(self, obj: Any, max_epochs: int) -> None:
        self.obj = obj
        # __next__ alone marks a stream of items (some have no __iter__, so not an Iterator).
        self.is_iterator = hasattr(obj, "__next__")
        self.epochs_left = max_epochs
        self.it: Iterator[Any] | None = None

    def next(self) -> Any:
        if self.is_iterator:
            return next(self.obj)
        while True:
            if self.it is None:
                if self.epochs_left <= 0:
                    raise StopIteration
                self.epochs_left -= 1
                self.it = iter(self.obj)
            try:
                return next(self.it)
            except StopIteration:
                self.it = None


def _stateful(obj: Any) -> Stateful:
    if not isinstance(obj, Stateful):
        raise TypeError(
            f"{type(obj).__name__} is not Stateful: give it state_dict() and "
            "load_state_dict(state) (meshfeed.protocols.Stateful)"
        )
    return obj


def take(obj: Any, n: int, *, max_epochs: int = 1_000_000) -> list[Any]:
    """The next ``n`` items of ``obj`` (crossing epochs for iterables), fewer if it ends."""
    cursor = _Cursor(obj, max_epochs)
    out = []
    for _ in range(n):
        try:
            out.append(cursor.next())
        except StopIteration:
            break
    return out


def assert_resume_equivalence(
    factory: Callable[[], Any],
    *,
    num_items: int,
    max_epochs: int = 1_000_000,
    json_roundtrip: bool = True,
    every: int = 1,
    cleanup: Callable[[Any], None] | None = None,
    equal: Callable[[Any, Any, str], None] = assert_same,
) -> list[Any]:
    """Check that restoring from the state after item k reproduces items k+1 .. num_items.

    ``factory()`` must build a fresh, identically configured object each call. States are
    recorded after every ``every``-th item (and before the first); ``num_items`` should cross
    at least one epoch boundary. Returns the reference output so callers can make further
    assertions on it. Raises ``AssertionError`` naming the step where resumption diverged.
    """
    ref_obj = factory()
    cursor = _Cursor(ref_obj, max_epochs)
    reference: list[Any] = []
    states: list[tuple[int, dict[str, Any]]] = []
    try:
        for k in range(num_items + 1):
            if k % every == 0:
                state = dict(_stateful(ref_obj).state_dict())
                if json_roundtrip:
                    state = json.loads(json.dumps(state))
                states.append((k, state))
            if k == num_items:
                break
            try:
                reference.append(cursor.next())
            except StopIteration:
                break
    finally:
        if cleanup is not None:
            cleanup(ref_obj)
    total = len(reference)
    for k, state in states:
        if k > total:
            break
        obj = factory()
        try:
            _stateful(obj).load_state_dict(state)
            resumed = take(obj, total - k, max_epochs=max_epochs)
        finally:
            if cleanup is not None:
                cleanup(obj)
        if len(resumed) != total - k:
            raise AssertionError(
                f"resumed from the state after item {k}: got {len(resumed)} more items, "
                f"expected {total - k}"
            )
        for j, (want, got) in enumerate(zip(reference[k:], resumed, strict=True)):
            equal(want, got, f"resume@{k} item {k + j}")
    return reference


# ----------------------------------------------------------------- Ray sample-store diagnostics
# Tests look inside a Ray store's actor through its one ``inspect`` method; the functions run
# there (they must be importable: module-level functions of this module).


def _actor_values(actor: Any) -> list[Any]:
    """Every value the store's actor holds, cell by cell."""
    return [
        v for p in actor.core.partitions.values() for k in p.samples for v in p.cells(k).values()
    ]


def _actor_chunk_kinds(actor: Any) -> list[str]:
    from meshfeed.queue.engine.columns import Cell

    return sorted({type(v.chunk).__name__ for v in _actor_values(actor) if type(v) is Cell})


def _actor_held_types(actor: Any) -> list[str]:
    return sorted({type(v).__name__ for v in _actor_values(actor)})


def _actor_live_chunks(actor: Any) -> int:
    import gc

    gc.collect()
    return len(actor.plane.live)


def _actor_reinit(actor: Any, options: dict[str, Any]) -> None:
    from meshfeed.queue.engine.core import StoreCore, StoreOptions

    actor.core = StoreCore(StoreOptions.from_dict(options))
    actor.core.owning = False  # as the actor's own core (backends/ray.py)
    actor.waiters.wake_all()


def _inspect(store: Any, fn: Callable[..., Any], *args: Any) -> Any:
    backend = store._backend
    return backend._call(backend.actor.inspect.remote(fn, *args))


def store_chunk_kinds(store: Any) -> list[str]:
    """Type names of the chunks behind every cell a Ray store holds (``RemoteChunk``: the
    actor holds only a reference into the object store)."""
    return list(_inspect(store, _actor_chunk_kinds))


def store_held_types(store: Any) -> list[str]:
    """Type names of every value a Ray store holds (large payloads stay references)."""
    return list(_inspect(store, _actor_held_types))


def store_live_chunks(store: Any) -> int:
    """How many object-store chunks a Ray store's actor still references (a chunk's reference
    goes once no task can read it; Ray then frees the object)."""
    return int(_inspect(store, _actor_live_chunks))


def reset_store(store: Any, options: Any) -> Any:
    """A Ray store over the same actor, emptied and with ``options`` (a ``StoreOptions``):
    tests reuse one actor process instead of starting one per test."""
    from meshfeed.queue.store import SampleStore

    _inspect(store, _actor_reinit, options.to_dict())
    return SampleStore._attach("ray", store._backend, options)


def refresh_chunks(store: Any, refs: list[Any]) -> list[Any]:
    """The current references of the chunks a Ray store handed out as ``refs`` (those of a
    dead producer are adopted by the actor first)."""
    backend = store._backend
    return list(backend._call(backend.actor.refresh.remote(list(refs))))
