"""Errors that mean the data itself is damaged, not that one sample is bad.

``on_error`` (retry, skip, substitute) is for samples that the user's code rejects or fails on.
A damaged file (a corrupt Parquet page, a truncated ``.bin``, an unreadable shard) is not a bad
sample: substituting it would train on other data without a word. Sources raise
:class:`SourceError` (naming the file and the row group or document) for such faults, and the
fetcher re-raises it, like ``MemoryError``, ``KeyboardInterrupt`` and ``SystemExit``, instead of
substituting.
"""

from __future__ import annotations

__all__ = ["NEVER_SUBSTITUTED", "SourceError"]


class SourceError(OSError):
    """A source's file is damaged or unreadable; never treated as a bad sample."""


#: Exception types the fetcher re-raises at once, whatever ``on_error`` says.
NEVER_SUBSTITUTED: tuple[type[BaseException], ...] = (
    SourceError,
    MemoryError,
    KeyboardInterrupt,
    SystemExit,
)
