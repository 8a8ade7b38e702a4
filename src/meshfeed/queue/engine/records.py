"""The records a :class:`~meshfeed.queue.engine.core.StoreCore` keeps: options, samples, partitions.

Slotted containers with no behaviour beyond small accessors, shared by the core (which
changes them) and :mod:`meshfeed.queue.checkpoints.state` (which dumps and rebuilds them). A
partition maps each sample id to its :class:`Sample`, or to the :class:`Run` of the put that
made it (read through ``Partition.cells`` / ``Partition.sample``, never ``.fields`` values). A
:class:`Ref` marks a payload held elsewhere (Ray's object store): counted, never held.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshfeed.queue.engine.columns import Cell, Chunk, RemoteChunk, resolve
from meshfeed.queue.engine.ranges import Ranges, trim_head
from meshfeed.queue.engine.versions import Book
from meshfeed.queue.rounds import Progress, Round

Key = Hashable


@dataclass(eq=False, slots=True)
class Ref:
    """A payload kept outside the store (a Ray ``ObjectRef``) and its size in bytes."""

    ref: Any
    nbytes: int


SCALAR_TYPES = frozenset({int, float, bool, type(None)})


def nbytes_of(value: Any) -> int:
    """Payload bytes of one value (tensors, arrays, bytes, str); 8 for other objects."""
    if isinstance(value, Ref):
        return 0
    if isinstance(value, Cell):
        return 0 if type(value.chunk) is RemoteChunk else value.chunk.row_nbytes
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    return 8


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreOptions:
    """``capacity``: most samples held at once (``put`` waits beyond it); ``fields``: the
    allowed field names (``None``: any); ``tasks``: consuming tasks, a sample is dropped once
    all of them consumed it (``None``: keep until ``delete``/``clear``); ``lease_timeout``:
    seconds a consumer has to acknowledge a batch before its samples return to ready (see
    :mod:`meshfeed.queue.engine.leases`; ``None``, the default: no leases, a ``get`` consumes at once)."""

    capacity: int | None = None
    fields: tuple[str, ...] | None = None
    tasks: tuple[str, ...] | None = None
    lease_timeout: float | None = None

    def __post_init__(self) -> None:
        cap = self.capacity
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"capacity must be a positive number of samples or None (got {cap!r})")
        lt = self.lease_timeout
        if lt is not None and (
            isinstance(lt, bool) or not isinstance(lt, int | float) or not 0 < lt < math.inf
        ):
            raise ValueError(
                f"lease_timeout must be a positive, finite number of seconds or None (got "
                f"lease_timeout={lt!r}); use None for no leases"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "fields": None if self.fields is None else list(self.fields),
            "tasks": None if self.tasks is None else list(self.tasks),
            "lease_timeout": self.lease_timeout,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StoreOptions:
        f, t = d.get("fields"), d.get("tasks")
        return cls(
            capacity=d.get("capacity"),
            fields=None if f is None else tuple(f),
            tasks=None if t is None else tuple(t),
            lease_timeout=d.get("lease_timeout"),
        )


@dataclass(eq=False, slots=True)
class Sample:
    """One sample's fields (stored values: a :class:`Cell`, a :class:`Ref` or a plain value)."""

    group: Hashable | None
    fields: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    remote: int = 0

    def has(self, need: tuple[str, ...]) -> bool:
        fields = self.fields
        return all(f in fields for f in need)

    def cells(self, key: Key) -> dict[str, Any]:
        return self.fields


class Run:
    """The samples one put created, all at once: one record shared by all of them.

    A put of ``n`` new samples (no groups, every column a :class:`Chunk` or a list of
    scalars) stores this one object under each of its ids instead of ``n`` :class:`Sample`
    records with a :class:`Cell` per field, so the put, the readiness check, the consumption
    and the gather of a batch cost O(1) Python operations per run, not per sample. A sample
    that later changes (a field added by another put) is turned into
    a :class:`Sample` of its own first (:meth:`Partition.sample`); so a key stored with a run
    always has exactly the run's fields.

    Read by the per-sample code as a sample of its own: ``nbytes`` / ``remote`` / ``group``
    are per-row values, ``has(need)`` the readiness test, ``cells(key)`` the stored
    values of one sample. ``fields`` (the names, each with the value of the run's first row)
    is for introspection only; values come from :meth:`cells`.
    """

    __slots__ = ("columns", "first", "index", "names", "nbytes")

    group = None
    remote = 0

    def __init__(self, columns: dict[str, Any], ids: list[Key] | None, first: int) -> None:
        self.columns = columns  # field -> Chunk or list of scalars, one row per sample
        self.names = frozenset(columns)
        # Rows are ``key - first`` for consecutive int ids; else ``index[key]``.
        self.first = first
        self.index = None if ids is None else dict(zip(ids, range(len(ids)), strict=True))
        self.nbytes = sum(c.row_nbytes if type(c) is Chunk else 8 for c in columns.values())

    def row(self, key: Key) -> int:
        index = self.index
        return key - self.first if index is None else index[key]  # type: ignore[operator]

    def has(self, need: tuple[str, ...]) -> bool:
        return self.names.issuperset(need)

    def cells(self, key: Key) -> dict[str, Any]:
        row = self.row(key)
        return {f: Cell(c, row) if type(c) is Chunk else c[row] for f, c in self.columns.items()}

    @property
    def fields(self) -> dict[str, Any]:
        return self.cells(next(iter(self.index)) if self.index is not None else self.first)

    def sample(self, key: Key) -> Sample:
        """The sample ``key`` of this run as a record of its own."""
        return Sample(None, self.cells(key), self.nbytes)


@dataclass(eq=False, slots=True)
class Entry:
    """A plan shared by several readers (rank-aware / length-balanced samplers): its
    :class:`~meshfeed.queue.rounds.Round` (reader ``i`` of part ``p`` reads ``round[p]``).

    ``batch_size`` and ``agree`` (the request's ``agree=`` context, e.g. a loader's prefetch)
    are what the planner asked with; every reader must ask with the same (``None``: a plan
    restored from a checkpoint that did not record them, not checked). ``read``: the readers
    that read it.
    """

    round: Round
    fields: tuple[str, ...]
    readers: int
    batch_size: int | None = None
    agree: Any = None
    read: set[int] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class Partition:
    """One partition's samples and, per task, its pending and consumed samples.

    A task's ``pending`` (ordered) and ``consumed`` samples are kept per sample, or, while the
    partition's samples are all runs of consecutive int ids and the task was only consumed
    first-in first-out, as :class:`~meshfeed.queue.engine.ranges.Ranges` (O(runs)): the fast
    path reads those through :meth:`ranges` and :meth:`take`; :attr:`pending`,
    :attr:`consumed` and :meth:`task` give every other caller the per-sample form, made
    explicit (for good) on first use, so nothing else sees the encoding.
    """

    samples: dict[Key, Sample | Run] = field(default_factory=dict)
    _pending: dict[str, dict[Key, None] | Ranges] = field(default_factory=dict)
    _consumed: dict[str, set[Key] | Ranges] = field(default_factory=dict)
    _lazy: int = 0  # tasks kept as ranges
    # ``samples`` in order as the id ranges of runs of consecutive int ids, while that is
    # all they are (puts of fresh samples, FIFO removal); ``None`` from the first change
    # that is not (the store's :meth:`StoreCore._partition` starts it, a restore does not).
    spans: deque[range] | None = None
    cache: dict[tuple[Any, ...], Entry] = field(default_factory=dict)
    # Per (task, shared-key prefix): the highest batch index each reader asked for; a
    # plan is dropped once every reader asked past it (a retry before that re-reads it).
    asked: dict[tuple[Any, ...], dict[int, int]] = field(default_factory=dict)
    progress: dict[tuple[Any, ...], Progress] = field(default_factory=dict)  # derived from asked
    # Per task moved by replan: (the first batch moved, the new layout's key kind and
    # readers); a reader of another layout asking from there on is refused (plans.lookup).
    # Not checkpointed: it guards against live readers of the layout the move replaced.
    layouts: dict[str, tuple[int, Any, int]] = field(default_factory=dict)
    # Per (task, shared-key prefix, reader): the loader that reads as it (a request's
    # ``loader``); a loader starting from batch 0 is refused once another one read as it
    # (plans.lookup). Not checkpointed, like ``layouts``: ``asked`` covers a restored store.
    readers: dict[tuple[Any, ...], str] = field(default_factory=dict)
    _pinned: dict[Key, int] = field(default_factory=dict)
    _pin_runs: list[range] = field(default_factory=list)  # FIFO rounds' pins, until read per sample
    # Samples a loader fetched ahead but has not returned yet: kept even once consumed by
    # every task, so a checkpoint taken meanwhile can still re-deliver them.
    held: dict[Key, int] = field(default_factory=dict)
    leased: dict[Key, int] = field(default_factory=dict)  # samples under a lease (engine.leases)
    field_counts: dict[str, int] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # every field ever produced, even if evicted since
    closed: bool = False
    next_id: int = 0
    book: Book | None = None  # policy versions, made by the first versioned call

    def stats(self) -> dict[str, Any]:
        """What ``SampleStore.stats()["partitions"]`` says about this partition."""
        return {
            "samples": len(self.samples),
            "fields": dict(self.field_counts),
            "consumed": {
                t: c.done if type(c) is Ranges else len(c) for t, c in self._consumed.items()
            },
            "closed": self.closed,
            "cache_entries": len(self.cache),
        }

    @property
    def pending(self) -> dict[str, dict[Key, None]]:
        """Per task, its pending samples in production order (per sample: explicit)."""
        if self._lazy:
            self._explicit()
        return self._pending  # type: ignore[return-value]  # explicit now

    @property
    def consumed(self) -> dict[str, set[Key]]:
        """Per task, the samples it consumed that are still held (per sample: explicit)."""
        if self._lazy:
            self._explicit()
        return self._consumed  # type: ignore[return-value]  # explicit now

    @property
    def pinned(self) -> dict[Key, int]:
        """Samples of cached plans: how many plans name each (per sample: explicit)."""
        if self._pin_runs:
            runs, self._pin_runs = self._pin_runs, []
            for ids in runs:
                count_up(self._pinned, ids)
        return self._pinned

    def pin_range(self, ids: range) -> None:
        """One more plan names each of ``ids`` (O(1): counted per sample when first read)."""
        self._pin_runs.append(ids)

    def tasks(self) -> int:
        """How many tasks consumed from here (as kept: nothing is made explicit)."""
        return len(self._pending)

    def pending_count(self, task: str) -> int:
        """How many samples ``task`` has pending (0 for an unknown task)."""
        return len(self._pending.get(task, ()))

    def task(self, task: str) -> dict[Key, None]:
        """``task``'s pending samples, per sample (the task is made if new)."""
        if self.ranges(task) is not None:
            self._explicit(task)
        return self._pending[task]  # type: ignore[return-value]

    def ranges(self, task: str) -> Ranges | None:
        """``task``'s pending samples as ranges (the task is made if new), ``None`` when
        they are kept per sample."""
        pending = self._pending.get(task)
        if pending is None:
            if self.spans is None:
                pending = dict.fromkeys(self.samples)
                self._consumed[task] = set()
            else:
                pending = Ranges(list(self.spans))
                self._consumed[task] = pending
                self._lazy += 1
            self._pending[task] = pending
        return pending if type(pending) is Ranges else None

    def take(self, task: str, ids: list[Key] | range, *, keep: bool) -> None:
        """``task`` consumed ``ids`` (``keep``: remember them as consumed, else they are
        about to go): as ranges when they are the task's first pending ids (no Python per
        sample), else per sample."""
        lazy = self.ranges(task)
        if lazy is not None and type(ids) is range and lazy.take(ids, keep=keep):
            return
        pending = self.task(task)
        deque(map(pending.pop, ids), 0)  # C-level loops: no Python per sample
        if keep:
            self._consumed[task].update(ids)  # type: ignore[union-attr]

    def add_run(self, ids: list[Key], *, consecutive: bool) -> None:
        """Samples ``ids`` (new, one put) became pending for every task."""
        if not consecutive:
            self.not_runs()  # no task is kept as ranges from here on
            for pending in self._pending.values():
                pending.update(dict.fromkeys(ids))  # type: ignore[union-attr]
            return
        span = range(ids[0], ids[-1] + 1)  # type: ignore[call-overload, operator]
        if self.spans is not None and span:
            self.spans.append(span)  # one span per run: its fields are checked by its first id
        for pending in self._pending.values():
            if isinstance(pending, Ranges):
                pending.add(span)
            else:
                pending.update(dict.fromkeys(ids))

    def forget_spans(self, keys: list[Key] | range) -> None:
        """Samples ``keys`` leave the partition: the first ids of ``spans`` (a FIFO drop)
        keep the encoding, any other removal ends it (:meth:`not_runs`)."""
        spans = self.spans
        if spans is None:
            return
        fifo = type(keys) is range and bool(spans) and spans[0].start == keys.start
        if fifo and trim_head(spans, len(keys)) is not None:
            return
        self.not_runs()

    def not_runs(self) -> None:
        """The samples are no longer runs of consecutive ids only: every task is kept per
        sample from now on."""
        self.spans = None
        if self._lazy:
            self._explicit()

    def _explicit(self, task: str | None = None) -> None:
        """Keep ``task``'s (``None``: every task's) samples per sample from now on."""
        for t in list(self._pending) if task is None else [task]:
            lazy = self._pending[t]
            if type(lazy) is Ranges:
                self._pending[t] = lazy.pending_keys()
                self._consumed[t] = lazy.consumed_keys()
                self._lazy -= 1

    def shrink(self) -> None:
        """Free the tables of this partition's emptied per-sample containers: a Python dict
        or set keeps the table it grew to as its keys go (``pop``, ``difference_update``), so
        a drained partition would keep ~100 bytes per sample it ever held. ``clear()`` on an
        empty container frees its table and changes nothing else (same object, still empty),
        so this is safe at any time; the core calls it when eviction empties a closed
        partition (nothing can be put to it again, so the tables never regrow)."""
        book = self.book
        containers: list[Any] = [self.samples, self._pinned, self.held, self.leased, self.cache]
        containers += self._pending.values()
        containers += self._consumed.values()
        if book is not None:
            containers += [book.versions, book.group_of, book.members, *book.kept.values()]
        for c in containers:
            if not c and type(c) is not Ranges:
                c.clear()

    def sample(self, key: Key) -> Sample:
        """The record of ``key`` to change: a sample stored with its :class:`Run` gets a
        :class:`Sample` of its own first."""
        record = self.samples[key]
        if type(record) is Run:
            self.not_runs()  # the fast path reads a run's fields once, by its first id
            record = self.samples[key] = record.sample(key)
        return record  # type: ignore[return-value]

    def cells(self, key: Key) -> dict[str, Any]:
        """The stored values of sample ``key``, by field."""
        return self.samples[key].cells(key)


class View:
    """The samples of one partition ready for one task (every needed field present)."""

    __slots__ = ("_need", "_part", "_pending")

    def __init__(self, part: Partition, pending: dict[Key, None], need: tuple[str, ...]):
        self._part, self._pending, self._need = part, pending, need

    @property
    def closed(self) -> bool:
        return self._part.closed

    def ready(self) -> Iterator[Key]:
        samples, need = self._part.samples, self._need
        for key in self._pending:
            if samples[key].has(need):
                yield key

    def group(self, key: Key) -> Hashable | None:
        return self._part.samples[key].group

    def value(self, key: Key, field: str) -> Any:
        value = resolve(self._part.cells(key)[field])
        if isinstance(value, Ref):
            raise ValueError(
                f"field {field!r} of sample {key!r} is a large payload; a sampler can only "
                "read small fields (store token counts as ints)"
            )
        return value


def count_up(counts: dict[Key, int], ids: list[Key] | range) -> None:
    """Add one to the count of each of ``ids`` (a C-level pass when none is counted yet)."""
    if not counts or counts.keys().isdisjoint(ids):
        counts.update(dict.fromkeys(ids, 1))
    else:
        for k in ids:
            counts[k] = counts.get(k, 0) + 1


def count_down(counts: dict[Key, int], ids: list[Key]) -> None:
    """Take one off the count of each of ``ids`` (a key reaching 0 leaves ``counts``; keys
    not in it are ignored)."""
    for k in ids:
        n = counts.get(k, 0)
        if n > 1:
            counts[k] = n - 1
        elif n == 1:
            del counts[k]
