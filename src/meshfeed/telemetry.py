"""Stall telemetry: how long the training loop waited for each batch, and where time went.

Every loader keeps one :class:`Telemetry` (``loader.stats()["delivery"]``). Per step it records
the loop's *wait* (the time ``next(loader)`` took: zero when the batch was ready) in a bounded
log-scale histogram (mean, p50, p99 without keeping a list), the *step* (time between two
batches returned: the loop's own work plus the wait), and the seconds spent in each *phase* of
making batches: ``plan`` (the batch plan), ``produce`` (waiting for the service: in-process this
is fetch + collate, with workers the wait for their transfer), ``fetch`` and ``collate`` (the
fetcher's own seconds reading and collating, wherever it ran: with workers, summed over them,
so they may add up to more than the wall time; a store loader's ``fetch`` includes the time its
requests waited in the store for producers), ``pin`` (copying into page-locked memory),
``device_copy`` (issuing the copy to the device). Every phase but ``plan`` is added when the
batch is counted as returned: a batch made and dropped uncounted (prefetched by a walk that was
superseded) adds nothing, and a loader that makes a batch again after its ``on_step`` raised
takes back its phases (:meth:`Telemetry.take_back`, see below), so that batch counts once.
``wait_share`` is the share of the wall time since the first batch was asked for that the loop
spent waiting. A walk's first wait includes what the loader did before its delivery stage ran
(starting workers, the ranks' agreement, draining batches an earlier walk left in flight:
:meth:`Telemetry.asked`).

The wait quantiles (p50, p99) come from log-scale buckets :data:`BUCKET_WIDTH` (4.9 %) wide:
``quantile(q)`` is the upper edge of the bucket holding the ``ceil(q * n)``-th smallest of the
``n`` waits, so it is never below that wait and at most 4.9 % above it (waits of 100 ns or less
report 0; a wait beyond 1000 s reports the last bucket's edge, about 1049 s).

``on_step`` (a loader option) is called after every batch with a :class:`StepTiming`, for
dashboards (Prometheus, OpenTelemetry, a logger): keep it cheap, it runs on the loop's thread.
It runs once the loader counts the batch as returned (its ``position`` and ``state_dict()``
include it, so a checkpoint taken there resumes after it), just before the batch reaches the
loop. A batch is timed in two calls: the delivery stage hands it on (:meth:`Telemetry.took`),
then the loader counts it (:meth:`Telemetry.returned`), where the step is recorded and
``on_step`` called. If ``on_step`` raises, the batch is not returned: the step is not recorded
here, the loader takes back its count (state and stats as before the batch, its phases too:
:meth:`Telemetry.take_back`) and raises the error in place of the batch, so nothing is skipped:
the loader serves that batch again next.
A batch the loader drops without returning it (a store batch skipped by ``on_error="skip"``)
adds its wait and its phases to the next batch's (:meth:`Telemetry.passed`). A store loader's
``next()`` that raised while the loop waited for data (a ``TimeoutError`` while the producers
are late, a ``CollateError``) adds its time to the wait of the next batch returned
(:meth:`Telemetry.raised`); the other loaders leave such time out (a walk that raised is over,
and the next starts its own wait).
Every :data:`WARN_AFTER` steps, a loop that has waited more than ``warn_wait_share`` of its
time so far (the first step's wait, start-up, left out), while doing at least
:data:`MIN_LOOP_SECONDS` of its own work per step, gets a warning (once per loader) on the
``"meshfeed"`` logger naming the likely fix (:data:`WAIT_HINT`), or the loader's own hint (a
store loader's names its producers: workers would not shorten a wait for rollouts).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUCKET_WIDTH",
    "MIN_LOOP_SECONDS",
    "PHASES",
    "WAIT_HINT",
    "WARN_AFTER",
    "StepTiming",
    "Telemetry",
    "WaitHistogram",
]

logger = logging.getLogger("meshfeed")

#: The phases of making a batch whose seconds ``stats()["delivery"]["phases"]`` adds up.
PHASES = ("plan", "produce", "fetch", "collate", "pin", "device_copy")
#: Steps before the wait share is judged (the first batches include starting the workers).
WARN_AFTER = 50
#: The loop's own time per step (between batches) below which it is not judged: a loop that
#: only collects batches (``list(loader)``) is not a training loop waiting for data.
MIN_LOOP_SECONDS = 1e-4
#: What the wait warning names by default (a loader that makes its own batches): the fix.
WAIT_HINT = (
    "likely fix: more workers (num_workers), less work per sample (or a faster collate_fn), or "
    "device= to copy batches ahead; see loader.stats()['delivery']"
)
#: Buckets per decade of the wait histogram: each is 10 ** (1 / 48) - 1 = 4.9 % wide.
_PER_DECADE = 48
#: How much wider than its lower edge a bucket's upper edge is: the quantiles' largest error.
BUCKET_WIDTH = 10 ** (1 / _PER_DECADE) - 1
_LOW, _DECADES = 1e-7, 10  # 100 ns to 1000 s
_LAST = _PER_DECADE * _DECADES + 1  # the last bucket: everything beyond 1000 s
#: The phases a delivery stage measures per batch (:meth:`Telemetry.took`'s ``made``).
_MADE = ("produce", "pin", "device_copy")
#: A batch handed on: (asked, handed on, produce seconds on the loop's thread, ``made``).
_Pending = tuple[float, float, float, tuple[float, float, float] | None]


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One step as ``on_step`` sees it: ``wait_s`` the loop waited for this batch, ``step_s``
    since the previous batch was returned (None for the first), ``steps`` returned so far."""

    steps: int
    wait_s: float
    step_s: float | None


class WaitHistogram:
    """Seconds in log-scale buckets (:data:`BUCKET_WIDTH`, 4.9 % wide): bounded memory;
    a quantile is at least the true one and at most 4.9 % above it (module docstring)."""

    def __init__(self) -> None:
        self.counts = [0] * (_LAST + 1)
        self.count = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        bucket = 0 if seconds <= _LOW else 1 + int(math.log10(seconds / _LOW) * _PER_DECADE)
        self.counts[min(bucket, _LAST)] += 1

    def quantile(self, q: float) -> float:
        """The upper edge of the bucket holding the ``ceil(q * count)``-th smallest value (0
        when nothing was added): in ``[v, v * (1 + BUCKET_WIDTH)]`` for that value ``v``
        between 100 ns and 1000 s."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count - 1e-9))  # ceil, not thrown by q's rounding
        seen = 0
        for bucket, n in enumerate(self.counts):
            seen += n
            if n and seen >= rank:
                return 0.0 if bucket == 0 else _LOW * 10 ** (bucket / _PER_DECADE)
        return _LOW * 10**_DECADES

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


class Telemetry:
    """The per-loader record (module docstring); ``name`` appears in the warning."""

    def __init__(
        self,
        name: str,
        *,
        warn_wait_share: float | None = 0.25,
        on_step: Callable[[StepTiming], Any] | None = None,
        hint: str = WAIT_HINT,
    ) -> None:
        self.name = name
        self.warn_wait_share = warn_wait_share
        self.on_step = on_step
        #: What the warning says after the share: the likely cause or fix, for this loader
        #: (a loader may set its own after it is built, e.g. a store's producers).
        self.hint = hint
        self.waits = WaitHistogram()
        self.phases = dict.fromkeys(PHASES, 0.0)
        self._first_ask: float | None = None
        self._last_return: float | None = None
        #: The batch handed on and not yet counted: (asked, handed on, the loop's produce
        #: seconds, the ``made`` seconds from elsewhere) (see :meth:`took`).
        self._pending: _Pending | None = None
        #: The same of the batch counted last (what :meth:`take_back` takes back).
        self._counted: _Pending | None = None
        #: The batches passed (dropped, not returned) since the last one handed on, as
        #: :attr:`_pending`: their making goes to the next batch handed on (:meth:`passed`).
        self._carried: _Pending | None = None
        #: Seconds the loop waited in ``next()`` calls that raised since the last batch
        #: counted: added to the next batch's wait (:meth:`raised`).
        self._raised = 0.0
        self._warned = False
        self._first_wait = 0.0  # the first step's wait: start-up, left out of the warning

    def add(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` to ``phase`` (one of :data:`PHASES`; any thread)."""
        self.phases[phase] += seconds

    def asked(self, at: float) -> None:
        """The loop asked for a batch at ``at`` (``time.perf_counter()``), and the loader works
        before its delivery stage times anything (a walk's first batch: starting workers, the
        ranks' agreement, draining what an earlier walk left in flight): the wait of the next
        batch counted starts at ``at`` (plus what :meth:`raised` added). A batch handed on and
        never counted (its walk was superseded) is forgotten: neither its wait nor its phases
        count (those of batches :meth:`passed` still go to the next batch)."""
        self._pending = (at, at, 0.0, None)

    def passed(self) -> None:
        """The loader dropped the batch handed on last without returning it (a store batch
        skipped by ``on_error="skip"``): its wait and its ``produce`` / ``pin`` /
        ``device_copy`` seconds go to the next batch handed on, and are counted with it. On
        the loop's thread."""
        self._carried = self._pending

    def raised(self, seconds: float) -> None:
        """A ``next()`` of the loader raised after ``seconds`` (a store's ``TimeoutError``
        while its producers are late): the loop waited for data that long, so it is added to
        the wait of the next batch counted (a loader calls it for errors of making batches,
        not for an ``on_step`` that raised). On the loop's thread."""
        self._raised += seconds

    def took(
        self,
        asked: float,
        now: float,
        *,
        produced: bool = False,
        made: tuple[float, float, float] | None = None,
    ) -> None:
        """The delivery stage handed on a batch asked for at ``asked`` at ``now``
        (``time.perf_counter()``); ``produced``: the loop's thread made it meanwhile (its wait is
        the ``produce`` phase); ``made``: the ``produce``, ``pin`` and ``device_copy`` seconds
        spent on it elsewhere (the delivery thread). The step is recorded, and these phases
        added, when the loader counts the batch (:meth:`returned`); until then a later batch's
        wait starts at this ``asked`` (a batch dropped uncounted adds its wait to the next
        one's, and its phases too once the loader says it :meth:`passed` it)."""
        pending = self._pending
        first = asked if pending is None else pending[0]
        if produced:
            self._pending = (first, now, now - asked, None)
        else:
            self._pending = (first, now, 0.0, made)
        carried = self._carried
        if carried is not None:  # batches passed since the last one counted (:meth:`passed`)
            self._carried = None
            self._pending = (first, now, self._pending[2] + carried[2], _plus(made, carried[3]))

    def returned(self) -> None:
        """The loader counted the batch handed on last as returned: record its step and its
        phases, and call ``on_step``. If ``on_step`` raises, the step is taken back (the loader
        does not count the batch either; a loader that makes the batch again takes back its
        phases too, :meth:`take_back`) and the error propagates (module docstring).

        One call per step, kept small: it runs on the loop's thread for every batch."""
        pending, self._pending = self._pending, None
        if pending is None:  # nothing handed on (a door that times nothing)
            return
        self._counted = pending
        asked, now, produce, made = pending
        raised = self._raised
        if raised:  # the loop waited in next() calls that raised before this batch came
            asked -= raised
        phases = self.phases
        phases["produce"] += produce
        if made is not None:
            phases["produce"] += made[0]
            phases["pin"] += made[1]
            phases["device_copy"] += made[2]
        wait = now - asked
        first, last = self._first_ask, self._last_return
        self._last_return = now
        if last is None:
            self._first_ask, self._first_wait = asked, wait
        waits = self.waits
        waits.count += 1
        waits.total += wait
        bucket = 0 if wait <= _LOW else 1 + int(math.log10(wait / _LOW) * _PER_DECADE)
        bucket = bucket if bucket < _LAST else _LAST
        waits.counts[bucket] += 1
        if self.on_step is not None:
            try:
                self.on_step(StepTiming(waits.count, wait, None if last is None else now - last))
            except BaseException:
                waits.count -= 1
                waits.total -= wait
                waits.counts[bucket] -= 1
                self._first_ask, self._last_return = first, last
                raise
        if raised:
            self._raised = 0.0
        if not waits.count % WARN_AFTER and not self._warned:
            self._judge()

    def take_back(self, *, fetch: float = 0.0, collate: float = 0.0) -> None:
        """Take back the phases of the batch counted last, which the loader did not return
        (its ``on_step`` raised) and makes again: what :meth:`returned` added, and the
        ``fetch`` and ``collate`` seconds the loader added for it. On the loop's thread."""
        phases = self.phases
        phases["fetch"] -= fetch
        phases["collate"] -= collate
        counted, self._counted = self._counted, None
        if counted is None:
            return
        phases["produce"] -= counted[2]
        made = counted[3]
        if made is not None:
            for phase, seconds in zip(_MADE, made, strict=True):
                phases[phase] -= seconds

    def wait_share(self) -> float:
        """Share of the wall time since the first ask that the loop spent waiting."""
        if self._first_ask is None or self._last_return is None:
            return 0.0
        return _share(self.waits.total, self._last_return - self._first_ask)

    def _judge(self) -> None:
        limit = self.warn_wait_share
        if limit is None:
            self._warned = True  # never: stop asking
            return
        # The steps after the first: its wait is start-up (workers, agreement), which more
        # workers would not shorten
        first = self._first_wait
        wall = (self._last_return or 0.0) - (self._first_ask or 0.0) - first
        waited = self.waits.total - first
        share = _share(waited, wall)
        # Only a loop that works between batches: list(loader) or a benchmark that only
        # iterates waits for every batch by design, and is not told to add workers.
        if share <= limit or (wall - waited) / self.waits.count < MIN_LOOP_SECONDS:
            return
        self._warned = True
        logger.warning(
            "%s: the training loop waited %.0f%% of its time for data over %d steps after the "
            "first (more than warn_wait_share=%.2f); %s",
            self.name,
            100 * share,
            self.waits.count,
            limit,
            self.hint,
        )

    def report(self) -> dict[str, Any]:
        """The JSON-able summary ``stats()["delivery"]`` shows (seconds)."""
        waits = self.waits
        return {
            "steps": waits.count,
            "wait_mean_s": waits.mean(),
            "wait_p50_s": waits.quantile(0.5),
            "wait_p99_s": waits.quantile(0.99),
            "wait_total_s": waits.total,
            "wait_share": self.wait_share(),
            "phases": dict(self.phases),
        }


def _plus(
    a: tuple[float, float, float] | None, b: tuple[float, float, float] | None
) -> tuple[float, float, float] | None:
    """The ``made`` seconds of two batches together (None: neither was made elsewhere)."""
    if a is None or b is None:
        return b if a is None else a
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _share(waited: float, wall: float) -> float:
    """The share of ``wall`` seconds spent waiting ``waited`` of them (0 without wall time)."""
    return min(1.0, waited / wall) if wall > 0 else 0.0
