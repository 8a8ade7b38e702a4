"""StoreCore: the bookkeeping of the sample store, non-blocking and backend-free.

Both backends wrap one ``StoreCore``: the embedded store under a ``threading.Condition``, the
Ray actor under an ``asyncio.Condition``. Every ``try_*`` method either completes at once or
returns ``None`` ("not yet": wait for the next notification); nothing here blocks, sleeps or
knows about threads. Values are opaque; a :class:`Ref` marks a payload held elsewhere (Ray's
object store) so the store counts it but never holds its bytes.

Per partition the core keeps samples in production order, and per task an ordered ``pending``
set (not yet consumed), so a ``get`` scans only unconsumed samples. Around it: the records
(:mod:`~meshfeed.queue.engine.records`, which the checkpoint reads and rebuilds), puts
(:mod:`~meshfeed.queue.engine.puts`), shared plans (:mod:`~meshfeed.queue.engine.plans`), eviction
(:mod:`~meshfeed.queue.engine.eviction`) and the fast selection (:mod:`~meshfeed.queue.engine.fastpath`).

Cost: a put of ``n`` new samples whose columns are chunks or scalar lists is one
:class:`~meshfeed.queue.engine.records.Run` stored under its ``n`` ids, and the common get (a
``SequentialSampler``, or a rank-aware round over one, whose first pending samples are ready)
selects, consumes and pins a range of ids while the task is kept as ranges
(:mod:`~meshfeed.queue.engine.ranges`: O(runs), whatever the round's size), gathers a view per
contiguous block of a run (handed out as is for the rows' last read, else copied: the
reader's own, :func:`~meshfeed.queue.engine.columns.owned`), and evicts with C-level dict/set
passes over the ids. Everything
else (fields added to existing samples, groups, other samplers, holds, leases, eviction of a
task's samples) takes the per-sample path, which gives the same results.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from typing import Any

from meshfeed.queue.engine.admin import StoreAdmin
from meshfeed.queue.engine.columns import gather, gather_runs, owned
from meshfeed.queue.engine.dynamic import consumed, rejected
from meshfeed.queue.engine.eviction import evict, forget
from meshfeed.queue.engine.fastpath import select_fast
from meshfeed.queue.engine.leases import Lease, Leases
from meshfeed.queue.engine.plans import end_of_stream, lookup, read_shared, record
from meshfeed.queue.engine.puts import check_put, put_run, put_samples, run_columns
from meshfeed.queue.engine.records import (
    Entry,
    Partition,
    Ref,
    Run,
    StoreOptions,
    View,
    count_down,
    count_up,
    nbytes_of,
)
from meshfeed.queue.engine.stall import check_fits, round_size
from meshfeed.queue.engine.versions import Book, book_of
from meshfeed.queue.request import GetRequest, PutRequest
from meshfeed.queue.rounds import Round
from meshfeed.queue.samplers import Share

__all__ = [
    "KIND",
    "VERSION",
    "FieldsMissing",
    "PartitionClosed",
    "Ref",
    "StoreCore",
    "StoreOptions",
    "nbytes_of",
]

Key = Hashable
#: What :meth:`StoreCore.try_get` hands out: ids, rows, and the shared plan's parts (or None).
Taken = tuple[list[Key], dict[str, list[Any]], list[list[Key]] | None, list[int | None] | None]
KIND = "sample_store"  # the state envelope's kind
VERSION = 2  # 2: JSON metadata + weights-only tensors; acknowledged batch indices


class PartitionClosed(Exception):
    """``get`` on a closed partition with nothing left for the task: the stream has ended."""


class FieldsMissing(PartitionClosed):
    """A :class:`PartitionClosed` whose samples (some were put) have none of some field asked
    for (``missing``; ``produced``: the fields they have): nothing can ever be served, but not
    because the stream was drained (a misspelt field, or one no producer puts). ``get``
    callers see a ``PartitionClosed`` as before; a ``StoreLoader`` raises an error naming the
    fields instead of ending with no batch."""

    def __init__(self, message: str, missing: Any = (), produced: Any = ()) -> None:
        super().__init__(message)
        self.missing, self.produced = list(missing), list(produced)

    def __reduce__(self) -> Any:  # the fields survive pickling (Ray, worker processes)
        return FieldsMissing, (str(self), self.missing, self.produced)


class StoreCore(StoreAdmin):
    """All store state; see the module docstring. Not thread-safe: the backend locks it."""

    def __init__(self, options: StoreOptions) -> None:
        self.options = options
        self.partitions: dict[str, Partition] = {}
        self.held = 0
        #: Samples ever dropped (consumed by every task, deleted, cleared): a backend compares
        #: it before and after a call to know whether the call freed capacity, whatever other
        #: calls did to ``held`` meanwhile.
        self.dropped = 0
        self.produced = 0
        self.consumed_total: dict[str, int] = {}
        self.redelivered = 0  # samples handed out again to a retried request
        self.leases = Leases()
        self.lease_expired = 0  # samples returned to ready by an expired or dropped lease
        self.planned = 0  # shared plans made (a backend wakes the replica peers on a change)
        self.put_needs = 0  # new samples the last put refused for capacity needed
        #: Why the last put refused waits: the store's capacity, or admission (versions.py).
        self.put_waits_for = ""
        #: A stamp that changes whenever admission room may have been freed: one per sample
        #: consumed (delivered or stale), and one when a get that cannot plan a round finds
        #: a put refused for admission (it may be the put the get waits for: :meth:`try_get`).
        self.taken = 0
        self.admitting = False  # a versioned put may wait for admission (versions.py)
        #: Hand out rows the store keeps as the reader's own copies (columns.owned): the
        #: embedded backend, whose readers share this process's memory. The Ray actor's rows
        #: reach their reader as copies anyway, so it turns this off.
        self.owning = True

    # ----------------------------------------------------------------- producing
    def _partition(self, name: str) -> Partition:
        part = self.partitions.get(name)
        if part is None:
            part = self.partitions[name] = Partition()
            part.spans = deque()  # no samples yet: runs of consecutive ids only (ranges.py)
            for task in self.options.tasks or ():
                part.ranges(task)  # made as ranges (nothing pending yet)
        return part

    def try_put(self, request: PutRequest) -> list[Key] | None:
        """Store rows; ``None`` when the new samples do not fit under ``capacity`` yet, or
        a versioned put is not admitted yet (:mod:`meshfeed.queue.engine.versions`)."""
        partition, rows, ids, groups = request.partition, request.rows, request.ids, request.groups
        part = self._partition(partition)
        if part.closed:
            raise ValueError(
                f"partition {partition!r} is closed; no more puts are accepted (clear() it "
                "to reuse the name, or put to a new partition)"
            )
        n = len(next(iter(rows.values())))
        if ids is None:  # fresh ids are above every int id ever put: all new, nothing to check
            ids = list(range(part.next_id, part.next_id + n))
            n_new = n
        elif part.samples.keys().isdisjoint(ids):  # all new: nothing to check per sample
            n_new = n
        else:
            n_new = check_put(partition, part, rows, ids, groups)
        version = request.version
        book = part.book
        if version is not None:
            self.admitting = True
            book = book_of(part)
            if not book.admit(
                partition, part, request, ids, n_new, version, lambda t: self._ready(part, t)
            ):
                self.put_needs = n_new
                self.put_waits_for = _admission(partition, part, book)
                return None
        elif book is not None and groups is not None:  # no mixing in a versioned partition
            book.check_groups(partition, part.samples, request, ids, None)
        cap = self.options.capacity
        if cap is not None:
            if n_new > cap:
                raise ValueError(
                    f"a put of {n_new} new samples can never fit capacity={cap}; "
                    "put fewer samples at a time or raise the capacity"
                )
            if self.held + n_new > cap:
                self.put_needs = n_new
                self.put_waits_for = (
                    f"store at capacity {cap} ({self.held} held, the put needs {n_new} more)"
                )
                return None
        part.seen.update(rows)
        # One sample gains nothing from a run (and costs more to gather from a row of runs).
        if n_new == n > 1 and groups is None and run_columns(rows):
            put_run(part, rows, ids, n)
        else:
            put_samples(part, rows, ids, groups)
        self.held += n_new
        self.produced += n_new
        counts = part.field_counts
        for f in rows:  # each (sample, field) pair is new, checked above
            counts[f] = counts.get(f, 0) + n
        if book is not None and (version is not None or groups is not None):
            book.record(request, ids, version)
        return ids

    # ----------------------------------------------------------------- consuming
    def try_get(
        self, request: GetRequest, *, alive: Any = None, now: float | None = None
    ) -> Taken | None:
        """Plan and consume a batch; ``None`` when not enough samples are ready yet. The
        batch's ids and rows, and (``request.parts``) the parts of the shared plan it belongs
        to (``None`` without one, or not asked for): every reader's ids in part order (a
        rank-aware round: the data ranks' batches in data-rank order; one list shared by
        every reader of the round: read-only), so a loader's checkpoint can name the whole
        round; and the samples' versions (``None``: an unversioned partition).

        The request flows down once: overdue leases expire and the consumer's earlier
        leases are acknowledged, stale samples go (:meth:`_settle`); a shared plan already
        made for this request's key is read (replica peers, retries: :mod:`~meshfeed.queue.
        plans`); else the sampler plans a batch (:meth:`_plan`: a closed partition with
        nothing more for the task ends the stream, :class:`PartitionClosed`) and it is
        consumed (:meth:`_consume`). ``request.hold``: keep the returned samples until
        :meth:`release`. With ``options.lease_timeout`` set, a batch of a non-sharing sampler
        is handed out under ``request.lease`` of ``request.consumer``, expiring at ``now +
        lease_timeout`` (``alive``: the consumer's liveness probe, see
        :mod:`meshfeed.queue.engine.leases`). ``now``: the caller's ``time.monotonic()``.
        """
        part = self._partition(request.partition)
        now = time.monotonic() if now is None else now
        self._settle(part, request, now)
        share = request.sampler.share(request.sampler_context())
        if share is not None:
            entry, freed = lookup(part, request, share)
            self._evict(part, freed)
            if entry is not None:
                return self._read_plan(part, request, share, entry)
        plan = self._plan(part, request, share)
        if plan is None:
            book = part.book
            if book is not None and book.refused:  # a put waits for admission: it may be
                book.refused = False  # the one this get waits for (a round not ready): wake
                self.taken += 1  # it to ask again, with this get's request (versions.py)
            return None
        return self._consume(part, request, share, plan, alive, now)

    def _ready(self, part: Partition, task: str) -> bool:
        """Whether ``task``'s last get could plan a round of its pending samples now, as
        :meth:`_plan` would (admission: a put waits only while one is ready for the task);
        ``True`` when not known (no get since the book was made or loaded)."""
        book = part.book
        request = None if book is None else book.asks.get(task)
        if request is None:
            return True
        try:
            parts = _select(part, request, request.need)
        except Exception:  # the get reports it; admission counts as if a round were ready
            return True
        return parts is not None and any(parts)

    def versioned(self, partition: str) -> bool:
        """Whether ``partition`` has policy versions (its puts may wait for admission)."""
        part = self.partitions.get(partition)
        return part is not None and part.book is not None

    def _settle(self, part: Partition, request: GetRequest, now: float) -> None:
        """Before planning: overdue leases expire and a get of ``consumer`` acknowledges its
        earlier batches of the same task and partition; with a trainer ``version``, the
        task's samples older than ``request.max_staleness`` allows are consumed (undelivered,
        counted: :mod:`meshfeed.queue.engine.versions`)."""
        if self.leases:
            self.expire_leases(now)
            if request.consumer is not None:
                mine = self.leases.of_consumer(request.consumer, request.task, request.partition)
                for old in mine:
                    self._end_lease(old.id)
        if request.version is not None:
            book = book_of(part)
            book.observe(request, round_size(request.sampler, request.batch_size), request.version)
            task = request.task
            stale = book.stale_keys(part.task(task), request)
            if stale:
                book.stale[task] = book.stale.get(task, 0) + len(stale)
                self._unserved(part, task, stale)

    def _unserved(self, part: Partition, task: str, keys: list[Key]) -> None:
        """Consume ``keys`` for ``task`` without delivering them (stale, or filtered)."""
        consumed(part, task, keys)
        if keys:
            deque(map(part.pending[task].pop, keys), 0)
            part.consumed[task].update(keys)
            self.consumed_total[task] = self.consumed_total.get(task, 0) + len(keys)
            self.taken += len(keys)
            self._evict(part, keys)

    def _read_plan(self, part: Partition, request: GetRequest, share: Share, entry: Entry) -> Taken:
        """A replica peer reading the shared plan, or a retry of the same batch index
        (idempotent: the same batch again, never the next one)."""
        ids = list(filter(part.samples.__contains__, entry.round[share.part]))
        versions = _vs(part, ids, request.version_of)  # before the last reader's read evicts
        rows = self._rows(part, ids, request.fields)
        again, freed = read_shared(part, request, share, entry)
        if again:
            self.redelivered += len(ids)
        elif request.hold:
            count_up(part.held, ids)
        self._evict(part, freed)
        rows = self._handed(part, ids, rows)
        return ids, rows, entry.round.lists() if request.parts else None, versions

    def _plan(self, part: Partition, request: GetRequest, share: Share | None) -> Round | None:
        """The sampler's batch (as a round of parts), ``None`` to wait; at the end of the
        stream (a closed partition with nothing more for the task) :class:`PartitionClosed`."""
        need = request.need
        if part.closed:
            missing = [f for f in need if f not in part.seen]
            if missing:  # nothing more can ever become ready: the stream has ended
                produced = sorted(part.seen)
                why = (
                    f"partition {request.partition!r} is closed and no sample of it has "
                    f"field(s) {missing} (fields produced: {produced}); the stream "
                    "has ended (check the field names if you expected data)"
                )
                # Nothing put at all: an empty stream, which ends; else the fields are wrong.
                ended = FieldsMissing(why, missing, produced) if produced else PartitionClosed(why)
                self._end(part, request, share, ended)
        task = request.task
        if request.group_filter is not None:
            self._unserved(part, task, rejected(part, request, part.task(task)))
        parts = _select(part, request, need)
        if parts is None or not any(parts):
            if part.closed:
                self._end(
                    part,
                    request,
                    share,
                    PartitionClosed(
                        f"partition {request.partition!r} is closed and drained for "
                        f"{request.task!r}"
                    ),
                )
            if self.options.capacity is not None:  # about to wait: one that never fits
                pins = share is not None and bool(self.options.tasks)  # plans pin: plans.record
                check_fits(
                    self.options,
                    request.sampler,
                    request.batch_size,
                    request.prefetch if pins else None,
                )
            return None
        return Round.of(parts)

    def _end(
        self, part: Partition, request: GetRequest, share: Share | None, error: PartitionClosed
    ) -> None:
        """The stream has ended for this reader: it acknowledges every plan, then raises
        ``error``."""
        if share is not None:
            self._evict(part, end_of_stream(part, request.task, share, request.prefetch))
        raise error

    def _consume(
        self,
        part: Partition,
        request: GetRequest,
        share: Share | None,
        plan: Round,
        alive: Any,
        now: float,
    ) -> Taken:
        """Mark the planned samples consumed for the task, record a shared plan, and hand
        out this reader's part (held and leased as the request says)."""
        task = request.task
        every = plan.ids
        drop = share is None and not request.hold and self._sole_reader(part, task)
        part.take(task, every, keep=not drop)
        consumed(part, task, every)  # they leave the task's kept groups
        self.consumed_total[task] = self.consumed_total.get(task, 0) + len(every)
        self.taken += len(every)
        if share is not None:
            record(part, request, share, plan, evicting=bool(self.options.tasks))
            self.planned += 1
        ids = (
            list(plan.ids)  # a FIFO round's ids are a range (ranges.py)
            if share is None and len(plan) == 1
            else plan[0 if share is None else share.part]
        )
        rows = self._rows(part, ids, request.fields)
        if request.hold:
            count_up(part.held, ids)
        if self.options.lease_timeout is not None and share is None:
            self._lease(part, request, ids, alive, now)
        versions = _vs(part, ids, request.version_of)  # before they go
        if drop:  # fast path: nothing else keeps them, so they go without eviction checks
            self._dropped(forget(part, every), part)
        else:
            if share is None:  # a plan's samples stay pinned until the plan goes
                self._evict(part, every)
            rows = self._handed(part, ids, rows)
        parts = plan.lists() if share is not None and request.parts else None
        return ids, rows, parts, versions

    def _sole_reader(self, part: Partition, task: str) -> bool:
        """Whether ``task`` is the only one to consume and nothing keeps a consumed sample
        (no plan, hold or lease): then consumed samples can go at once."""
        return (
            self.options.lease_timeout is None
            and self.options.tasks == (task,)
            and part.tasks() == 1
            and not part.cache
            and not part.held
            and not part.leased
        )

    def _lease(
        self, part: Partition, request: GetRequest, ids: list[Key], alive: Any, now: float
    ) -> None:
        timeout = self.options.lease_timeout
        assert timeout is not None
        r, lease = request, request.lease
        if lease is None:
            raise ValueError(
                "this store has lease_timeout set, so every get needs a lease id; use "
                "SampleStore.get, which makes one"
            )
        self.leases.add(Lease(lease, r.partition, r.task, ids, r.consumer, now + timeout, alive))
        count_up(part.leased, ids)

    # ----------------------------------------------------------------- leases
    def ack(self, lease_id: str) -> None:
        """The consumer processed the batch of ``lease_id``: its samples stay consumed."""
        if self._end_lease(lease_id) is None:
            raise ValueError(
                f"lease {lease_id!r} is not outstanding: acknowledged already, or it expired "
                f"after lease_timeout={self.options.lease_timeout}s and its samples returned to "
                "ready (they may have been delivered again); acknowledge each batch once, "
                "before the timeout, or raise lease_timeout"
            )

    def _end_lease(self, lease_id: str) -> Lease | None:
        lease = self.leases.pop(lease_id)
        if lease is None:
            return None
        part = self.partitions.get(lease.partition)
        if part is not None:
            count_down(part.leased, lease.ids)
            self._evict(part, lease.ids)
        return lease

    def expire_leases(self, now: float) -> int:
        """Return the samples of leases past their deadline to ready; how many samples."""
        return sum(self._return(lease) for lease in self.leases.expired(now))

    def drop_consumer(self, consumer: Hashable) -> int:
        """``consumer`` is known dead: its leases return to ready now; how many samples."""
        return self.drop_leases([lease.id for lease in self.leases.of_consumer(consumer)])

    def drop_leases(self, lease_ids: list[str]) -> int:
        """Return these leases (their consumer is gone) to ready; how many samples."""
        leases = map(self.leases.pop, lease_ids)
        return sum(self._return(lease) for lease in leases if lease is not None)

    def next_lease_deadline(self) -> float | None:
        return self.leases.next_deadline()

    def _return(self, lease: Lease) -> int:
        """Make a removed lease's samples ready again for its task, in production order."""
        part = self.partitions.get(lease.partition)
        if part is None:
            return 0
        count_down(part.leased, lease.ids)
        consumed = part.consumed.get(lease.task, set())
        back = {k for k in lease.ids if k in part.samples and k in consumed}
        if not back:
            return 0
        consumed -= back
        pending = part.pending[lease.task]
        part.pending[lease.task] = {k: None for k in part.samples if k in pending or k in back}
        self.consumed_total[lease.task] = self.consumed_total.get(lease.task, 0) - len(back)
        self.lease_expired += len(back)
        return len(back)

    def stats_cache_entries(self) -> int:
        return sum(len(p.cache) for p in self.partitions.values())

    def _handed(self, part: Partition, ids: list[Key], rows: dict[str, Any]) -> dict[str, Any]:
        """``rows`` as a reader gets them: its own copies while the store still keeps any of
        ``ids`` (another task, a plan, a hold or a lease may read them again; see
        :func:`~meshfeed.queue.engine.columns.owned`), else as gathered (views for the rows'
        last read)."""
        if self.owning and any(map(part.samples.__contains__, ids)):
            return owned(rows)
        return rows

    @staticmethod
    def _rows(part: Partition, ids: list[Key], fields: tuple[str, ...]) -> dict[str, Any]:
        records = list(map(part.samples.__getitem__, ids))
        if records and type(records[0]) is Run:
            rows = gather_runs(records, ids, fields)
            if rows is not None:
                return rows
        cells = [r.cells(k) for r, k in zip(records, ids, strict=True)]
        return {f: gather([c[f] for c in cells]) for f in fields}

    def release(self, partition: str, ids: list[Key]) -> None:
        """Undo one ``hold`` of each of ``ids`` (unknown ids are ignored) and evict."""
        part = self.partitions.get(partition)
        if part is None:
            return
        count_down(part.held, ids)
        self._evict(part, ids)

    def peek(
        self, partition: str, ids: list[Key], fields: tuple[str, ...]
    ) -> tuple[list[Key], dict[str, list[Any]], list[int | None] | None]:
        """The ``fields`` of samples ``ids`` without consuming them (re-delivery on resume)."""
        part = self.partitions.get(partition)
        missing = [k for k in ids if part is None or k not in part.samples]
        if part is None or missing:
            raise ValueError(
                f"partition {partition!r} no longer holds samples {missing[:10]} a loader "
                "checkpoint names as fetched but not returned; restore the store saved with "
                "that loader state (SampleStore.load)"
            )
        rows = self._rows(part, list(ids), fields)
        return list(ids), owned(rows) if self.owning else rows, _vs(part, list(ids))

    def _evict(self, part: Partition, keys: list[Key]) -> None:
        if keys:
            self._dropped(evict(part, keys, self.options.tasks), part)

    def _dropped(self, n: int, part: Partition | None = None) -> None:
        """``n`` samples left the store (of ``part``: a closed partition left empty frees
        its emptied tables, :meth:`Partition.shrink`, so drained partitions stay small)."""
        self.held -= n
        self.dropped += n
        if n and part is not None and part.closed and not part.samples:
            part.shrink()


def _select(part: Partition, request: GetRequest, need: tuple[str, ...]) -> Any:
    """The sampler's parts for ``request`` (whose samples need fields ``need``) from its
    task's pending samples (the fast selection where it applies, else the sampler's own),
    ``None`` or empty parts to wait."""
    task = request.task
    lazy = part.ranges(task)
    parts = select_fast(part, part.task(task) if lazy is None else lazy, request, need)
    if isinstance(parts, bool):
        parts = request.sampler.select(View(part, part.task(task), need), request.batch_size)
    return parts


def _admission(partition: str, part: Partition, book: Book) -> str:
    """Why a versioned put waits for admission (the tasks whose bound it would pass)."""
    full = []
    for task, (v, s, size) in book.trainers.items():
        ahead = part.pending_count(task)
        if s is not None and ahead >= (s + 1) * size:
            full.append(
                f"task {task!r} (version {v}, max_staleness={s}, {size} per get) has {ahead} "
                f"samples unconsumed, (max_staleness + 1) * {size} or more, and a round of "
                "them ready"
            )
    return (
        f"waiting for admission of a versioned put to {partition!r}: {'; '.join(full)}; it "
        "lands once the trainer takes a round (a get of the task)"
    )


def _vs(part: Partition, ids: list[Key], version_of: str = "oldest") -> list[int | None] | None:
    """The versions of a batch's samples, or ``None`` in a partition with no versions."""
    book = part.book
    return None if book is None or not book.versions else book.of(ids, version_of)
