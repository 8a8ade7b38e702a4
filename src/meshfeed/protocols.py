"""The declared contracts of meshfeed: sources, orders, services and stateful parts.

Everything the engine calls on an object it did not build is declared here. The engine uses
only these methods; optional ones are listed as optional and have a documented default, so no
other ``getattr``/``hasattr`` probing of user objects is needed.

- :class:`Source`: a map-style dataset (``__len__``, ``__getitem__``). Optional, in this order
  of preference: ``fetch_batch(indices)`` (an already collated batch), ``__getitems__(indices)``
  (torch's batched protocol), and ``fingerprint`` (a string identity for checkpoints).
- :class:`Order`: global sample positions of an epoch -> dataset indices, a pure function.
  :class:`OrderBase` gives the optional ``describe`` / ``validate`` their defaults.
- :class:`Service`: where batches are made (in-process, worker processes, Ray, ...).
- :class:`Stateful`: ``state_dict()`` / ``load_state_dict(state)`` with the one envelope of
  :mod:`meshfeed.state` (``{"kind": ..., "version": ..., **fields}``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["Order", "OrderBase", "Source", "Stateful"]


@runtime_checkable
class Source(Protocol):
    """A map-style dataset: ``len(source)`` items, ``source[i]`` for ``0 <= i < len``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class Order(Protocol):
    """Maps global sample positions of an epoch to dataset indices (a pure function)."""

    def epoch_length(self, epoch: int) -> int: ...

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray: ...


class OrderBase:
    """Defaults for the optional parts of an :class:`Order`.

    ``describe(epoch, position)`` returns the order's JSON facts for a checkpoint (None: the
    order has nothing to record beyond the loader's epoch and position); ``validate(described)``
    checks such facts on resume and raises ``ValueError`` naming what differs.
    """

    def describe(self, epoch: int, position: int) -> dict[str, Any] | None:
        return None

    def validate(self, described: Mapping[str, Any]) -> None:
        return None


@runtime_checkable
class Stateful(Protocol):
    """A part whose progress can be saved and restored exactly.

    ``state_dict()`` returns a JSON-serialisable dict built with :func:`meshfeed.state.envelope`
    (``kind``, ``version``, then the part's fields) describing the state as of the last item
    *returned*; ``load_state_dict(state)`` checks every field against the object it is loaded
    into (:func:`meshfeed.state.open_envelope`) and raises ``ValueError`` naming the value and
    the fix. This is also the protocol of ``torch.distributed.checkpoint``'s ``Stateful``.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
