"""Corpora opened on first use: a :class:`~meshfeed.sources.tokens.indexed.TokenCorpus` given
the ``fingerprint`` it must have reads nothing until a read needs its files (#32).

A mixture of 10,000 corpora needs, to start, only each corpus's document count, dtype and
identity, all of which its fingerprint records; a corpora manifest (``corpora.json``, see
:mod:`meshfeed.sources.tokens.manifest`) carries the fingerprints, so start-up reads one file
and a first batch opens only the corpora it reads. Opened, a corpus is checked as any other
(its layout against its ``.bin``), and then against the fingerprint given: a file rewritten
since is refused by name, at that read and every later one.
"""

from __future__ import annotations

import os
import sys
import threading
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed_format import DTYPE_CODES
from meshfeed.storage import is_url

__all__ = ["DeferredOpen"]

_opening = threading.RLock()  # one corpus opens at a time: the others wait (bounded)
#: Seconds a thread waits for another thread's opening of a corpus: above a stalled
#: download's own bounds (the shard cache's lock_timeout of 600 s and its retries).
OPEN_WAIT_S = 900.0


def _new_lock_in_child() -> None:
    global _opening
    _opening = threading.RLock()  # a fork while another thread held it would leave it held


if sys.platform != "win32":  # fork and register_at_fork are POSIX only
    os.register_at_fork(after_in_child=_new_lock_in_child)


class DeferredOpen:
    """Opening deferred to first use, mixed into the corpus that defines ``_open``."""

    dtype: np.dtype[Any]
    prefix: str
    idx_path: Any
    bin_path: Any
    _fingerprint: str | None
    _n_docs: int
    _num_tokens: int | None
    _contiguous: bool
    _ranged: Any
    _open: Callable[..., None]

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """The corpus's identity, computed from its files once opened."""

    @property
    def opened(self) -> bool:
        """False while a corpus given ``fingerprint=`` has read none of its files."""
        return "_pending" not in self.__dict__

    def _defer(self, prefix: str | os.PathLike[str], fingerprint: str, options: Any) -> None:
        """Open nothing yet: take the counts from ``fingerprint`` and open on first use."""
        self.dtype, self._n_docs, bin_len = expected_facts(fingerprint)
        self._fingerprint = fingerprint
        self._num_tokens = bin_len // self.dtype.itemsize
        self._contiguous = True  # proven when opened, or refused
        where = os.fspath(prefix)
        self.prefix = where.removesuffix(".idx").removesuffix(".bin")
        if not is_url(where):
            self._ranged = None  # a local file is never read by ranges
        self._pending = (prefix, options)

    def __getattr__(self, name: str) -> Any:
        # reached only for an attribute not set yet: a corpus given fingerprint= opens now,
        # once, whichever thread reads first (the others wait for it)
        if not name.startswith("__") and "_pending" in self.__dict__:
            if not _opening.acquire(timeout=OPEN_WAIT_S):
                raise TimeoutError(
                    f"waited {OPEN_WAIT_S:.0f} s for another thread to open a corpus before "
                    f"{self.prefix}; its store may be stalled (a URL corpus: see the shard "
                    "cache's lock_timeout and retry_timeout)"
                )
            try:
                pending = self.__dict__.get("_pending")
                if pending is not None:
                    self._open_pending(*pending)
            finally:
                _opening.release()
        return object.__getattribute__(self, name)

    def _open_pending(self, prefix: str | os.PathLike[str], options: dict[str, Any]) -> None:
        """Open the files now; refused by name unless they have the fingerprint given (then
        the corpus stays unopened, so every later read is refused the same way).

        The files are opened into a new object and its state published here at once: other
        threads read this corpus's attributes without the lock, and one that found a
        half-opened corpus (a field reset, not yet set) read it wrong."""
        expected = self._fingerprint
        opened = object.__new__(type(self))
        opened._open(prefix, **options)
        if opened.fingerprint != expected:
            raise SourceError(
                f"{opened.idx_path} and {opened.bin_path} are not the corpus recorded: "
                f"fingerprint {opened.fingerprint!r} now, {expected!r} when recorded; the "
                "corpus was rewritten after its fingerprint (or corpora manifest) was "
                "taken: write the manifest again (meshfeed corpora FOLDER) or open the "
                "corpus without fingerprint="
            )
        # every value final before _pending goes: a reader finds a final value or none
        # (then it waits here for the lock and finds the corpus open)
        self.__dict__.update({k: v for k, v in opened.__dict__.items() if k != "_held"})
        del self._pending


def expected_facts(fingerprint: str) -> tuple[np.dtype[Any], int, int]:
    """The dtype, document count and ``.bin`` length a :attr:`TokenCorpus.fingerprint` records."""
    parts = fingerprint.split(":") if isinstance(fingerprint, str) else []
    try:
        if len(parts) != 6 or parts[0] != "megatron":
            raise ValueError(parts)
        dtype = np.dtype(parts[1])
        if dtype not in DTYPE_CODES.values():
            raise ValueError(dtype)
        return dtype, int(parts[2]), int(parts[4])
    except (TypeError, ValueError):
        raise ValueError(
            "fingerprint must be a TokenCorpus fingerprint, 'megatron:DTYPE:DOCUMENTS:"
            f"INDICES:BIN_BYTES:HASH' (got {fingerprint=!r}); take it from corpus.fingerprint "
            "or a corpora manifest (meshfeed corpora FOLDER)"
        ) from None
