"""Validation of a store call's arguments, done once by :class:`SampleStore` before any
backend sees them, and of a :class:`~meshfeed.queue.StoreLoader`'s store-only arguments (the
shared ones are :class:`~meshfeed.options.LoaderOptions`'): each check names the value and the
fix, and returns the value in the form the layers below use."""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from meshfeed.queue.engine.columns import Chunk
from meshfeed.queue.samplers import Sampler, SequentialSampler

Key = Hashable
_SEQUENTIAL = SequentialSampler()
_KEY_TYPES = frozenset({int, str})  # ids and groups that need no conversion (not bool)


def columns(column: Any, name: str) -> list[Any] | Chunk:
    if type(column) is list:  # the common case; the store keeps the values, not the list
        return column
    # Tensors can only exist if torch was imported: avoid importing it (seconds) in Ray
    # workers and actors that never see one.
    torch = sys.modules.get("torch")
    if isinstance(column, np.ndarray) or (torch is not None and isinstance(column, torch.Tensor)):
        if column.ndim == 0:
            raise ValueError(
                f"field {name!r} is a 0-d {type(column).__name__}; give a column with one "
                "entry per sample (shape [n, ...])"
            )
        return Chunk(column)  # one chunk per put; samples reference rows of it
    if isinstance(column, list | tuple):
        return list(column)
    raise TypeError(
        f"field {name!r} is a {type(column).__name__}; give a column per field: a list, "
        "tuple, tensor or array with one entry per sample"
    )


def check_sampler(sampler: Any) -> Sampler:
    if sampler is None:
        return _SEQUENTIAL
    if not isinstance(sampler, Sampler):
        raise TypeError(
            f"sampler must be a sampler object with share(), select() and extra_fields (got "
            f"sampler={sampler!r}); use one of meshfeed.queue's samplers, e.g. "
            "SequentialSampler() or RankAwareSampler.from_mesh(mesh, rank)"
        )
    return sampler


def check_consumer(consumer: Any) -> Hashable:
    if isinstance(consumer, bool) or not isinstance(consumer, int | str):
        raise TypeError(
            f"consumer must be an int or str id of one consumer (got {consumer=!r}); use e.g. "
            'f"{socket.gethostname()}:{os.getpid()}:{rank}"'
        )
    return consumer


def check_loader_id(loader: Any) -> str | None:
    """A get's ``loader=`` (the id of the loader that asks), or None."""
    if loader is not None and (not isinstance(loader, str) or not loader):
        raise TypeError(f"loader must be a non-empty str id of one loader (got {loader=!r})")
    return loader


def check_task(task: Any) -> str:
    if not isinstance(task, str) or not task:
        raise TypeError(f"task must be a non-empty string (got {task!r})")
    return task


def check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int (got {batch_size=!r})")
    return batch_size


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False (got {name}={value!r})")
    return value


def check_index(value: Any, name: str, low: int) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise ValueError(
            f"{name} must be an int >= {low} (got {name}={value!r}); every replica member "
            "passes the same value for the same step"
        )
    return value


def check_stream(stream: Any) -> Hashable:
    if stream is not None and not isinstance(stream, Hashable):
        raise TypeError(f"stream must be hashable, e.g. an int or str (got {stream=!r})")
    return stream


def prefetch_of(context: dict[str, Any]) -> int | None:
    """The reader's prefetch, given as ``prefetch=P`` (or the older ``agree={"prefetch": P}``)."""
    prefetch = context.pop("prefetch", None)
    agree = context.pop("agree", None)
    if agree is not None:
        if not isinstance(agree, Mapping) or set(agree) - {"prefetch"}:
            raise ValueError(
                f'agree= takes {{"prefetch": P}} only (got {agree=!r}); pass prefetch=P instead'
            )
        prefetch = agree.get("prefetch", prefetch)
    return check_index(prefetch, "prefetch", 1)


def _keys(values: list[Any], what: str) -> list[Any]:
    """``values`` as int / str ids (numpy ints converted); refuses any other by name."""
    if set(map(type, values)) <= _KEY_TYPES:  # the common case: nothing to convert
        return values
    plain = [int(v) if isinstance(v, np.integer) else v for v in values]
    for value in plain:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(f"{what} must be an int or str (got {value!r}); use plain ids")
    return plain


def put_ids(ids: Any, n: int) -> list[Key]:
    """A put's ``ids`` as a list of ``n`` distinct int / str ids (numpy ints converted)."""
    if hasattr(ids, "tolist"):  # numpy / torch
        ids = ids.tolist()
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise TypeError(
            f"put ids must be a list of one int or str id per sample (got ids={ids!r}); e.g. "
            f"ids=[{ids!r}] for one sample"
        )
    id_list = list(ids)
    if len(id_list) != n:
        raise ValueError(f"put got {len(id_list)} ids for {n} samples; give one id per sample")
    id_list = _keys(id_list, "a sample id")
    if len(set(id_list)) != n:
        raise ValueError(f"put ids repeat ({id_list[:20]}); give each sample once per put")
    return id_list


def put_groups(groups: Any, n: int) -> list[Hashable]:
    """A put's ``groups`` (one per sample, or one for all) as a list of ``n`` int / str ids."""
    if hasattr(groups, "tolist"):  # numpy / torch
        groups = groups.tolist()
    group_list = list(groups) if isinstance(groups, list | tuple) else [groups] * n
    if len(group_list) != n:
        raise ValueError(f"put got {len(group_list)} groups for {n} samples; give one per sample")
    return _keys(group_list, "a group id")


def check_loader_arguments(*, task: Any, fields: Any, partition: Any, collate_retries: Any) -> None:
    """Refuse a bad store-only argument by name (the shared ones are checked by
    :class:`~meshfeed.options.LoaderOptions`)."""
    if (
        isinstance(collate_retries, bool)
        or not isinstance(collate_retries, int)
        or collate_retries < 0
    ):
        raise ValueError(f"collate_retries must be an int >= 0 (got {collate_retries=!r})")
    if not isinstance(task, str) or not task:
        raise TypeError(f"task must be a non-empty string (got {task=!r})")
    if not isinstance(partition, str) or not partition:
        raise TypeError(f"partition must be a non-empty string (got {partition=!r})")
    if isinstance(fields, str) or not isinstance(fields, Sequence) or not fields:
        raise TypeError(f"fields must be a non-empty list of field names (got {fields=!r})")


def check_loader_service(store: Any, num_workers: Any, service: Any, prefetch: Any) -> None:
    """Where a store loader's batches are made: ``num_workers`` (an int) or a ``service``
    that says how far it runs ahead; worker processes of a Ray store need a named store."""
    from meshfeed.protocols import BoundedService, GlobalService

    if num_workers == "auto":
        raise ValueError(
            "num_workers='auto' is not available for a StoreLoader: its batches wait for "
            "producers, so timing them says nothing about the workers needed; pass "
            "num_workers=N (or prefetch=N to fetch ahead on one thread)"
        )
    if service is not None and num_workers:
        raise ValueError(
            f"pass num_workers={num_workers} or service=..., not both (a WorkerService "
            "already names its workers)"
        )
    if service is not None and prefetch != 2:
        raise ValueError(
            f"prefetch={prefetch!r} would be ignored: with service={type(service).__name__} the "
            "service decides how far ahead batches are made (e.g. ThreadService(prefetch)); "
            "pass one of them"
        )
    if service is not None and not isinstance(service, BoundedService):
        hint = (
            " (a GlobalService makes every data rank's batch at once, for map-style data; a "
            "store's ranks each read their own batches: use a named Ray store with "
            "num_workers=N)"
            if isinstance(service, GlobalService)
            else ""
        )
        raise TypeError(
            f"service={type(service).__name__} is not a meshfeed.protocols.BoundedService "
            f"(start, map, shutdown and in_flight){hint}; pass e.g. ThreadService(2) or "
            "WorkerService(2), or num_workers=N"
        )
    workers = num_workers or (service is not None and _runs_elsewhere(service))
    if workers and store.backend == "ray" and store.name is None:
        raise ValueError(
            "worker processes reading a Ray store need a named store so they can connect; "
            "create it with SampleStore('ray', name=...)"
        )


def _runs_elsewhere(service: Any) -> bool:
    from meshfeed.services.base import InProcessService
    from meshfeed.services.thread import ThreadService

    return not isinstance(service, (InProcessService, ThreadService))
