"""Errors that mean the data itself is damaged, or that another rank failed, not that one
sample is bad.

``on_error`` (retry, skip, substitute) is for samples that the user's code rejects or fails on.
A damaged file (a corrupt Parquet page, a truncated ``.bin``, an unreadable shard) is not a bad
sample: substituting it would train on other data without a word. Sources raise
:class:`SourceError` (naming the file and the row group or document) for such faults, and the
fetcher re-raises it, like ``MemoryError``, ``KeyboardInterrupt`` and ``SystemExit``, instead of
substituting.

Several ranks read in step. When one of them cannot go on (its batch raised, it died, it stopped
answering), every other rank raises :class:`RankError` at the same step instead of waiting in
its next collective: :class:`CollectiveError` when a collective of meshfeed's could not complete
(a peer's connection closed, or ``timeout`` passed), plain :class:`RankError` when the peer said
it failed. Catch it to abort the job; the failing rank's own error says why.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NEVER_SUBSTITUTED", "CollectiveError", "RankError", "ShardRowsError", "SourceError"]


class SourceError(OSError):
    """A source's file is damaged or unreadable; never treated as a bad sample."""


class ShardRowsError(SourceError, IndexError):
    """A shard holds fewer rows than were counted or asked for (it changed after its rows were
    counted, or ``rows=`` overstates it): a :class:`SourceError`, so never substituted, and an
    ``IndexError`` for callers that catch one."""


class RankError(RuntimeError):
    """Another rank failed, died or stalled at this step, so this rank stops here too.

    ``rank`` is the failing rank when it is known (the lowest one, if several failed), else
    None; ``step`` the step of this loader's epoch when it is known.
    """

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None):
        super().__init__(message)
        self.rank, self.step = rank, step

    def __reduce__(self) -> Any:  # keyword arguments survive pickling (worker, Ray, spawn)
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return _rebuild, (type(self), str(self), fields)


class CollectiveError(RankError):
    """A collective of meshfeed's could not complete on this rank (``this_rank``).

    ``reason`` is ``"closed"`` (a peer's connection closed or failed: it died or exited without
    joining) or ``"timeout"`` (nothing within ``timeout`` seconds: a peer is stalled, stopped
    or still busy elsewhere); ``elapsed`` is the seconds this rank waited.
    """

    def __init__(
        self,
        message: str,
        *,
        this_rank: int,
        reason: str,
        elapsed: float,
        rank: int | None = None,
        step: int | None = None,
    ):
        super().__init__(message, rank=rank, step=step)
        self.this_rank, self.reason, self.elapsed = this_rank, reason, elapsed


def _rebuild(cls: type[RankError], message: str, fields: dict[str, Any]) -> RankError:
    return cls(message, **fields)


#: Exception types the fetcher re-raises at once, whatever ``on_error`` says.
NEVER_SUBSTITUTED: tuple[type[BaseException], ...] = (
    SourceError,
    MemoryError,
    KeyboardInterrupt,
    SystemExit,
)
