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
- ``"substitute"`` is refused: a store batch has no deterministic substitute (the store hands
  every sample out once; there is no index to draw a replacement from that every rank would
  agree on).
"""

from __future__ import annotations

from typing import Any

from meshfeed.dist import first_failed_rank, is_distributed
from meshfeed.fetch import MAX_REPORTED_FAILURES
from meshfeed.options import OnError

__all__ = ["CollateError", "SkipLog", "check_on_error", "round_failed"]


class CollateError(RuntimeError):
    """``collate_fn`` kept failing on a fetched batch; ``ids`` names its samples.

    The batch is not lost: the loader keeps it, the next ``next()`` retries ``collate_fn`` on
    it, and ``state_dict()`` records it so a restored loader re-delivers it.
    """

    def __init__(self, message: str, *, index: int, ids: list[Any]) -> None:
        super().__init__(message)
        self.index, self.ids = index, ids


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
