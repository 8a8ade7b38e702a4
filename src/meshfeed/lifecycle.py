"""The lifecycle every loader shares: ``shutdown()``, a ``with`` block, and collection."""

from __future__ import annotations

import contextlib
from typing import Self

__all__ = ["Lifecycle"]


class Lifecycle:
    """``shutdown()`` stops a loader's worker processes or actors; it must be idempotent.

    A ``with`` block calls it on exit, and a loader that is collected without it calls it too,
    so a forgotten loader does not leave processes behind.
    """

    def shutdown(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()
