"""Test helpers every stateful part of meshfeed goes through.

:func:`assert_resume_equivalence` is the checkpoint-equivalence harness: run a fresh object for
``num_items`` items (it must serve them all), record its state after every item and after every
epoch it finished (each state must survive a JSON round trip and stay small), then for every
recorded state restore a fresh object, check that its state reads back as loaded, and that it
serves exactly the rest of the run: the same items, ending where the reference ended; restored
from a state taken between epochs, its first epoch is the whole next one.

It speaks the one state protocol, :class:`meshfeed.protocols.Stateful` (``state_dict()`` /
``load_state_dict(state)``); an object without it is refused with ``TypeError``.
Objects that are iterables but not iterators (a DataLoader) are iterated epoch after epoch:
when one epoch ends the harness calls ``iter()`` again, so runs cross epoch boundaries; an
iterator that serves more after ``StopIteration`` (a ``Delivered`` over a loader) is read on
the same way.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshfeed.protocols import Stateful

__all__ = ["MAX_STATE_BYTES", "assert_resume_equivalence", "assert_same", "take"]


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


class _Run:
    """The items of ``obj`` epoch after epoch, as a training loop takes them (the harness's).

    An iterable's epoch is one ``iter()``; an iterator's lasts until ``StopIteration``, and the
    next ``next()`` starts its next one (a :class:`~meshfeed.delivered.Delivered` over a loader
    reads on; an exhausted iterator raises again: an empty epoch). The run ends after
    ``max_epochs`` epochs, or after two empty epochs in a row (one empty epoch is no end: the
    rest of an epoch whose last item a state was taken after). ``on_epoch_end(count)`` runs
    after each epoch with the items it gave, before the next one starts."""

    def __init__(
        self, obj: Any, max_epochs: int, on_epoch_end: Callable[[int], None] | None = None
    ) -> None:
        self.obj = obj
        self.is_iterator = hasattr(obj, "__next__")
        self.epochs_left = max_epochs
        self.on_epoch_end = on_epoch_end
        self.epoch: Iterator[Any] | None = None
        self.count = 0  # items of the current epoch
        self.empty = 0  # empty epochs in a row

    def epochs_ahead(self) -> int:
        """How many epochs this run may still read, the one in progress included."""
        return self.epochs_left + (self.epoch is not None)

    def next(self) -> Any:
        while True:
            if self.epoch is None:
                if self.epochs_left <= 0 or self.empty >= 2:
                    raise StopIteration
                self.epochs_left -= 1
                self.epoch = self.obj if self.is_iterator else iter(self.obj)
                self.count = 0
            try:
                item = next(self.epoch)
            except StopIteration:
                self.epoch = None
                self.empty = 0 if self.count else self.empty + 1
                if self.on_epoch_end is not None:
                    self.on_epoch_end(self.count)
                continue
            self.count += 1
            return item

    def take(self, n: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < n:
            try:
                out.append(self.next())
            except StopIteration:
                break
        return out


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


#: ``assert_resume_equivalence``'s default bound on one state, JSON-encoded: a state is a
#: position and a few facts (a loader's is a few hundred bytes), never a record of the data.
MAX_STATE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class _Recorded:
    """A state of the reference run: after item ``k`` (at an epoch's end when ``epoch_end`` is
    not None: the epochs served so far), with the epochs a resumed run may still read."""

    k: int
    state: dict[str, Any]
    epochs_ahead: int
    epoch_end: int | None = None


class _Harness:
    """One :func:`assert_resume_equivalence` (its arguments, and every object it builds)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        json_roundtrip: bool,
        max_state_bytes: int | None,
        check_loaded_state: bool,
        cleanup: Callable[[Any], None] | None,
        equal: Callable[[Any, Any, str], None],
    ) -> None:
        self.factory = factory
        self.json_roundtrip = json_roundtrip
        self.max_state_bytes = max_state_bytes
        self.check_loaded_state = check_loaded_state
        self.cleanup = cleanup
        self.equal = equal
        self.first: Any = None  # the reference object (the one kept alive throughout)
        self.last: Any = None  # the object built last

    def build(self) -> Any:
        """A fresh object from ``factory()``; one it returned before is refused."""
        obj = self.factory()
        if obj is self.first or obj is self.last:
            raise AssertionError(
                f"factory() returned the same {type(obj).__name__} object again: it must build "
                "a fresh, identically configured one each call (the harness restores a fresh "
                "object from every state and compares it with the reference run)"
            )
        if self.first is None:
            self.first = obj
        self.last = obj
        return obj

    def done(self, obj: Any) -> None:
        if self.cleanup is not None:
            self.cleanup(obj)

    def state(self, obj: Any, where: str) -> dict[str, Any]:
        """``obj``'s state (through JSON unless told not), checked against ``max_state_bytes``."""
        state = dict(_stateful(obj).state_dict())
        if self.json_roundtrip:
            text = json.dumps(state)
            size = len(text.encode())
            state = json.loads(text)
        else:
            try:  # measured pickled, where it pickles
                size = len(pickle.dumps(state)) if self.max_state_bytes is not None else 0
            except (pickle.PicklingError, TypeError, AttributeError):
                size = 0
        if self.max_state_bytes is not None and size > self.max_state_bytes:
            raise AssertionError(
                f"the state {where} is {size} bytes, over max_state_bytes="
                f"{self.max_state_bytes}: a state should name a position, not record the data "
                "served (or raise max_state_bytes if this part's state is honestly that large)"
            )
        return state

    def restored(self, recorded: _Recorded, where: str) -> Any:
        """A fresh object loaded with ``recorded.state``, whose state reads back the same."""
        obj = self.build()
        _stateful(obj).load_state_dict(recorded.state)
        if self.check_loaded_state:
            back = dict(_stateful(obj).state_dict())
            if self.json_roundtrip:
                back = json.loads(json.dumps(back))
            try:
                assert_same(back, recorded.state, "state")
            except AssertionError as exc:
                raise AssertionError(
                    f"{where}: state_dict() right after load_state_dict(state) is not that "
                    f"state ({exc}); pass check_loaded_state=False only if this part "
                    "normalises a loaded state on purpose"
                ) from None
        return obj


def assert_resume_equivalence(
    factory: Callable[[], Any],
    *,
    num_items: int,
    max_epochs: int = 1_000_000,
    json_roundtrip: bool = True,
    every: int = 1,
    cleanup: Callable[[Any], None] | None = None,
    equal: Callable[[Any, Any, str], None] = assert_same,
    max_state_bytes: int | None = MAX_STATE_BYTES,
    check_loaded_state: bool = True,
    epoch_ends: bool = True,
) -> list[Any]:
    """Check that restoring from the state after item k reproduces items k+1 .. num_items.

    ``factory()`` must build a fresh, identically configured object each call (one it returned
    before is refused). The reference run must serve ``num_items`` items (else it fails, saying
    how many it served: lower ``num_items``, or raise ``max_epochs``); it reads one more, to
    know whether it ends there. States are recorded after every ``every``-th item (and before
    the first); ``num_items`` should cross at least one epoch boundary. For every recorded
    state a fresh object is restored from it and must serve exactly the rest of the reference
    run: the same items, and no more where the reference ended (its last epoch, or
    ``max_epochs``, counted from the epoch the state was taken in).

    An epoch is one ``iter()`` of an iterable, and for an iterator its items up to
    ``StopIteration`` (the next ``next()`` starts its next one, if it has one); two empty
    epochs in a row end a run. With ``epoch_ends`` (default), the state is also taken after
    each epoch that served items, before the next one starts, as a training loop checkpoints
    between epochs: a fresh object restored from it must serve exactly the reference's next
    epoch in its first one (not an empty one, nor a shorter one).

    Every state must survive a JSON round trip (unless ``json_roundtrip=False``) and be at most
    ``max_state_bytes`` long, JSON-encoded (pickled without the round trip, where it pickles;
    None: no bound).
    After ``load_state_dict(state)``, ``state_dict()`` must return ``state`` before any item is
    taken (``check_loaded_state=False`` where a part normalises a loaded state on purpose).
    ``cleanup(obj)`` runs on every object built; ``equal(want, got, where)`` compares items.
    Returns the reference output (``num_items`` items) so callers can make further assertions
    on it. Raises ``AssertionError`` naming the step where resumption diverged.
    """
    harness = _Harness(
        factory,
        json_roundtrip=json_roundtrip,
        max_state_bytes=max_state_bytes,
        check_loaded_state=check_loaded_state,
        cleanup=cleanup,
        equal=equal,
    )
    seen: list[Any] = []  # the reference, with the one item past num_items if there is one
    states: list[_Recorded] = []
    ends: list[int] = []  # after how many items each epoch of the reference ended
    ref_obj = harness.build()

    def epoch_end(count: int) -> None:
        ends.append(len(seen))
        if epoch_ends and count and run.epochs_left > 0:  # the reference reads another epoch
            where = f"at the end of epoch {len(ends) - 1} (after item {len(seen)})"
            state = harness.state(ref_obj, where)
            states.append(_Recorded(len(seen), state, run.epochs_left, len(ends)))

    run = _Run(ref_obj, max_epochs, epoch_end)
    try:
        states.append(_Recorded(0, harness.state(ref_obj, "before item 0"), max_epochs))
        while len(seen) <= num_items:
            try:
                seen.append(run.next())
            except StopIteration:
                break
            k = len(seen)
            if k <= num_items and k % every == 0:
                state = harness.state(ref_obj, f"after item {k}")
                states.append(_Recorded(k, state, run.epochs_ahead()))
    finally:
        run.on_epoch_end = None  # no cycle keeps the reference object alive once this returns
        harness.done(ref_obj)
    if len(seen) < num_items:
        served = f"the reference run served {len(seen)} of num_items={num_items} items"
        if run.empty < 2:  # cut by max_epochs
            raise AssertionError(
                f"{served} in max_epochs={max_epochs} epochs: lower num_items to {len(seen)} "
                "or raise max_epochs"
            )
        raise AssertionError(
            f"{served}: it ended after {len(ends) - run.empty} epoch(s), so raising max_epochs "
            f"gives no more; lower num_items to {len(seen)}, all it serves"
            + ("" if seen else " (it serves nothing: check what factory() builds)")
        )
    ended = len(seen) == num_items  # else the item past num_items came: it goes on
    for recorded in states:
        if recorded.epoch_end is None:
            _check_rest(harness, recorded, seen, ended)
        else:
            _check_next_epoch(harness, recorded, seen, ends)
    return seen[:num_items]


def _check_rest(harness: _Harness, recorded: _Recorded, seen: list[Any], ended: bool) -> None:
    """Restored from the state after item k, a fresh object serves the rest of the reference,
    and ends where it ended."""
    k = recorded.k
    where = f"resume@{k}"
    obj = harness.restored(recorded, where)
    try:
        resumed = _Run(obj, recorded.epochs_ahead).take(len(seen) - k + ended)
    finally:
        harness.done(obj)
    want = len(seen) - k
    if len(resumed) != want:
        more = "went on past where the reference ended" if len(resumed) > want else "ended early"
        raise AssertionError(
            f"resumed from the state after item {k}: it {more} ({len(resumed)} more items, "
            f"expected {want})"
        )
    for j, (a, b) in enumerate(zip(seen[k:], resumed, strict=True)):
        harness.equal(a, b, f"{where} item {k + j}")


def _check_next_epoch(
    harness: _Harness, recorded: _Recorded, seen: list[Any], ends: list[int]
) -> None:
    """Restored from the state taken between two epochs, a fresh object's first epoch is the
    reference's next one: the same items, ending where it ended (when the reference saw it end)."""
    k, epoch = recorded.k, recorded.epoch_end
    assert epoch is not None
    closed = epoch < len(ends)  # the reference saw that next epoch end
    want = seen[k : ends[epoch]] if closed else seen[k:]
    where = f"resume@end of epoch {epoch - 1}"
    obj = harness.restored(recorded, where)
    try:
        it = obj if hasattr(obj, "__next__") else iter(obj)
        got: list[Any] = []
        while len(got) < len(want) + closed:
            try:
                got.append(next(it))
            except StopIteration:
                break
    finally:
        harness.done(obj)
    if len(got) != len(want):
        raise AssertionError(
            f"resumed from the state taken after epoch {epoch - 1} ended (after item {k}), the "
            f"next epoch served {len(got)} items{' or more' if len(got) > len(want) else ''}; "
            f"the uninterrupted run's next epoch served {len(want)}"
            + ("" if closed else " before num_items was reached")
        )
    for j, (a, b) in enumerate(zip(want, got, strict=True)):
        harness.equal(a, b, f"{where} item {k + j}")


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
