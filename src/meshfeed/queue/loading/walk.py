"""A store loader's walk: the shared loop of every door, from the first batch not returned.

The loop is ``DataLoader``'s: tasks (batch indices) -> the loader's service (in-process, one
thread ahead, or worker processes: :mod:`meshfeed.services`) running the
:class:`~meshfeed.queue.loading.fetch.StoreFetcher` -> each batch settled (``on_error``, and
the ranks' agreement on it) -> :mod:`meshfeed.delivery` (pinned / on the device, timed) ->
returned, counted as returned only then. What is particular to a store:

- The stream's end is found, not known: a request answers "ended" (``ids is None``); no later
  index is requested, and the requests in flight are drained (one may still hold a batch
  planned before the end).
- A walk's requests share one token: when the walk ends early (an error, ``shutdown()``), the
  requests still waiting in the store are cancelled and wake at once, consuming nothing. The
  store keeps the plan of every batch requested, so the next walk asks again from the first
  batch not returned and gets the same batches. Every walk cancels its token as it ends; the
  store issued it (``SampleStore.new_token``), so a request that comes later (a worker's task
  of the ended walk) is refused, yet the store keeps nothing of a walk that ended.
- A batch the loop could not return (``collate_fn`` kept failing, or another rank's part of
  the round did) is kept first in line (``loader._held``): the next walk collates it again, or
  returns it, without fetching it again.
- With a process group, the ranks agree once, at a loader's first ``next()``, where it starts
  and what it was built with (:meth:`Walking._agree_start`): its position comes from outside
  only then (a loaded state, a resize); later walks start where the per-batch agreement left
  every rank. A batch whose making raised on one rank is announced in that batch's agreement
  (:meth:`Walking._announced`): the others raise at once, naming that rank and its error.

:class:`Walking` is the part of a :class:`~meshfeed.queue.StoreLoader` that walks: its
position (returned, requested, granted), the versions its requests were granted with, and the
loop. The loader calls ``Walking._walk`` with a weak proxy of itself: the walk is held by the
loader (a store loader is its own iterator), and a strong reference back would make a cycle, so
a dropped loader would be shut down by the garbage collector at any moment (possibly inside the
store's lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import threading
import uuid
import weakref
from collections.abc import Generator, Hashable, Iterator
from typing import TYPE_CHECKING, Any

from meshfeed.delivery import Delivery
from meshfeed.dist import all_gather_objects, gather_agreement, is_distributed
from meshfeed.errors import CollectiveError, RankError
from meshfeed.lifecycle import now_or_later
from meshfeed.mesh import DataMesh, mesh_hash
from meshfeed.protocols import BoundedService
from meshfeed.queue.loading.errors import (
    CollateError,
    Failure,
    RankTimeoutError,
    SkipLog,
    round_failures,
)
from meshfeed.queue.loading.fetch import StoreEvents, StoreFetcher, StoreTask
from meshfeed.queue.loading.reach import LocalDoor
from meshfeed.queue.loading.versions import LoaderVersion
from meshfeed.services.distributed import check_walk_start
from meshfeed.telemetry import Telemetry

__all__ = ["SKIPPED", "Walking"]

Result = tuple[Any, StoreEvents]
#: What a batch dropped by ``on_error="skip"`` becomes on its way to the loop.
SKIPPED: Any = object()
#: The phases a batch's events carry (the fetcher's seconds), added whenever it is returned.
_FROM_EVENTS = ("fetch", "collate")
#: The start facts that say where a loader starts, on which mesh (:meth:`Walking._agree_start`).
_PLACE_FACTS = ("next", "requested", "data_world_size", "mesh")
#: What the other start facts are called in a refusal: the settings that decide which samples of
#: every round a rank takes, and when it sees the end.
_SETTINGS = {
    "batch_size": "batch_size",
    "batches_ahead": "batches kept ahead, from prefetch, num_workers or service, device or "
    "pin_memory and device_prefetch",
    "reads": "task, partition and fields",
    "sampler": "sampler",
    "group_filter": "group_filter",
    "on_error": "on_error",
    "max_staleness": "max_staleness",
}
#: A rank-aware sampler's own place on the mesh, which differs between ranks by design.
_OWN_PLACE = frozenset({"data_rank", "replica_rank"})


class Walking:
    """A store loader's position and loop (module docstring); the loader sets the fields
    declared here, :meth:`_start_walking` the rest."""

    store: Any
    service: BoundedService
    delivery: Delivery
    on_error: str
    wait_timeout: float
    task: str
    rank: int
    mesh: DataMesh
    data_world_size: int
    collate_retries: int
    fetcher: StoreFetcher
    _door: LocalDoor | None
    _walks: int
    _keeps: int
    telemetry: Telemetry
    _version: LoaderVersion
    _skips: SkipLog
    _counts: dict[str, int]
    _shut: bool

    if TYPE_CHECKING:  # LoaderBase's, which comes first in a loader's bases

        def _check_walk(self, walk: int) -> None: ...

        def _note_bad_samples(self, count: int, first: dict[str, Any] | None) -> None: ...

    def _start_walking(self) -> None:
        self._stream: Iterator[Any] | None = None  # the current walk
        # Its token (None: no walk yet) and halt.
        self._walking: tuple[Hashable | None, threading.Event] = (None, threading.Event())
        self._returned = 0  # the first batch index not returned (the state's ``next``)
        self._requested = 0  # the first batch index not requested
        self._granted = 0  # the first batch index not yet granted (the state's ``requested``)
        self._grants = threading.Condition()
        self._redeliver = 0  # batches below it were in flight when the loaded state was taken
        #: No state was loaded: the walk starts the task at batch 0, and the store refuses
        #: it where another loader read as this reader (``from_start``, ``loader``).
        self._from_start = True
        self._loader_id = uuid.uuid4().hex
        self._end_at: int | None = None  # the first index a request found ended
        #: The policy version each batch not yet returned was granted with: asked again (a
        #: retry, or a restored loader), it is asked with the same.
        self._asked: dict[int, int | None] = {}
        #: A batch the loop could not return, kept first in line: (made item or None, events).
        self._held: tuple[Any, StoreEvents] | None = None
        #: The phases taken back from a held batch ``on_step`` refused, by its index: added
        #: again when it is returned, since it is not made again (its making counts once).
        self._owed: tuple[int, dict[str, float]] | None = None
        #: The fetch and collate seconds of the batches skipped (``on_error="skip"``) since
        #: the last one returned: added with the next one returned.
        self._passed = (0.0, 0.0)
        #: Whether the last ``next()`` raised because ``on_step`` did (its batch not returned):
        #: not a wait for data (:meth:`meshfeed.telemetry.Telemetry.raised`).
        self._refused = False
        #: The current walk's thread, delivery stage and service map (:meth:`_walk`).
        self._stage: tuple[int, weakref.ref[Any], Iterator[Any]] | None = None
        #: Whether the ranks agreed where this loader starts (:meth:`_agree_start`).
        self._start_agreed = False

    def _agree_start(self) -> None:
        """Where a process group runs, check once, at this loader's first ``next()`` (built,
        loaded from a state, or resized), that every rank starts at the same batch with the
        same batches in flight (``next``, ``requested``) on the same mesh, built with the same
        settings (:meth:`_settings`): one all-gather of a few ints, the check ``DataLoader``
        makes at every walk start. Ranks that loaded different states (one stale), or built
        with another ``batch_size`` or sampler, would read other ranks' samples again, or skip
        some, or end at different steps; they raise ``ValueError`` on every rank instead. The
        facts are the same keys on every rank, whatever the loader's options. Later walks
        (after an error) start where the ranks' per-batch agreement left them."""
        if is_distributed():
            requested = max(self._granted, self._returned, self._redeliver)
            place = (self._returned, requested, self.data_world_size, mesh_hash(self.mesh))
            settings = self._settings()
            facts = dict(zip(_PLACE_FACTS, place, strict=True))
            facts.update({name: _fact(text) for name, text in settings.items()})
            columns = gather_agreement(facts, self.wait_timeout)
            where = {name: columns.pop(name) for name in _PLACE_FACTS}
            if len(set(where["mesh"])) == len(set(where["data_world_size"])) == 1:
                self._refuse_other_settings(columns, settings)  # another mesh: named below
            try:
                check_walk_start(where)
            except ValueError as exc:
                moved = len(set(where["next"])) > 1 or len(set(where["requested"])) > 1
                raise ValueError(
                    f"StoreLoader of task {self.task!r}: {exc}"
                    + (
                        ". A StoreLoader state's 'next' and 'requested' are the same on every "
                        "rank: load the one saved with the store's checkpoint on every rank"
                        if moved
                        else ""
                    )
                ) from None
        self._start_agreed = True

    def _settings(self) -> dict[str, str]:
        """What this loader was built with that decides which samples of every round it takes
        and at which step it sees the end, as text (:data:`_SETTINGS`); every rank's must be
        the same."""
        spec = self.fetcher.spec
        return {
            "batch_size": str(spec.batch_size),
            "batches_ahead": str(spec.window),
            "reads": f"task={spec.task!r} partition={spec.partition!r} fields={list(spec.fields)}",
            "sampler": _described(spec.sampler),
            "group_filter": _described(spec.group_filter),
            "on_error": repr(self.on_error),
            "max_staleness": repr(self._version.max_staleness),
        }

    def _refuse_other_settings(self, columns: dict[str, list[int]], mine: dict[str, str]) -> None:
        """``ValueError`` on every rank naming each setting the ranks differ in, with every
        rank's value: ``columns`` holds each rank's hash of them, the same table on every rank,
        so every rank gathers the values it names (one more collective) or none does."""
        differ = [name for name, column in columns.items() if len(set(column)) > 1]
        if not differ:
            return
        told = all_gather_objects([mine[name] for name in differ], timeout=self.wait_timeout)
        held = "; ".join(
            f"{_SETTINGS[name]} ("
            + ", ".join(f"rank {r} has {values[j]}" for r, values in enumerate(told))
            + ")"
            for j, name in enumerate(differ)
        )
        raise ValueError(
            f"StoreLoader of task {self.task!r}: the ranks' loaders were built with different "
            f"settings: {held}. A rank would take samples of a round that its peers take too, or "
            "that none takes, drop a batch its peers return, or end at another step. Build "
            "every rank's StoreLoader with the same batch_size, sampler, task, partition, "
            "fields, prefetch, num_workers (or service), device, pin_memory, device_prefetch, "
            "on_error, max_staleness and group_filter"
        )

    def _version_args(self, index: int) -> dict[str, Any]:
        """The keywords of batch ``index``'s request: its policy version (as first asked),
        this loader's id, and ``from_start`` for a loader that loaded no state."""
        args: dict[str, Any] = self._version.request()
        args["version"] = self._asked.setdefault(index, args["version"])
        args["loader"] = self._loader_id
        if self._from_start:
            args["from_start"] = True
        return args

    def _grant(self) -> None:
        """Let the walk request up to ``_keeps`` batches past the first not returned, each
        with the policy version of now. Called by the loop before each batch, so which batches
        are requested, and with which version, never depends on a thread's timing: the state
        names them, the same on every rank."""
        upto = self._returned + self._keeps
        if upto <= self._granted:
            return
        version = self._version.version
        for index in range(self._granted, upto):
            self._asked.setdefault(index, version)
        with self._grants:
            self._granted = upto
            self._grants.notify_all()

    def _granted_to(self, index: int, halt: threading.Event) -> bool:
        """Wait until batch ``index`` may be requested; False once the walk is halted."""
        if index < self._granted:  # nearly always: no lock
            return not halt.is_set()
        with self._grants:
            while index >= self._granted and not halt.is_set():
                self._grants.wait(0.1)
        return not halt.is_set()

    def _forget(self, index: int) -> None:
        """Batch ``index`` (and any before it) left the loader: forget its version."""
        asked = self._asked
        while asked and (first := next(iter(asked))) <= index:  # granted in index order
            asked.pop(first, None)

    def _walk(self) -> Generator[Any, None, None]:
        """The loader's batches from the first not returned (module docstring). Called on a
        weak proxy of the loader, so its generators hold no strong reference to it."""
        walk, store, start = self._walks, self.store, self._returned
        # Issued before shutdown() can see it: a token cancelled there is never accepted.
        token, halt = store.new_token(), threading.Event()
        self._walking = (token, halt)  # what shutdown() stops from any thread
        if self._shut:  # shut down (another thread) before this walk could be halted
            with contextlib.suppress(Exception):  # shutdown() may have seen the walk before
                store.cancel(token)
            return
        held, self._held = self._held, None
        first: list[Result] = []
        raw = None
        if held is not None and held[1].batch is not None:  # collate it again, in the service
            raw = held[1].batch
        elif held is not None:  # made already: returned first, agreed again by every rank
            first, start = [held], start + 1
        if self._door is not None:  # a batch collated again asks the store nothing
            self._door.open(token, start + (raw is not None))
        made: Iterator[Any] = self.service.map(Walking._tasks(self, start, token, raw, halt))
        results: Iterator[Result] = itertools.chain(first, made)
        delivered: Generator[Result, None, None]
        if self.delivery.ahead and is_distributed():
            # The ranks' agreements (collectives) on this thread, once per batch taken, never on
            # the delivery thread: it runs ahead by a number of batches that differs between
            # ranks when a walk ends, which left one rank in a collective its peers never made.
            delivered = Walking._settled(self, self.delivery.stage(results))
        else:
            delivered = self.delivery.stage(Walking._settled(self, results))
        # What a shutdown() from on_step (this thread, this walk suspended in it) closes.
        self._stage = (threading.get_ident(), weakref.ref(delivered), made)
        try:
            while True:
                self._grant()  # on the loop's thread, before each batch: the same on every rank
                try:
                    item, events = next(delivered)
                except StopIteration:
                    return
                before, self._returned = self._returned, events.index + 1
                if item is SKIPPED:  # dropped by on_error="skip": passed, not returned
                    # Its making counts with the next batch returned, as its wait does.
                    self.telemetry.passed()
                    fetched, collated = self._passed
                    self._passed = (fetched + events.fetch_s, collated + events.collate_s)
                    self._forget(events.index)
                    continue
                counts = dict(self._counts)
                self._counts["batches"] += 1
                self._counts["samples"] += len(events.ids or ())
                self._counts["redelivered"] += events.index < self._redeliver
                # The fetcher's seconds (a store's fetch includes waiting there for producers),
                # with those of the batches skipped since the last one returned.
                fetched, collated = self._passed
                fetched, collated = fetched + events.fetch_s, collated + events.collate_s
                self.telemetry.add("fetch", fetched)
                self.telemetry.add("collate", collated)
                try:
                    self.telemetry.returned()  # on_step, which sees this batch counted
                except BaseException:  # not returned: kept first in line for the next walk
                    self._returned, self._counts, self._held = before, counts, (item, events)
                    self._take_back(events.index, fetched, collated)  # counted when returned
                    self._refused = True
                    raise
                self._passed = (0.0, 0.0)
                if self._owed is not None and self._owed[0] == events.index:
                    owed, self._owed = self._owed[1], None
                    for phase, seconds in owed.items():
                        self.telemetry.add(phase, seconds)
                self._forget(events.index)
                yield item
                self._check_walk(walk)
        finally:
            # An early end: the requests still waiting wake now (the plans stay in the store).
            # Halted already: shutdown() cancelled them. Both wait for the store's lock and for
            # threads: where the cycle collector closes this walk, on the reaper thread.
            cancel = not halt.is_set()
            halt.set()
            now_or_later(Walking._end_walk, store if cancel else None, token, delivered, made)
            with contextlib.suppress(ReferenceError):  # the loader collected with this walk
                if self._stage is not None and self._stage[2] is made:
                    self._stage = None

    @staticmethod
    def _end_walk(
        store: Any, token: Any, delivered: Generator[Any, None, None], made: Iterator[Any]
    ) -> None:
        """A walk's end: its requests still waiting cancelled (``store`` None: they were),
        its stage closed."""
        if store is not None:
            with contextlib.suppress(Exception):  # the store may be gone (a killed Ray actor)
                store.cancel(token)
        Walking._close_stage(delivered, made)

    @staticmethod
    def _close_stage(delivered: Generator[Any, None, None], made: Iterator[Any]) -> None:
        """End a walk's delivery stage (its thread joined) and its service's map (a fetch
        thread joined): neither outlives the walk, nor a ``shutdown()`` from ``on_step``."""
        with contextlib.suppress(ValueError):  # running (on a thread that did not stop)
            delivered.close()
        if isinstance(made, Generator):
            with contextlib.suppress(ValueError):
                made.close()

    def _close_suspended_stage(self) -> None:
        """From ``on_step`` (this walk's thread, the walk suspended in it): close its stage
        now, so ``shutdown()`` returns with its threads gone (as ``DataLoader``'s)."""
        stage, self._stage = self._stage, None
        if stage is None or stage[0] != threading.get_ident():
            return
        delivered = stage[1]()
        if delivered is not None:
            Walking._close_stage(delivered, stage[2])

    def _take_back(self, index: int, fetched: float, collated: float) -> None:
        """Take back the phases of batch ``index``, refused by ``on_step`` (stats as before
        it), ``fetched`` and ``collated`` the fetch and collate seconds added for it. Kept,
        it is not made again: those the delivery stage timed at its first refusal are owed
        back; its fetch and collate seconds travel with it (its events) and are added again
        when it is returned."""
        phases = self.telemetry.phases
        before = dict(phases)
        self.telemetry.take_back(fetch=fetched, collate=collated)
        if self._owed is None or self._owed[0] != index:
            owed = {p: before[p] - phases[p] for p in phases if p not in _FROM_EVENTS}
            self._owed = (index, owed)

    def _tasks(
        self, start: int, token: Hashable, raw: Any, halt: threading.Event
    ) -> Iterator[StoreTask]:
        """Batch indices from ``start`` until the end is seen, each once the loop granted it
        (with the policy version it was granted with)."""
        index = start
        while self._end_at is None or index < self._end_at:
            if not self._granted_to(index, halt):
                return
            self._requested = max(self._requested, index + 1)
            batch = raw if index == start else None
            yield StoreTask.make(index, self._version_args(index), token, batch)
            index += 1

    def _settled(self, results: Iterator[Result]) -> Generator[Result, None, None]:
        """Each batch with ``on_error`` applied and, where a process group runs, agreed on."""
        agree = self.on_error == "raise" and is_distributed()
        end_agreed = not is_distributed()
        try:
            for item, events in Walking._announced(self, results):
                if events.ids is None:  # ended: later requests end too; the in-flight ones drain
                    if not end_agreed:
                        # The ranks agree on this index too: a peer whose part of it raised
                        # announces that in this index's agreement (_announced), which a rank
                        # that saw the end here must join, or the peer waits until timeout
                        # and its collective stays pending, paired with this rank's next one.
                        # The end is recorded only once agreed, so after a RankError the next
                        # walk asks for this index again and joins the peer's retry of it.
                        end_agreed = True
                        failures = round_failures(None, self.wait_timeout)
                        if any(failure.raised for failure in failures.values()):
                            raise self._rank_error(failures, events.index)
                    if self._end_at is None or events.index < self._end_at:
                        self._end_at = events.index
                    continue
                if self._end_at is not None and events.index > self._end_at:
                    self._end_at = None  # a batch after an "ended": ask on past it next time
                if self.on_error == "skip":
                    if self._skipped(item, events):
                        item = SKIPPED  # passed in order, so the loop counts it where it was
                elif events.error is not None or agree:
                    self._agreed(item, events, agree)
                yield item, events
        finally:
            if isinstance(results, Generator):
                results.close()

    def _announced(self, results: Iterator[Result]) -> Iterator[Result]:
        """``results``; where a process group runs (the ranks agree on every batch, whatever
        ``on_error`` says), a batch whose making raised on this rank (its store refused the
        request or its wait timed out, a worker died, a damaged file: any ``Exception``) is
        first announced in that batch's agreement, so the other ranks raise :class:`RankError`
        naming this rank and its error at the same batch (as ``DataLoader``'s
        ``fail_together``) instead of waiting for this one until ``timeout``. Not announced:
        a ``KeyboardInterrupt`` (the job is being stopped: this rank must not wait in a
        collective), what ``shutdown()`` made the walk raise, and a :class:`RankError` (a
        peer's failure, not this rank's)."""
        tell = is_distributed()
        while True:
            try:
                result = next(results)
            except StopIteration:
                return
            except Exception as error:
                if tell and not self._shut and not isinstance(error, RankError):
                    with contextlib.suppress(CollectiveError):  # a dead peer must not hide ours
                        round_failures(Failure.of(error, raised=True), self.wait_timeout)
                raise
            yield result

    def _skipped(self, item: Any, events: StoreEvents) -> bool:
        """``on_error="skip"``: whether the batch is dropped, agreed by every rank (a round one
        rank could not collate is dropped by all of them); counted and warned. A round whose
        making raised on another rank is not dropped: this rank keeps its part and raises
        (:meth:`_rank_error`), as that rank does, so every rank goes on from it."""
        error = events.error
        failures = round_failures(
            None if error is None else Failure.of(error, raised=False), self.wait_timeout
        )
        if not failures:
            return False
        if any(failure.raised for failure in failures.values()):
            self._held = (item, events)  # a batch that failed here is collated again
            raise self._rank_error(failures, events.index)
        ids = events.ids or []
        first = self._skips.record(events.index, ids, error, min(failures))
        self._note_bad_samples(len(ids), first)
        return True

    def _agreed(self, item: Any, events: StoreEvents, agree: bool) -> None:
        """``on_error="raise"``: a batch whose ``collate_fn`` kept failing raises
        :class:`CollateError`; with a process group every rank agrees on every batch (one
        ``all_reduce`` of one int), and the others raise :class:`RankError` at the same batch.
        Either way the batch stays first in line, so none waits in its next collective."""
        if events.error is not None:
            self._held = (None, events)
            if agree:
                with contextlib.suppress(CollectiveError):  # a dead peer must not hide ours
                    round_failures(Failure.of(events.error, raised=False), self.wait_timeout)
            raise self._collate_error(events)
        failures = round_failures(None, self.wait_timeout)
        if failures:
            self._held = (item, events)  # returned once the ranks go on
            raise self._rank_error(failures, events.index)

    def _rank_error(self, failures: dict[int, Failure], index: int) -> RankError:
        """What this rank raises when other ranks' parts of batch ``index`` failed: naming the
        lowest rank whose making raised (else the lowest that could not collate) and its
        error; a :class:`RankTimeoutError` (a ``TimeoutError``) when that was a timeout."""
        named = {r: f for r, f in failures.items() if f.raised} or failures
        rank = min(named)
        failure, others = named[rank], sorted(set(failures) - {rank})
        kind = RankTimeoutError if failure.timed_out else RankError
        return kind(
            f"rank {rank} {failure.describe()} at batch {index} of task {self.task!r} (this is "
            f"rank {self.rank})"
            + (f"; rank(s) {others} failed at it too" if others else "")
            + "; see that rank's error. Every rank stops here so that none waits in its next "
            "collective; this rank keeps its part of the batch, and the next next() goes on "
            "from it on every rank",
            rank=rank,
            step=index,
        )

    def _collate_error(self, events: StoreEvents) -> CollateError:
        ids = list(events.ids or [])
        shown = f"{ids[:20]} ... ({len(ids)} samples)" if len(ids) > 20 else f"{ids}"
        error = CollateError(
            f"collate_fn failed {self.collate_retries + 1} times on batch {events.index} of "
            f"task {self.task!r} (sample ids {shown}): {events.error!r}. The batch is kept: "
            "next() retries collate_fn on it and state_dict() records it, so a restored loader "
            "re-delivers it; fix collate_fn (or the samples) and call next() again",
            index=events.index,
            ids=ids,
        )
        error.__cause__ = events.error
        return error


def _fact(text: str) -> int:
    """A 63-bit hash of ``text``, the same in every process, for one int64 collective."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _described(value: Any) -> str:
    """``value`` as the ranks compare it: a dataclass (a sampler) by its type and fields, a
    rank-aware sampler's own place on the mesh left out; a plain value by its ``repr``; a
    function or any other object by its qualified name (never an address)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(
            f"{f.name}={_described(getattr(value, f.name))}"
            for f in dataclasses.fields(value)
            if f.name not in _OWN_PLACE
        )
        return f"{type(value).__qualname__}({fields})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_described(v) for v in value) + ")"
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    module = getattr(value, "__module__", None) or type(value).__module__
    return f"{module}.{name}"
