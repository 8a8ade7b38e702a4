"""The loader's order over a :class:`~meshfeed.sources.mixture.Mixture` and the facts it
records in a loader checkpoint.

A :class:`MixtureOrder` maps loader epoch positions to concatenated indices of the mixture (the
``k``-th draw of a source reads its own reshuffled epoch, or the source's own order), notes how
far it planned so a ``reweight`` before that is refused or re-planned, and describes / validates
the per-source consumption and the weight schedule that a resume needs (see the mixture module's
docstring for the stream and its +-1 promise).
"""

from __future__ import annotations

import contextvars
import json
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from meshfeed.order.interleave import Interleave
from meshfeed.order.permutation import derive_seed, derive_seeds, permute_many
from meshfeed.protocols import OrderBase
from meshfeed.state import envelope, open_envelope

__all__ = ["ORDER_VERSION", "MixtureOrder"]

_MIX_OP = 0x4D49
#: Set while a mixture makes the orders of its sources: a nested mixture's draws are counted in
#: its own draws, not in global batches, so its epoch need not be a multiple of one.
_NESTED: contextvars.ContextVar[bool] = contextvars.ContextVar("meshfeed_nested", default=False)
#: Version of the facts a MixtureOrder records in a loader checkpoint (2: exact interleave;
#: 3: counts at each weight change, for the sequential earliest-deadline interleave).
ORDER_VERSION = 3


def _is_schedule_change(change: Any, num_sources: int) -> bool:
    """``change`` is ``[step, [one weight per source]]`` with an int step."""
    return (
        isinstance(change, list)
        and len(change) == 2
        and isinstance(change[0], int)
        and isinstance(change[1], list)
        and len(change[1]) == num_sources
    )


def _is_schedule(schedule: Any, num_sources: int) -> bool:
    """``schedule`` is a non-empty list of changes (see :func:`_is_schedule_change`) whose
    first is at step 0."""
    if not isinstance(schedule, list) or not schedule:
        return False
    if not all(_is_schedule_change(c, num_sources) for c in schedule):
        return False
    return bool(schedule[0][0] == 0)


def _schedules_disagree(ours: list[Any], done: list[Any], future_mine: list[Any]) -> bool:
    """This mixture's changes up to the checkpoint's position (``ours``) contradict the
    checkpoint's (``done``): they are not its prefix, or the checkpoint has changes there that
    this mixture lacks while it declares changes of its own after the position."""
    if ours != done[: len(ours)]:
        return True
    return len(ours) < len(done) and bool(future_mine)


def _carried_counts_fit(
    g: int, consumed: Mapping[str, Any], bases: list[Any], names: list[str], *, num_segments: int
) -> bool:
    """A checkpoint's counts have the right shape: a non-negative position, one int per
    source consumed, and one list of an int per source at each segment start, the first all 0.
    """
    if g < 0 or sorted(consumed) != sorted(names) or len(bases) != num_segments:
        return False
    if not all(isinstance(b, list) and len(b) == len(names) for b in bases):
        return False
    counts = [*consumed.values(), *(x for b in bases for x in b)]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in counts):
        return False
    return not any(bases[0])


class _Mixed(Protocol):
    """What a :class:`MixtureOrder` reads of its :class:`~meshfeed.sources.mixture.Mixture`
    (named here so that this module need not import the mixture, which builds its orders)."""

    names: list[str]
    sources: list[Any]
    lengths: np.ndarray
    offsets: np.ndarray
    seed: int
    samples_per_epoch: int | None
    _segments: list[Interleave]

    def __len__(self) -> int: ...
    def _add(self, step: int, weights: Mapping[str, float]) -> None: ...
    def _drop_changes_from(self, count: int) -> None: ...
    def schedule_json(self) -> list[list[Any]]: ...
    def _segment_starts(self, G: int) -> np.ndarray: ...
    def _bases(self, G: int) -> np.ndarray: ...
    def _ordered_sources(self) -> dict[int, Any]: ...
    def draws(
        self, positions: np.ndarray, *, global_batch_size: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]: ...
    def counts(self, position: int, *, global_batch_size: int | None = None) -> dict[str, int]: ...


class MixtureOrder(OrderBase):
    """The loader's order over a :class:`Mixture`: stream positions -> concatenated indices.

    It owns the loader-specific state: the global batch size that places weight changes in the
    stream, and ``planned_until``, the stream position up to which it has served indices (a
    ``reweight`` before it is refused).
    """

    def __init__(self, mixture: _Mixed, *, global_batch_size: int, seed: int) -> None:
        self.mixture = mixture
        self.G = int(global_batch_size)
        self.seed = int(seed)
        self.planned_until = 0
        self.returned_until = 0  # stream position of the last batch the loader returned
        self._replanned_from: int | None = None
        #: Called after the mixture's weight schedule changed (a curriculum's gates re-plan).
        self._on_change: list[weakref.WeakMethod[Any]] = []
        spe = mixture.samples_per_epoch
        if spe is None:
            spe = max(self.G, len(mixture) // self.G * self.G)
        elif spe % self.G and not _NESTED.get():
            # A partial last batch would drop draws from a source's pass (drop_last) and put
            # weight changes, placed at step * global batch, off the loader's steps.
            lower, upper = spe // self.G * self.G, -(-spe // self.G) * self.G
            raise ValueError(
                f"Mixture(samples_per_epoch={spe}) is not a multiple of the global batch size "
                f"{self.G}, so an epoch would end inside a batch; use "
                + (f"{lower} or {upper}" if lower else f"{upper}")
            )
        self.samples_per_epoch = int(spe)
        # A source with an order of its own (a ShardedStream) is walked by it: its k-th draw is
        # position k of that order, so a stream keeps reading locally inside a mixture.
        nesting = _NESTED.set(True)
        try:
            self._own: dict[int, Any] = {
                s: src.make_order(
                    dataset_length=int(mixture.lengths[s]),
                    global_batch_size=self.G,
                    seed=derive_seed(_MIX_OP, mixture.seed, self.seed, s),
                    shuffle=True,
                )
                for s, src in mixture._ordered_sources().items()
            }
        finally:
            _NESTED.reset(nesting)
        for s, order in self._own.items():
            if isinstance(order, MixtureOrder):
                order._nest(mixture.names[s])
        #: Set on a mixture nested as a source of another: its weights are fixed.
        self.nested_in: str | None = None

    def _nest(self, name: str) -> None:
        """This order walks a mixture that is source ``name`` of another mixture: its ``k``-th
        draw is that source's ``k``-th. A weight change is in global steps of the loader, which
        this order does not see, so the nested mixture's weights must be constant."""
        if len(self.mixture.schedule_json()) > 1:
            raise ValueError(
                f"source {name!r} is a Mixture with a weight schedule "
                f"{self.mixture.schedule_json()}; nested in another mixture its changes cannot "
                "be placed at global steps. Give it constant weights, or flatten the two into "
                "one Mixture (weights multiplied) with the schedule"
            )
        self.nested_in = name

    def check_reweight(self, step: int) -> None:
        """Refuse a weight change at ``step`` if the loader returned batches past it; else
        note it, so the loader re-plans what it planned or prefetched from there."""
        if self.nested_in is not None:
            raise ValueError(
                f"this mixture is source {self.nested_in!r} of another mixture a loader walks; "
                "its weights are fixed there. Flatten the two into one Mixture (weights "
                "multiplied) and reweight that one"
            )
        g = step * self.G
        if g < self.returned_until:
            raise ValueError(
                f"reweight(step={step}) would change stream positions from {g} on, but the "
                f"loader already returned batches up to stream position {self.returned_until} "
                f"(step {-(-self.returned_until // self.G)}) to the training loop; reweight a "
                "step not yet returned"
            )
        self.replan_from(g)

    def replan_from(self, g: int) -> None:
        """Have the loader re-plan what it planned or prefetched from stream position ``g``."""
        if g < self.planned_until:
            self._replanned_from = (
                g if self._replanned_from is None else min(self._replanned_from, g)
            )

    def on_schedule_change(self, method: Any) -> None:
        """Call the bound ``method`` after each change of the mixture's weight schedule
        (``reweight``, or one adopted from a checkpoint); held weakly."""
        self._on_change.append(weakref.WeakMethod(method))

    def schedule_changed(self) -> None:
        """The mixture's weight schedule changed: tell those that asked."""
        for ref in list(self._on_change):
            method = ref()
            if method is not None:
                method()

    def returned(self, epoch: int, position: int) -> None:
        self.returned_until = max(self.returned_until, epoch * self.samples_per_epoch + position)

    def replanned(self, epoch: int) -> int | None:
        if self._replanned_from is None:
            return None
        changed, self._replanned_from = self._replanned_from, None
        self.planned_until = min(self.planned_until, changed)
        return max(0, changed - epoch * self.samples_per_epoch)

    def epoch_length(self, epoch: int) -> int:
        return self.samples_per_epoch

    def draws(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` of epoch positions: the k-th draw of that source."""
        g = epoch * self.samples_per_epoch + np.asarray(positions, dtype=np.int64)
        if g.size:
            self.planned_until = max(self.planned_until, int(g.max()) + 1)
        return self.mixture.draws(g, global_batch_size=self.G)

    def source_indices(self, src: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Concatenated indices of the ``k``-th draws of sources ``src`` (per-source reshuffle)."""
        lengths = self.mixture.lengths.copy()
        for s, order in self._own.items():
            lengths[s] = order.epoch_length(0)
        src_epoch, within = np.divmod(k, lengths[src])
        out = np.empty(src.shape, dtype=np.int64)
        shuffled = np.ones(src.shape, dtype=bool)  # drawn from the mixture's own shuffle
        own = np.isin(src, list(self._own)) if self._own else ~shuffled
        for s, e in set(zip(src[own].tolist(), src_epoch[own].tolist(), strict=True)):
            where = (src == s) & (src_epoch == e)
            walk = self._own[s].indices(e, within[where])
            if walk is not None:
                out[where] = walk + self.mixture.offsets[s]
                shuffled[where] = False
        # every other draw from its source's permutation for that source epoch, all sources in
        # one vectorised pass (the same values as Permutation, one per (source, epoch): a
        # batch of a 10,000-source mixture touches thousands of them, #32)
        draws = src[shuffled]
        seeds = derive_seeds(_MIX_OP, self.mixture.seed, self.seed, draws, src_epoch[shuffled])
        walk = permute_many(self.mixture.lengths[draws], seeds, within[shuffled])
        out[shuffled] = walk + self.mixture.offsets[draws]
        return out

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        src, k = self.draws(epoch, positions)
        return self.source_indices(src, k)

    def describe(self, epoch: int, position: int) -> dict[str, Any]:
        """Per-source consumption at the position and at each weight change before it, and the
        weight schedule (stored in the loader state; the counts re-seed a sequential interleave).
        """
        g = epoch * self.samples_per_epoch + int(position)
        starts = self.mixture._segment_starts(self.G)
        j = int(np.searchsorted(starts, g, side="right") - 1)
        consumed = self.mixture.counts(g, global_batch_size=self.G)
        return envelope(
            "mixture",
            ORDER_VERSION,
            stream_position=g,
            samples_per_epoch=self.samples_per_epoch,
            consumed=consumed,
            bases=self.mixture._bases(self.G)[: j + 1].tolist(),
            schedule=self.mixture.schedule_json(),
            streams=self._stream_facts(consumed),
        )

    def _stream_facts(self, consumed: Mapping[str, int] | None = None) -> dict[str, Any]:
        """The facts of each source walked by an order of its own (a stream's window, seed
        and epoch), by source name: what a lone stream's checkpoint checks. A nested mixture's
        are at its draw count in ``consumed`` (its counts re-seed its interleave, so its
        resume is O(1) too)."""
        names = self.mixture.names
        facts = {}
        for s, order in self._own.items():
            at = (0, 0)
            if isinstance(order, MixtureOrder) and consumed is not None:
                at = divmod(consumed[names[s]], order.samples_per_epoch)
            facts[names[s]] = order.describe(*at)
        return facts

    def validate(self, described: Mapping[str, Any]) -> None:
        """Refuse to resume from facts whose kind, version, schedule or counts do not fit this
        order; then remember the checked counts, so a sequential interleave resumes from them.
        """
        facts = open_envelope(
            described,
            kind="mixture",
            version=ORDER_VERSION,
            fields={
                "stream_position": int,
                "samples_per_epoch": int,
                "schedule": list,
                "consumed": dict,
                "bases": list,
            },
            what="mixture order state",
        )
        if facts["samples_per_epoch"] != self.samples_per_epoch:
            raise ValueError(
                f"the checkpoint's mixture epoch has {facts['samples_per_epoch']} samples, this "
                f"one {self.samples_per_epoch}; pass samples_per_epoch="
                f"{facts['samples_per_epoch']} to Mixture to resume exactly"
            )
        self._check_streams(facts.get("streams"))
        g = facts["stream_position"]
        changes = len(self.mixture.schedule_json())
        self._adopt_schedule(facts["schedule"], g)
        try:
            for point, segment, n, counts in self._carried_points(facts):
                why = self.mixture._segments[segment].check_counts(n, counts)
                if why is not None:
                    raise ValueError(
                        f"the checkpoint's per-source consumption {point!r} does not fit this "
                        f"mixture at stream position {g} ({why}); the checkpoint is corrupted "
                        "or from another mixture"
                    )
        except BaseException:  # refused: the mixture's schedule as it was
            self.mixture._drop_changes_from(changes)
            raise
        for _, segment, n, counts in self._carried_points(facts):
            self.mixture._segments[segment].seed(n, counts)
        self.planned_until = max(self.planned_until, g)
        # The run returned every batch before the checkpoint's position: a reweight there
        # would rewrite what was served (check_reweight)
        self.returned_until = g

    def _check_streams(self, recorded: Any) -> None:
        """Refuse a checkpoint whose streams were walked otherwise (another shuffle_buffer,
        seed or samples_per_epoch): rows would repeat and others go unread. A checkpoint
        written before these facts were kept (no ``streams``) is not checked."""
        if recorded is None:
            return
        mine = self._stream_facts()
        if not isinstance(recorded, dict) or sorted(recorded) != sorted(mine):
            raise ValueError(
                f"the checkpoint's mixture walks sources {recorded!r} with orders of their own, "
                f"this one {sorted(mine)}; resume with the same sources"
            )
        names = self.mixture.names
        for s, order in self._own.items():
            try:
                order.validate(recorded[names[s]])
            except ValueError as e:
                raise ValueError(f"source {names[s]!r} of the mixture: {e}") from None

    def _adopt_schedule(self, recorded: Any, position: int) -> None:
        """Make this mixture's weight schedule the checkpoint's: the changes it lacks are
        added (a resume needs no hand-rebuilt schedule); changes of its own after the
        checkpoint's position are kept (declared for the rest of the run). A change that
        disagrees with the checkpoint at or before its position is refused."""
        mine = json.loads(json.dumps(self.mixture.schedule_json()))
        theirs = json.loads(json.dumps(recorded))
        if not _is_schedule(theirs, len(self.mixture.names)):
            raise ValueError(
                f"the checkpoint's mixture weight schedule {theirs!r} is not a list of [step, "
                f"weights per source {self.mixture.names}] from step 0; the checkpoint is "
                "corrupted"
            )
        done, future_theirs = self._split_schedule(theirs, position)
        ours, future_mine = self._split_schedule(mine, position)
        if _schedules_disagree(ours, done, future_mine):
            raise ValueError(
                f"the checkpoint's mixture weight schedule {theirs} differs from this mixture's "
                f"{mine} up to its stream position {position}; build the Mixture with the "
                "checkpoint's initial weights (its schedule is restored from the checkpoint) to "
                "resume exactly"
            )
        adopt = done[len(ours) :] + (future_theirs if not future_mine else [])
        for step, weights in adopt:
            self.mixture._add(step, dict(zip(self.mixture.names, weights, strict=True)))

    def _split_schedule(self, schedule: list[Any], position: int) -> tuple[list[Any], list[Any]]:
        """The changes of ``schedule`` at or before stream ``position``, and those after it."""
        before = [c for c in schedule if c[0] * self.G <= position]
        after = [c for c in schedule if c[0] * self.G > position]
        return before, after

    def _carried_points(self, facts: Mapping[str, Any]) -> list[tuple[Any, int, int, list[int]]]:
        """``(as recorded, segment, position in it, counts in it)`` of every carried count."""
        g = facts["stream_position"]
        starts = self.mixture._segment_starts(self.G).tolist()
        j = int(np.searchsorted(starts, g, side="right") - 1)
        names = self.mixture.names
        consumed, bases = facts["consumed"], facts["bases"]
        if not _carried_counts_fit(g, consumed, bases, names, num_segments=j + 1):
            raise ValueError(
                f"the checkpoint's per-source consumption {consumed!r} (at the weight changes: "
                f"{bases!r}) is not one int per source {names} at stream position {g} and at "
                f"each of its {j + 1} segment starts (the first all 0); the checkpoint is corrupted"
            )
        ends = [*bases[1:], [consumed[x] for x in names]]
        lengths = [*(starts[i + 1] - starts[i] for i in range(j)), g - starts[j]]
        return [
            (end, i, lengths[i], [e - b for e, b in zip(end, bases[i], strict=True)])
            for i, end in enumerate(ends)
        ]
