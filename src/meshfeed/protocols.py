"""The declared contracts of meshfeed: sources, orders, services and stateful parts.

Everything the engine calls on an object it did not build is declared here. The engine uses
only these methods; optional ones are listed as optional and have a documented default, so no
other ``getattr``/``hasattr`` probing of user objects is needed.

- :class:`Source`: a map-style dataset (``__len__``, ``__getitem__``). Optional, in this order
  of preference: ``fetch_batch(indices)`` (an already collated batch), ``__getitems__(indices)``
  (torch's batched protocol), and ``fingerprint`` (a string identity for checkpoints).
- :class:`Order`: global sample positions of an epoch -> dataset indices, a pure function.
  :class:`OrderBase` gives the optional ``describe`` / ``validate`` their defaults.
- :class:`Service`: where one data rank's batches are made (in-process, worker processes).
  :class:`GlobalService` makes every data rank's batch of a step at once (Ray); the loader
  dispatches on ``isinstance``, once, at construction.
- :class:`PostProcess`: a hook applied to each collated batch (a curriculum's transforms),
  called as ``postprocess(batch, epoch=..., step=...)``.
- :class:`Stateful`: ``state_dict()`` / ``load_state_dict(state)`` with the one envelope of
  :mod:`meshfeed.state` (``{"kind": ..., "version": ..., **fields}``).
- A sharded stream's reader is a callable ``reader(shard, start_row, stop_row)``; each optional
  hook it may have is one protocol here (:class:`TakeReader`, :class:`CountReader`,
  :class:`VersionReader`, :class:`ModifiedReader`, :class:`PlanReader`, :class:`AskReader`,
  :class:`ForgetReader`, :class:`ClosingReader`, :class:`UrlReader`, :class:`DatedReader`),
  resolved once when the stream is built (:class:`meshfeed.sources.streams.readers.ReaderHooks`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from meshfeed.tasks import FetchEvents, FetchTask

if TYPE_CHECKING:
    from meshfeed.mesh import DataMesh

__all__ = [
    "AskReader",
    "BatchSource",
    "BoundedService",
    "ClosingReader",
    "CountReader",
    "CurriculumHooks",
    "DatedReader",
    "ExplainedSource",
    "Fetch",
    "FingerprintedSource",
    "FinishReader",
    "ForgetReader",
    "GlobalService",
    "ItemsSource",
    "ModifiedReader",
    "Order",
    "OrderBase",
    "OrderedSource",
    "PlanReader",
    "PostProcess",
    "Service",
    "Source",
    "Stateful",
    "TakeReader",
    "TextEncoder",
    "UrlReader",
    "VersionReader",
]


@runtime_checkable
class Source(Protocol):
    """A map-style dataset: ``len(source)`` items, ``source[i]`` for ``0 <= i < len``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class BatchSource(Protocol):
    """Optional: ``fetch_batch(indices)`` returns the already collated batch of ``indices``.

    It must equal collating ``[source[i] for i in indices]`` (the fetcher falls back to that
    when the call raises). Used only when the loader has no ``collate_fn``.
    """

    def fetch_batch(self, indices: np.ndarray) -> Any: ...


@runtime_checkable
class ItemsSource(Protocol):
    """Optional: torch's batched protocol, ``__getitems__(indices)`` -> one item per index.

    An item may be ``None`` (rejected) or :class:`meshfeed.Failed` (it raised) in place, so the
    healthy items of the batch are kept.
    """

    def __getitems__(self, indices: list[int]) -> list[Any]: ...


@runtime_checkable
class FingerprintedSource(Protocol):
    """Optional: ``fingerprint`` (a string, or a method returning one) identifies the data in
    checkpoints, e.g. file sizes and a header hash. Default: class name and length."""

    @property
    def fingerprint(self) -> Any: ...


@runtime_checkable
class ExplainedSource(Protocol):
    """Optional: ``explain_fingerprint(old)`` says why a checkpoint's fingerprint ``old``
    differs from the source's (which shards changed), for the loader's refusal to resume."""

    def explain_fingerprint(self, old: str) -> str: ...


@runtime_checkable
class TextEncoder(Protocol):
    """A tokenizer object: ``encode(text)`` gives token ids (a list, an array, an object with
    ``ids`` or a mapping with ``input_ids``); where meshfeed takes one, a callable serves too."""

    def encode(self, text: Any) -> Any: ...


@runtime_checkable
class Order(Protocol):
    """Maps global sample positions of an epoch to dataset indices (a pure function)."""

    def epoch_length(self, epoch: int) -> int: ...

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray: ...


class OrderBase:
    """Defaults for the optional parts of an :class:`Order`.

    ``describe(epoch, position)`` returns the order's JSON facts for a checkpoint (None: the
    order has nothing to record beyond the loader's epoch and position); ``validate(described)``
    checks such facts on resume and raises ``ValueError`` naming what differs. An order whose
    plan can change while the loader runs (a mixture reweighted at a step not yet returned)
    hears of returned batches through ``returned`` and reports changes through ``replanned``.
    """

    def describe(self, epoch: int, position: int) -> dict[str, Any] | None:
        return None

    def validate(self, described: Mapping[str, Any]) -> None:
        return None

    def returned(self, epoch: int, position: int) -> None:
        """The loader returned the batches of ``epoch`` up to ``position`` to the training loop
        (an order whose plan can change later, a reweighted mixture, refuses changes before)."""
        return None

    def replanned(self, epoch: int) -> int | None:
        """The first position of ``epoch`` whose indices changed since the last call (the
        loader drops what it planned or prefetched from there and walks again), or None."""
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


@runtime_checkable
class OrderedSource(Protocol):
    """Optional: a source with an order of its own (e.g. a Mixture), used instead of a shuffle.

    ``make_order(dataset_length=, global_batch_size=, seed=)`` returns the :class:`Order`.
    ``shuffle=False`` is passed only to a ``make_order`` that declares a ``shuffle`` parameter
    (a stream walks its shards in order); for one that does not, ``shuffle=False`` is refused.
    """

    def make_order(
        self, *, dataset_length: int, global_batch_size: int, seed: int, shuffle: bool = True
    ) -> Any: ...


@runtime_checkable
class PostProcess(Protocol):
    """Applied to every collated batch where it is made: ``hook(batch, epoch=e, step=s)``.

    ``step`` is the global step within ``epoch``; the hook must be a pure function of the batch,
    the epoch and the step (it runs in workers and actors), and picklable.
    """

    def __call__(self, batch: Any, *, epoch: int, step: int) -> Any: ...


@runtime_checkable
class CurriculumHooks(Protocol):
    """What a loader's ``curriculum=`` provides: its order and a batch post-process hook.

    ``make_order(dataset_length=, global_batch_size=, seed=)`` returns the :class:`Order` the
    loader walks; ``postprocess`` is a :class:`PostProcess` (or None for none).
    """

    def make_order(self, *, dataset_length: int, global_batch_size: int, seed: int) -> Any: ...

    @property
    def postprocess(self) -> PostProcess | None: ...


class Fetch(Protocol):
    """Makes one batch where it runs: ``fetch(task) -> (batch, FetchEvents)`` (the loader's
    :class:`meshfeed.fetch.Fetcher`). A service tells it which worker it runs in, so per-sample
    randomness can be keyed on it."""

    seed: int
    worker_id: int
    num_workers: int

    def __call__(self, task: FetchTask) -> tuple[Any, FetchEvents]: ...


@runtime_checkable
class Service(Protocol):
    """Makes one data rank's batches: runs a :class:`Fetch` on a stream of tasks, in order.

    ``map`` may run ahead (prefetch) but must yield exactly one ``(batch, FetchEvents)`` per
    task, in order; a new ``map`` call discards whatever an abandoned earlier one left in
    flight. ``shutdown`` is idempotent; ``start`` after ``shutdown`` starts again.
    """

    def start(self, fetcher: Fetch) -> None: ...

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class BoundedService(Service, Protocol):
    """A :class:`Service` that says how far it runs ahead: ``in_flight`` is the most tasks one
    ``map`` holds taken and not yet passed (the one whose batch the loop holds included). A door whose source keeps each batch only so many
    batches back (the sample store's shared plans) needs it; every meshfeed service has it."""

    @property
    def in_flight(self) -> int: ...


@runtime_checkable
class GlobalService(Protocol):
    """Makes every data rank's batch of a step at once, where the dataset lives (Ray actors).

    The loader calls, in this order: ``bind_mesh(mesh)`` (so results can be mapped to global
    ranks; again with ``resized=True`` when the loader is resized), ``prepare(dataset)`` (returns the driver-side stand-in the loader measures: a
    map-style object with ``len``), ``start(fetcher)``, then ``map_global(steps)`` with one list
    of per-data-rank tasks per step, yielding ``(global batch, [FetchEvents per rank])`` in
    order; ``shutdown`` is idempotent.
    """

    def bind_mesh(self, mesh: DataMesh, *, resized: bool = False) -> None: ...

    def prepare(self, dataset: Any) -> Any: ...

    def start(self, fetcher: Fetch) -> None: ...

    def map_global(
        self, step_task_lists: Iterator[list[FetchTask]]
    ) -> Iterator[tuple[Any, list[FetchEvents]]]: ...

    def shutdown(self) -> None: ...


# ---------------------------------------------------------------- a sharded stream's reader hooks
@runtime_checkable
class TakeReader(Protocol):
    """``take(shard, rows)``: the rows at these indices (any order, repeats allowed)."""

    def take(self, shard: Any, rows: np.ndarray) -> list[Any]: ...


@runtime_checkable
class CountReader(Protocol):
    """``count(shard)``: the shard's rows without reading them all (else one pass counts)."""

    def count(self, shard: Any) -> int: ...


@runtime_checkable
class VersionReader(Protocol):
    """``version(shard)``: a cheap identity of the shard's content (else its bytes hashed)."""

    def version(self, shard: Any) -> str: ...


@runtime_checkable
class ModifiedReader(Protocol):
    """``modified(shard)``: when the shard was written, in ns (else the file's mtime)."""

    def modified(self, shard: Any) -> int: ...


@runtime_checkable
class PlanReader(Protocol):
    """``plan(shards)``: the stream's order reads these shards next (e.g. download ahead)."""

    def plan(self, shards: list[Any]) -> None: ...


@runtime_checkable
class FinishReader(Protocol):
    """``finished(shards)``: the stream's order returned every row of these shards' current
    pass (e.g. their cached copies may go first)."""

    def finished(self, shards: list[Any]) -> None: ...


@runtime_checkable
class AskReader(Protocol):
    """``ask(shards)``: learn every shard's ``version`` in one round (one bucket listing)."""

    def ask(self, shards: list[Any]) -> None: ...


@runtime_checkable
class ForgetReader(Protocol):
    """``forget(shard)``: drop what the reader holds open of a file about to be evicted."""

    def forget(self, shard: Any) -> None: ...


@runtime_checkable
class ClosingReader(Protocol):
    """``close()``: release what this process holds of the shards; reading again re-opens."""

    def close(self) -> None: ...


@runtime_checkable
class UrlReader(Protocol):
    """``reads_urls``: true when the reader reads URL shards itself (not through the cache)."""

    reads_urls: bool


@runtime_checkable
class DatedReader(Protocol):
    """``newest``: the dataset's write time in ns (None: unknown; else the newest shard's)."""

    newest: int | None
