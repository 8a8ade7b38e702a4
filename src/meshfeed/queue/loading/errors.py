"""``on_error`` for the store door: what a batch whose ``collate_fn`` keeps failing becomes.

A :class:`~meshfeed.queue.loading.loader.StoreLoader` retries ``collate_fn`` on the batch it already
fetched (the store handed its samples out once). After ``collate_retries``:

- ``"raise"`` (the default): :class:`~meshfeed.queue.loading.loader.CollateError`; the loader keeps
  the batch (the next ``next()`` retries it, ``state_dict()`` records it). With a process
  group of several ranks the ranks agree on every batch (one ``all_reduce`` of one int, as
  ``DataLoader`` does with ``on_error="raise"``): the others raise
  :class:`~meshfeed.errors.RankError` at the same batch, so none goes on to a collective the
  failed rank never reaches.
- ``"skip"``: the batch is dropped (its samples stay consumed in the store), counted in
  ``stats()["skipped"]`` and listed in ``stats()["failures"]``, with a rate-limited warning.
  Every rank must still take the same number of steps, so with a process group of several
  ranks the ranks agree on every round (:func:`meshfeed.dist.first_failed_rank`, one
  ``all_reduce`` of one int per batch, only with ``"skip"``): a round one rank could not
  collate is skipped by every rank. A mesh of several ranks without a process group cannot
  agree, so ``"skip"`` is refused there (:func:`check_on_error`).
- Whatever ``on_error`` says, a batch whose making raised on one rank (its store refused the
  request, its wait timed out, a worker died, a damaged file) is announced in that round's
  agreement (:func:`round_failures`): the other ranks raise :class:`~meshfeed.errors.RankError`
  naming that rank and its error at the same batch (a :class:`RankTimeoutError` when its wait
  timed out), and keep their part of it, instead of waiting for that rank in the agreement
  until ``timeout``.
- ``"substitute"`` is refused: a store batch has no deterministic substitute (the store hands
  every sample out once; there is no index to draw a replacement from that every rank would
  agree on).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from meshfeed.dist import all_gather_objects, first_failed_rank, is_distributed
from meshfeed.errors import RankError
from meshfeed.fetch import MAX_REPORTED_FAILURES
from meshfeed.options import OnError

__all__ = [
    "CollateError",
    "Failure",
    "RankTimeoutError",
    "SkipLog",
    "check_on_error",
    "round_failed",
    "round_failures",
]


class CollateError(RuntimeError):
    """``collate_fn`` kept failing on a fetched batch; ``ids`` names its samples.

    The batch is not lost: the loader keeps it, the next ``next()`` retries ``collate_fn`` on
    it, and ``state_dict()`` records it so a restored loader re-delivers it.
    """

    def __init__(self, message: str, *, index: int, ids: list[Any]) -> None:
        super().__init__(message)
        self.index, self.ids = index, ids


class RankTimeoutError(RankError, TimeoutError):
    """Another rank's wait for its part of this batch timed out (its producers were late), so
    this rank stops at the same batch too, with a ``TimeoutError`` as that rank's: a loop that
    calls ``next()`` again after a ``TimeoutError`` goes on on every rank, from this batch."""


class Failure(NamedTuple):
    """What failed in one rank's part of a round, as the other ranks are told: ``raised``
    (its making raised; else ``collate_fn`` kept failing on it), the error's type name and
    message, and whether it was a ``TimeoutError``."""

    raised: bool
    kind: str
    message: str
    timed_out: bool

    @classmethod
    def of(cls, error: BaseException, *, raised: bool) -> Failure:
        text = " ".join(str(error).split())
        text = text if len(text) <= 300 else text[:300] + " ..."
        return cls(raised, type(error).__name__, text, isinstance(error, TimeoutError))

    def describe(self) -> str:
        if self.raised:
            return f"raised {self.kind}: {self.message}"
        return f"could not collate its part ({self.kind}: {self.message})"


def check_on_error(on_error: OnError, world_size: int) -> OnError:
    """The store door's ``on_error``; ``"substitute"``, and ``"skip"`` on a mesh of several
    ranks without a process group, refused naming why and the fix."""
    if on_error == "substitute":
        raise ValueError(
            "on_error='substitute' is not available for a StoreLoader: a store batch has no "
            "deterministic substitute (the store hands every sample out once, and every rank "
            "would have to agree on a replacement); use on_error='skip' to drop a batch whose "
            "collate_fn keeps failing, or on_error='raise' (the default)"
        )
    if on_error == "skip" and world_size > 1 and not is_distributed():
        raise ValueError(
            f"on_error='skip' on a mesh of {world_size} ranks needs the process group "
            "(torch.distributed.init_process_group) before the StoreLoader is built: the ranks "
            "agree on every batch whether one of them skips it, otherwise a rank that skips "
            "a batch the others keep would take one step fewer and hang their next "
            "collective; initialise the process group first, or use on_error='raise'"
        )
    return on_error


def round_failed(failed: bool, timeout: float) -> int | None:
    """The lowest rank whose part of this round failed (this one if ``failed``), else None:
    one collective with a process group of several ranks, none without."""
    if not is_distributed():
        return 0 if failed else None
    return first_failed_rank(failed, timeout=timeout)


def round_failures(mine: Failure | None, timeout: float) -> dict[int, Failure]:
    """Every rank whose part of this round failed, with what failed there (``mine``: this
    rank's; empty: none failed), in rank order: the one collective of :func:`round_failed`,
    and only when a part failed one gather of the failures (the same on every rank, since
    every rank learns of the failure from the same collective)."""
    if round_failed(mine is not None, timeout) is None:
        return {}
    if not is_distributed():
        return {} if mine is None else {0: mine}
    # Plain tuples travel: every rank unpickles what the others send.
    told = all_gather_objects(None if mine is None else tuple(mine), timeout=timeout)
    return {r: Failure(*failure) for r, failure in enumerate(told) if failure is not None}


class SkipLog:
    """What ``on_error="skip"`` dropped: ``skipped`` batches and ``skipped_samples``, and the
    first :data:`~meshfeed.fetch.MAX_REPORTED_FAILURES` ``failures`` as rows
    ``[index, ids, error, message]`` (``error`` the exception's type name, or ``"RankError"``
    when another rank's part of the round failed)."""

    def __init__(self) -> None:
        self.skipped = 0
        self.samples = 0
        self.failures: list[list[Any]] = []

    def record(
        self, index: int, ids: list[Any], error: BaseException | None, rank: int
    ) -> dict[str, Any]:
        """Count a dropped batch; its description for the warning."""
        self.skipped += 1
        self.samples += len(ids)
        if error is not None:
            kind, message = type(error).__name__, str(error)
        else:
            kind = "RankError"
            message = f"rank {rank} could not collate its part of this round"
        if len(self.failures) < MAX_REPORTED_FAILURES:
            self.failures.append([index, list(ids), kind, message])
        shown = f"{ids[:8]} ..." if len(ids) > 8 else f"{ids}"
        return {"where": f"batch {index} (sample ids {shown})", "error": kind, "message": message}
