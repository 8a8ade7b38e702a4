"""GetRequest: one ``SampleStore.get``, validated once and carried through every layer.

``SampleStore.get`` builds it; the backend, the Ray actor and :meth:`StoreCore.try_get` read
it. It is frozen and picklable (it travels to the Ray actor as one argument), so no layer
re-validates or re-orders ten positional values.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from meshfeed.queue.samplers import Sampler, SequentialSampler

__all__ = ["GetRequest", "PutRequest"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GetRequest:
    """What one ``get`` asks for (see :meth:`SampleStore.get` for the user-facing meaning).

        ``batch_index`` / ``stream``: the shared-plan key of rank-aware samplers (a retry of the
        same index gets the same batch). ``prefetch``: how many requests of this reader may be
        in flight; replica peers must agree on it, and it bounds which plans an index
        acknowledges. ``lease``: the lease id the batch is handed out under (a store with
        ``lease_timeout``; the client makes it). ``parts``: also hand out the parts of the shared
        plan the batch belongs to (``Batch.parts``). ``context``: any other keyword a custom
        sampler reads. ``version`` / ``max_staleness`` / ``version_of``: the trainer's policy
        version and the staleness it accepts (:mod:`meshfeed.queue.engine.versions`); ``group_filter``:
        keep a complete group or drop it (:mod:`meshfeed.queue.engine.dynamic`); ``from_start``: the
    reader started the task at batch 0 (a loader that loaded no state), so a request for a batch
    it already returned, or one that another loader read as (``loader``: the asking loader's id), is
    refused (:mod:`meshfeed.queue.engine.plans`). Build it through
        ``SampleStore.get``, which validates it.
    """

    task: str
    fields: tuple[str, ...]
    batch_size: int
    partition: str
    sampler: Sampler = field(default_factory=SequentialSampler)
    timeout: float | None = None
    batch_index: int | None = None
    stream: Hashable | None = None
    prefetch: int | None = None
    consumer: Hashable | None = None
    hold: bool = False
    parts: bool = False
    token: Hashable | None = None
    lease: str | None = None
    context: Mapping[str, Any] = field(default_factory=dict)
    version: int | None = None
    max_staleness: int | None = None
    version_of: str = "oldest"
    group_filter: Callable[[dict[str, list[Any]]], bool] | None = None
    loader: str | None = None
    from_start: bool = False

    @property
    def need(self) -> tuple[str, ...]:
        """The fields a sample must have to be ready: the requested ones and the sampler's."""
        return tuple(dict.fromkeys((*self.fields, *self.sampler.extra_fields)))

    @property
    def agree(self) -> dict[str, int] | None:
        """What replica peers reading one shared plan must ask with, besides ``batch_size``
        (recorded in the plan and its checkpoint)."""
        return None if self.prefetch is None else {"prefetch": self.prefetch}

    @property
    def plain(self) -> bool:
        """A request any other with the same key could stand in for: a sequential sampler
        with no sampler context and no lease (waiters group such requests)."""
        return (
            type(self.sampler) is SequentialSampler
            and self.batch_index is None
            and self.stream is None
            and self.prefetch is None
            and not self.context
            and self.lease is None
            and self.version is None
            and self.group_filter is None
        )

    def sampler_context(self) -> dict[str, Any]:
        """The context the sampler's ``share`` reads: the request's typed keys and the rest."""
        context = dict(self.context)
        if self.batch_index is not None:
            context["batch_index"] = self.batch_index
        if self.stream is not None:
            context["stream"] = self.stream
        return context

    def describe(self) -> str:
        return (
            f"get of {self.batch_size} samples with {list(self.fields)} for task "
            f"{self.task!r} from {self.partition!r}"
        )


class PutRequest(NamedTuple):
    """What one ``put`` stores: ``rows`` (field -> column, validated), the samples' ``ids``
    (``None``: fresh ints) and ``groups``, the ``timeout`` of a wait for room, and the
    policy ``version`` of the weights that produced them (``None``: unversioned). Built by
    ``SampleStore.put``, which validates it; it travels to the Ray actor as one argument.

    Immutable like :class:`GetRequest`, but a named tuple: a put of one sample costs about
    10 us, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field)
    added a third of that."""

    partition: str
    rows: Mapping[str, Any]
    ids: list[Hashable] | None = None
    groups: list[Hashable] | None = None
    timeout: float | None = None
    version: int | None = None
