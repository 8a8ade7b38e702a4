"""SampleStore: the streaming sample store for RL post-training.

Producers (rollout workers, reward models, ...) ``put`` fields of samples into named
partitions in any order; each consuming task ``get``s batches of samples whose requested
fields all exist and that the task has not consumed yet. Waiting is event-driven, ``capacity``
applies backpressure to ``put``, and ``save`` / ``SampleStore.load`` checkpoint atomically.

>>> store = SampleStore()
>>> store.put("train@step_0", {"prompt": ["a", "b"]})
[0, 1]
>>> store.put("train@step_0", {"reward": [1.0, 0.5]}, ids=[1, 0])
[1, 0]
>>> batch = store.get("actor", ["prompt", "reward"], 2, "train@step_0")
>>> batch.ids, batch["reward"]
([0, 1], [0.5, 1.0])
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshfeed.collate import collate_column
from meshfeed.queue.backends.base import Backend
from meshfeed.queue.backends.embedded import EmbeddedBackend
from meshfeed.queue.checkpoints import state as checkpoint
from meshfeed.queue.engine.columns import Gathered
from meshfeed.queue.engine.core import StoreOptions
from meshfeed.queue.engine.dynamic import check_group_filter
from meshfeed.queue.engine.versions import check_staleness, check_version, check_version_of
from meshfeed.queue.engine.wakeups import check_timeout
from meshfeed.queue.request import GetRequest, PutRequest
from meshfeed.queue.samplers import Sampler
from meshfeed.queue.validate import (
    check_batch_size,
    check_consumer,
    check_flag,
    check_index,
    check_loader_id,
    check_sampler,
    check_stream,
    check_task,
    columns,
    prefetch_of,
    put_groups,
    put_ids,
)
from meshfeed.storage.urls import local_only

Key = Hashable


@dataclass(frozen=True, slots=True)
class Batch:
    """The samples one ``get`` returned: ``ids`` and one column per requested field.

    A column is a stacked ``torch.Tensor`` / ``np.ndarray`` when every value is a tensor /
    array of one shape and dtype, else a list of the values.
    """

    ids: list[Key]
    columns: dict[str, Any] = field(default_factory=dict)
    #: The lease the samples were handed out under (a store with ``lease_timeout``), to pass
    #: to :meth:`SampleStore.ack`; ``None`` when the get consumed them at once.
    lease: str | None = None
    #: With ``get(..., parts=True)``: the parts of the shared plan this batch is one part of,
    #: in part order: with a rank-aware sampler over ``D`` data ranks, the whole round (every
    #: data rank's ids, in data-rank order); ``None`` for a batch planned for this caller
    #: alone, or not asked for.
    parts: list[list[Key]] | None = None
    #: Each sample's policy version (as the get's ``version_of`` names it; ``None`` for an
    #: unversioned sample), or ``None`` when the partition has no versions.
    versions: list[int | None] | None = None

    def __getitem__(self, name: str) -> Any:
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)


def collate(values: list[Any] | Gathered) -> Any:
    """One field of a batch: a column the store gathered from chunks already is one tensor /
    array (a view of its put only for contiguous rows' last read: ``columns.owned``); values
    from separate puts go through :func:`meshfeed.collate.collate_column` (equal-shape tensors
    or arrays stacked, else a list)."""
    return values.data if isinstance(values, Gathered) else collate_column(values)


def _names_of(names: Any, what: str) -> tuple[str, ...]:
    """``fields=`` / ``tasks=`` of a store as a tuple of names (a lone string is refused: it
    would be read as its letters)."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"{what} must be a list of names (got {what}={names!r}); e.g. {what}=[{names!r}]"
        )
    out = tuple(names)
    bad = [n for n in out if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"{what} must be non-empty strings (got {bad!r} in {what}={names!r})")
    return out


class SampleStore:
    """A store of samples, field by field, consumed per task; see the module docstring.

    ``backend``: ``"embedded"`` (in-process, thread-safe) or ``"ray"`` (a Ray actor; the store
    object can be passed to Ray tasks and actors). ``capacity``: most samples held at once; a
    ``put`` of new samples beyond it waits for space. ``fields``: if given, the only field
    names allowed. ``tasks``: if given, a sample is dropped once all these tasks consumed it
    (otherwise samples stay until ``delete`` / ``clear``). ``inline_bytes`` (Ray): values at
    least this large travel through Ray's object store. ``name`` (Ray): register the actor so
    other drivers can :meth:`connect` to it. ``lease_timeout``: seconds a consumer has to
    :meth:`ack` a batch before its samples return to ready for another consumer (``None``: a
    get consumes at once, and a consumer that dies holding a batch loses it); see
    :mod:`meshfeed.queue.engine.leases`.
    """

    def __init__(
        self,
        backend: str = "embedded",
        capacity: int | None = None,
        *,
        fields: Sequence[str] | None = None,
        tasks: Sequence[str] | None = None,
        inline_bytes: int = 64 * 1024,
        name: str | None = None,
        lease_timeout: float | None = None,
        _meta: Any = None,
        _payload: Any = None,
    ) -> None:
        options = StoreOptions(
            capacity=capacity,
            fields=None if fields is None else _names_of(fields, "fields"),
            tasks=None if tasks is None else _names_of(tasks, "tasks"),
            lease_timeout=lease_timeout,
        )
        self.options = options
        if name is not None and backend != "ray":
            raise ValueError(f"name={name!r} names a Ray store actor; pass backend='ray'")
        self._backend: Backend
        if backend == "embedded":
            core = None if _meta is None else checkpoint.restore(_meta, _payload, options=options)
            self._backend = EmbeddedBackend(options, core)
        elif backend == "ray":
            from meshfeed.queue.backends.ray import RayBackend

            self._backend = RayBackend.create(
                options, inline_bytes=inline_bytes, name=name, meta=_meta, payload=_payload
            )
        else:
            raise ValueError(f"backend={backend!r} is unknown; use 'embedded' or 'ray'")
        self.backend = backend

    @classmethod
    def connect(cls, name: str, *, inline_bytes: int = 64 * 1024) -> SampleStore:
        """The Ray store created with ``SampleStore('ray', name=name)``, from another process
        (after ``ray.init(address=...)``); a Ray store can also simply be pickled."""
        from meshfeed.queue.backends.ray import RayBackend

        backend, options = RayBackend.connect(name, inline_bytes=inline_bytes)
        return cls._attach("ray", backend, options)

    @classmethod
    def _attach(cls, backend: str, backend_obj: Backend, options: StoreOptions) -> SampleStore:
        """A store object over an existing backend (tests reuse one Ray actor this way)."""
        store = cls.__new__(cls)
        store.options, store._backend, store.backend = options, backend_obj, backend
        return store

    def __repr__(self) -> str:
        return f"SampleStore(backend={self.backend!r}, capacity={self.options.capacity})"

    # ----------------------------------------------------------------- validation
    def _names(self, names: Any, what: str) -> tuple[str, ...]:
        if not names or (  # a list is the common case; skip the slow ABC checks for it
            type(names) is not list
            and (isinstance(names, str) or not isinstance(names, Sequence | Mapping))
        ):
            raise TypeError(f"{what} must be a non-empty list of field names (got {names!r})")
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"field names must be non-empty strings (got {name!r} in {what})")
        allowed = self.options.fields
        if allowed is not None:
            unknown = [n for n in names if n not in allowed]
            if unknown:
                raise ValueError(
                    f"unknown field(s) {unknown} in {what}; this store allows {list(allowed)}"
                )
        return tuple(names)

    @staticmethod
    def _partition(partition: Any) -> str:
        if not isinstance(partition, str) or not partition:
            raise TypeError(f"partition must be a non-empty string (got {partition!r})")
        return partition

    # ----------------------------------------------------------------- data path
    def put(
        self,
        partition: str,
        fields: Mapping[str, Any],
        ids: Sequence[Key] | None = None,
        *,
        groups: Sequence[Hashable] | Hashable | None = None,
        timeout: float | None = None,
        version: int | None = None,
    ) -> list[Key]:
        """Store ``fields`` (name -> column of one entry per sample) for samples ``ids``.

        New ids create samples (``ids=None``: fresh consecutive ints); existing ids gain the
        given fields (each field of a sample is produced once). ``groups``: one group id per
        sample (or one for all) for group samplers. Waits while the store is at capacity;
        ``TimeoutError`` after ``timeout`` seconds. Returns the ids.

        ``version``: the policy version (an int >= 0) of the weights that produced these
        fields. Fields added to a sample later (a partial rollout continued) may carry a
        newer version, never an older one; a group's samples are created under one version.
        A versioned put waits while a task that bounds staleness has ``(max_staleness + 1)``
        of its gets unconsumed already, and is refused with
        :class:`~meshfeed.queue.engine.versions.StaleVersion` when it is too old for every reader
        (see :mod:`meshfeed.queue.engine.versions`).
        """
        partition = self._partition(partition)
        timeout = check_timeout(timeout)
        if type(fields) is not dict and not isinstance(fields, Mapping):  # dict: no ABC check
            raise TypeError(
                f"fields must be a mapping of name -> column (got {type(fields).__name__})"
            )
        self._names(list(fields), "put fields")
        rows = {name: columns(col, name) for name, col in fields.items()}
        n = len(next(iter(rows.values())))
        if n == 0 or any(len(r) != n for r in rows.values()):
            lengths = {name: len(r) for name, r in rows.items()}
            raise ValueError(
                f"put columns must all hold the same, non-zero number of samples "
                f"(got lengths {lengths}); give one entry per sample in every field"
            )
        request = PutRequest(  # positional: the named tuple's fastest form (hot path)
            partition,
            rows,
            None if ids is None else put_ids(ids, n),
            None if groups is None else put_groups(groups, n),
            timeout,
            None if version is None else check_version(version),
        )
        return self._backend.put(request)

    def get(
        self,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        partition: str,
        sampler: Sampler | None = None,
        timeout: float | None = None,
        *,
        hold: bool = False,
        parts: bool = False,
        token: Hashable | None = None,
        consumer: Hashable | None = None,
        version: int | None = None,
        max_staleness: int | None = None,
        version_of: str = "oldest",
        group_filter: Callable[[dict[str, list[Any]]], bool] | None = None,
        **context: Any,
    ) -> Batch:
        """The next batch for ``task``: samples with every field in ``fields`` present, not yet
        consumed by ``task``; they are marked consumed for it.

        Waits (without polling) until the sampler can form a batch; ``TimeoutError`` after
        ``timeout`` seconds (``None`` or ``math.inf``: no limit; the store stays usable). Once
        the partition is closed, the rest comes as a shorter batch, then
        :class:`PartitionClosed` (also for a consumer arriving after the end). ``context`` goes
        to the sampler: ``batch_index=`` (an int >= 0) and ``stream=`` for rank-aware samplers
        (asking again for the same index returns the same batch, so a retry is safe: a
        request for index ``i`` acknowledges this reader's batches up to ``i - prefetch``, and
        a plan goes once every reader acknowledged it; at the end call :meth:`passed`),
        ``prefetch=`` (an int >= 1: this reader's requests in flight; replica peers must pass
        the same), ``loader=`` (a str naming the loader that asks, one per loader object) with
        ``from_start=True`` (it started the task at batch 0 with no earlier position: a
        request for a batch this reader already returned, or from a loader other than the
        one that read as this reader before, is refused by name, where it would read the
        plans still cached for the earlier loader), and any keyword a custom sampler reads. The call travels as one
        :class:`~meshfeed.queue.request.GetRequest`, validated here.

        For loaders: ``hold=True`` keeps the returned samples in the store (even once every
        task consumed them) until :meth:`release`, so a checkpoint taken meanwhile can
        re-deliver them with :meth:`peek`; ``token`` tags the request so :meth:`cancel` can
        wake it (it then raises :class:`RequestCancelled` having consumed nothing; see
        :meth:`new_token`);
        ``parts=True`` sets :attr:`Batch.parts` (the whole round of a rank-aware sampler over
        several data ranks, which a checkpoint names to resume on another number of them; it
        costs the round's ids in every reply of a Ray store, while the embedded store makes the
        lists once per round and hands every reader the same ones: read-only).

        Leases (a store with ``lease_timeout``): the batch comes under ``Batch.lease``; call
        :meth:`ack` once it is used, or pass the same ``consumer=`` id (one per consumer, e.g.
        ``f"{host}:{pid}:{rank}"``) to every get: a get acknowledges that consumer's earlier
        batches of the same task and partition. Unacknowledged batches return to ready after
        ``lease_timeout`` seconds. A consumer with several gets in flight (prefetch) must ack
        explicitly, not pass ``consumer=``.

        A get that needs more samples at once than ``capacity`` (``batch_size``, or the
        round of a rank-aware sampler) from an open partition is refused with ``ValueError``; one that waits while
        producers wait for the room it holds is logged and named in its ``TimeoutError`` (see
        :mod:`meshfeed.queue.engine.stall`).

        Policy versions: ``version`` is the trainer's (an int >= 0 that never goes backwards
        for a task) and ``max_staleness`` (an int >= 0, with ``version``) the most versions a
        served sample may lag it: older pending samples of the task are dropped for it
        before the batch is planned, counted in ``stats()["stale"]``. A sample written under
        several versions is judged by its oldest field (``version_of="oldest"``) or its
        newest (``"newest"``). ``Batch.versions`` names each sample's version.

        Dynamic sampling: ``group_filter`` (with a group sampler) is called with each complete
        group's ``fields`` as ``{field: [value per sample]}``; a group it returns False for is
        dropped for the task, counted in ``stats()["filtered"]``, and the batch is filled from
        later groups (see :mod:`meshfeed.queue.engine.dynamic`).
        """
        sampler = check_sampler(sampler)
        request = GetRequest(
            task=check_task(task),
            fields=self._names(fields, "get fields"),
            batch_size=check_batch_size(batch_size),
            partition=self._partition(partition),
            sampler=sampler,
            timeout=check_timeout(timeout),
            batch_index=check_index(context.pop("batch_index", None), "batch_index", 0),
            stream=check_stream(context.pop("stream", None)),
            prefetch=prefetch_of(context),
            loader=check_loader_id(context.pop("loader", None)),
            from_start=check_flag(context.pop("from_start", False), "from_start"),
            consumer=None if consumer is None else check_consumer(consumer),
            hold=check_flag(hold, "hold"),
            parts=check_flag(parts, "parts"),
            token=token,
            lease=None if self.options.lease_timeout is None else uuid.uuid4().hex,
            context=context,
            version=None if version is None else check_version(version),
            max_staleness=check_staleness(version, max_staleness),
            version_of=version_of if version_of == "oldest" else check_version_of(version_of),
            group_filter=check_group_filter(group_filter, sampler),
        )
        ids, rows, lease, plan, versions = self._backend.get(request)
        names = request.fields
        return Batch(ids, {name: collate(rows[name]) for name in names}, lease, plan, versions)

    def ack(self, lease: Batch | str) -> None:
        """The batch (or lease id) a ``get`` returned was used: its samples stay consumed.

        ``ValueError`` if the lease is not outstanding (acknowledged already, or expired and
        its samples returned to ready). A batch without a lease (a store without
        ``lease_timeout``, or a shared plan) needs no ack: this is then a no-op."""
        if isinstance(lease, Batch):
            if lease.lease is None:
                return
            lease = lease.lease
        if not isinstance(lease, str):
            raise TypeError(f"ack takes the Batch a get returned or its .lease id (got {lease!r})")
        self._backend.ack(lease)

    def drop_consumer(self, consumer: Hashable) -> int:
        """``consumer`` (a ``consumer=`` id of ``get``) is known dead: its unacknowledged
        batches return to ready now instead of at their lease deadline, counted in
        ``stats()["lease_expired"]``. Returns the number of samples returned."""
        check_consumer(consumer)
        return int(self._backend.drop_consumer(consumer))

    def release(self, partition: str, ids: Sequence[Key]) -> None:
        """Undo one ``get(..., hold=True)`` of each of ``ids`` (unknown ids are ignored)."""
        self._backend.release(self._partition(partition), list(ids))

    def peek(self, partition: str, ids: Sequence[Key], fields: Sequence[str]) -> Batch:
        """The ``fields`` of samples ``ids`` without consuming them (a loader re-delivering
        the batches a checkpoint names as fetched but not returned)."""
        names = self._names(fields, "peek fields")
        got, rows, versions = self._backend.peek(self._partition(partition), list(ids), names)
        return Batch(got, {name: collate(rows[name]) for name in names}, versions=versions)

    def new_token(self) -> Hashable:
        """A request token for ``get(..., token=...)`` that this store accepts until
        :meth:`cancel`, and keeps nothing of once cancelled (a :class:`StoreLoader` takes one
        per walk)."""
        return self._backend.new_token()

    def cancel(self, token: Hashable) -> None:
        """Wake every request made with ``token`` (they raise :class:`RequestCancelled`
        without consuming) and refuse later ones with it, however late they come; tokens are
        never reused. A token of :meth:`new_token` is refused as no longer issued, so the store
        keeps nothing of it; any other token (a hashable of the caller's) is remembered, about
        100 bytes each for as long as the store lives: use :meth:`new_token` for tokens made
        without end (one per step)."""
        self._backend.cancel(token)

    @property
    def name(self) -> str | None:
        """The Ray actor's name (``SampleStore('ray', name=...)``), else ``None``."""
        return self._backend.name

    # ----------------------------------------------------------------- admin
    def replan(
        self, partition: str, task: str, start: int, sampler: Sampler, parts: int, unit: int = 1
    ) -> None:
        """Move ``task``'s shared plans to a new data-parallel layout: plans below batch
        ``start`` are dropped, each later one is split into ``parts`` contiguous parts of whole
        ``unit``-sample units under the key ``sampler`` (the new layout's) gives it. A
        :class:`~meshfeed.queue.StoreLoader` loaded on another number of data ranks calls it,
        so the batches the old layout had in flight are served once, on the new one. Every
        rank may call it (a plan already moved stays). ``ValueError`` naming the batch when a
        round has fewer units than ``parts``."""
        _check_int("start", start, 0, "a batch index, an int")
        _check_int("parts", parts, 1)
        _check_int("unit", unit, 1)
        self._backend.replan(
            self._partition(partition), check_task(task), start, sampler, parts, unit
        )

    def passed(self, partition: str, task: str, sampler: Sampler, upto: int) -> None:
        """The reader ``sampler`` describes (a rank-aware one) returned every batch of
        ``task`` below index ``upto`` and asks for no more: its plans go once every reader
        has passed them. A :class:`~meshfeed.queue.StoreLoader` calls it at the end of its
        stream (a request acknowledges only the batches a loader's window behind it)."""
        _check_int("upto", upto, 0, "a batch index, an int")
        self._backend.passed(self._partition(partition), check_task(task), sampler, upto)

    def reset_consumption(self, partition: str, task: str) -> None:
        """Make every held sample of ``partition`` unconsumed again for ``task``."""
        self._backend.reset_consumption(self._partition(partition), task)

    def clear(self, partition: str) -> None:
        """Drop the partition: its samples, consumption and closed flag."""
        self._backend.clear(self._partition(partition))

    def delete(self, partition: str, ids: Sequence[Key]) -> None:
        """Drop samples ``ids`` of ``partition`` (freeing capacity)."""
        self._backend.delete(self._partition(partition), list(ids))

    def close(self, partition: str) -> None:
        """No more puts to ``partition``; consumers drain what is ready, then stop."""
        self._backend.close(self._partition(partition))

    def stats(self) -> dict[str, Any]:
        """``produced``, ``held``, ``consumed`` per task, ``waiting_consumers``,
        ``waiting_producers``, ``bytes_held`` (in the store), ``bytes_in_object_store`` (Ray),
        ``cache_entries``, ``redelivered`` (retried requests), ``leases`` (outstanding),
        ``lease_expired`` (samples returned to ready by an expired or dropped lease, then
        delivered again), ``stale`` (per task: samples dropped as older than its
        ``max_staleness``; also counted consumed), ``filtered`` (per task: groups a filter
        dropped) and per-partition details (with policy versions: ``trainer_versions``,
        ``held_versions``)."""
        return self._backend.stats()

    def shutdown(self) -> None:
        """Release the backend (kills the Ray actor); the store is unusable afterwards."""
        self._backend.shutdown()

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Consumption state as a JSON-serialisable dict (no payload); see ``save`` for data."""
        return self._backend.dump(with_payload=False)[0]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore consumption over the same samples (e.g. a store rebuilt from the same puts)."""
        self._backend.restore(state, None)

    def save(self, path: str | os.PathLike[str], *, allow_pickle: bool = False) -> None:
        """Write samples, fields and consumption to ``path`` atomically (temp file + rename).

        Values must be tensors, numpy arrays or JSON values (see
        :mod:`meshfeed.queue.checkpoints.state`); others are refused naming the field, unless
        ``allow_pickle=True`` (then ``load`` needs it too). Temporary files that killed saves
        left in the folder are removed (same host and process gone, or older than a day)."""
        check_flag(allow_pickle, "allow_pickle")
        path = local_only(path, what="SampleStore.save", fix="save locally, then copy the file")
        meta, payload = self._backend.dump(with_payload=True)
        checkpoint.write_checkpoint(path, meta, payload, allow_pickle=allow_pickle)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        backend: str = "embedded",
        allow_pickle: bool = False,
        **kwargs: Any,
    ) -> SampleStore:
        """A store restored from ``save(path)``; it continues with nothing lost or repeated.

        Never unpickles objects from the file, unless ``allow_pickle=True`` and the file was
        saved with it (only for files you trust: unpickling runs code)."""
        check_flag(allow_pickle, "allow_pickle")
        meta, payload = checkpoint.read_checkpoint(path, allow_pickle=allow_pickle)
        opts = meta["options"]
        for key in ("capacity", "fields", "tasks"):
            kwargs.setdefault(key, opts[key])
        kwargs.setdefault("lease_timeout", opts.get("lease_timeout"))  # states before leases
        return cls(backend, _meta=meta, _payload=payload, **kwargs)


def _check_int(name: str, value: Any, low: int, what: str = "an int") -> None:
    """Refuse ``value`` of argument ``name`` unless it is an int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be {what} >= {low} (got {name}={value!r})")
