"""Validation of the arguments every loader front door shares (one check, one set of names).

:class:`LoaderOptions` is what :class:`meshfeed.DataLoader`, :class:`meshfeed.StreamLoader` and
:class:`meshfeed.queue.StoreLoader` build (validated once, by :func:`check_loader_arguments`),
with the same keyword names, so the same bad value gets the same message whichever loader it
is given to.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from meshfeed.order.rampup import as_rampup
from meshfeed.protocols import Source

__all__ = [
    "MAX_RETRIES",
    "MAX_SEED",
    "MAX_WORKERS",
    "LoaderOptions",
    "OnError",
    "MAX_TIMEOUT",
    "build_dataset",
    "check_delivery",
    "check_loader_arguments",
    "check_max_retries",
    "check_not_a_path",
    "dataset_length",
    "resolve_timeout",
]

#: Seeds are 64-bit: ``2**64`` would silently give the order of seed 0.
MAX_SEED = 2**64
#: Longer waits (and ``math.inf``) are clamped to this many seconds, 24 days: the longest wait
#: ``poll`` accepts (2**31 - 1 milliseconds); larger values raise OverflowError there.
MAX_TIMEOUT = 24.0 * 24 * 3600
#: Most worker processes per rank: far more than any host has cores to feed them. A larger
#: count is a typo, and would fork processes (each with its pipes) until the process or
#: open-file limit fails part-way through starting them.
MAX_WORKERS = 1024
#: Most retries of a failing sample: each is an immediate re-read (no pause), so retries help
#: with a flaky read, never with a broken sample. A larger count is a typo, and a sample that
#: always fails would hold its batch (in the main process, with no timeout) for that many reads.
MAX_RETRIES = 100
_ON_ERROR = ("raise", "skip", "substitute")
#: What a loader does with a sample that still fails after its retries.
OnError = Literal["raise", "skip", "substitute"]


def _int(name: str, value: object, low: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {what} (got {name}={value!r})")
    if value < low:
        raise ValueError(f"{name} must be {what} (got {name}={value!r})")


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False (got {name}={value!r} of type "
            f"{type(value).__name__}); a string such as 'False' is truthy, pass a bool"
        )


def resolve_timeout(timeout: float) -> float:
    """The wait in seconds to hand to services: ``math.inf`` and huge values become MAX_TIMEOUT."""
    return min(float(timeout), MAX_TIMEOUT)


def check_loader_arguments(
    *,
    batch_size: object,
    seed: object,
    shuffle: object = True,
    drop_last: object = True,
    pin_memory: object = False,
    num_workers: object = 0,
    prefetch: object = 2,
    timeout: object = 300.0,
    on_error: object = None,
    max_retries: object = 0,
    multiprocessing_context: object = None,
) -> None:
    """Raise TypeError / ValueError naming the first bad argument and what it must be.

    ``timeout`` is positive seconds; ``math.inf`` means wait without limit (see
    :func:`resolve_timeout`); NaN is refused. ``on_error`` is None (the loader's default) or
    one of ``"raise"``, ``"skip"``, ``"substitute"``.
    """
    _int("batch_size", batch_size, 1, "a positive int per data rank")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be a non-negative int below 2**64 (got {seed=!r})")
    if not 0 <= seed < MAX_SEED:
        raise ValueError(
            f"seed must be a non-negative int below 2**64 (got {seed=!r}); seeds are 64-bit, a "
            "larger one would silently alias a smaller one"
        )
    for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("pin_memory", pin_memory)):
        _flag(name, flag)
    if num_workers == "auto":
        pass  # chosen when the first batches were timed (meshfeed.services.auto)
    elif isinstance(num_workers, str):
        raise ValueError(
            f"num_workers must be an int >= 0 or 'auto' (got {num_workers=!r}); 'auto' picks "
            "it from the cost of a batch and the cores this process may use"
        )
    else:
        _int("num_workers", num_workers, 0, "an int >= 0 or 'auto'")
    if isinstance(num_workers, int) and num_workers > MAX_WORKERS:
        raise ValueError(
            f"num_workers={num_workers} is more worker processes than meshfeed starts per rank "
            f"(MAX_WORKERS = {MAX_WORKERS}: each is a process with its pipes, so the process "
            "or open-file limit would fail part-way); use at most a few per CPU core"
        )
    _int("prefetch", prefetch, 1, "an int >= 1")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be positive seconds (got {timeout=!r})")
    if math.isnan(timeout) or not timeout > 0:
        raise ValueError(
            f"timeout must be positive seconds (got {timeout=!r}); use math.inf to wait "
            "without limit"
        )
    if on_error is not None and on_error not in _ON_ERROR:
        raise ValueError(f"on_error={on_error!r} is not one of 'raise', 'skip', 'substitute'")
    check_max_retries(max_retries)
    if multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
        raise ValueError(
            f"multiprocessing_context must be None, 'fork', 'spawn' or 'forkserver' (got "
            f"{multiprocessing_context=!r})"
        )


def check_max_retries(max_retries: object) -> None:
    """Refuse a ``max_retries`` that is not an int in ``[0, MAX_RETRIES]``."""
    _int("max_retries", max_retries, 0, "an int >= 0")
    if isinstance(max_retries, int) and max_retries > MAX_RETRIES:
        raise ValueError(
            f"max_retries={max_retries} is more retries than meshfeed allows (MAX_RETRIES = "
            f"{MAX_RETRIES}): a retry re-reads the sample at once, so it helps with a flaky "
            "read, not a broken sample, and a sample that always fails would hold its batch "
            "for every retry; use a few (e.g. max_retries=3), and retry slow-to-recover reads "
            "(e.g. network) with a backoff inside the dataset"
        )


def check_delivery(
    device: object, device_prefetch: object, on_step: object, warn_wait_share: object
) -> None:
    """Refuse a bad ``device``, ``device_prefetch``, ``on_step`` or ``warn_wait_share``."""
    from meshfeed.delivery import check_device

    target = check_device(device)
    if target is not None and target.type == "meta":
        raise ValueError(
            f"device={device!r} holds no data (a meta tensor has a shape and no values), so "
            "no batch can be copied there; use device=None (batches stay on the CPU), 'cpu' or "
            "an accelerator such as 'cuda'"
        )
    _int("device_prefetch", device_prefetch, 1, "an int >= 1")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be a function of a StepTiming or None (got {on_step=!r})")
    if warn_wait_share is None:
        return
    if isinstance(warn_wait_share, bool) or not isinstance(warn_wait_share, (int, float)):
        raise TypeError(
            f"warn_wait_share must be a share in (0, 1] or None (got {warn_wait_share=!r})"
        )
    if not 0 < warn_wait_share <= 1:
        raise ValueError(
            f"warn_wait_share must be a share in (0, 1] (got {warn_wait_share=!r}); use None to "
            "never warn"
        )


def check_not_a_path(dataset: object) -> None:
    """Refuse a path given where a dataset object is expected (a str would be its characters)."""
    if isinstance(dataset, (str, bytes, os.PathLike)):
        raise TypeError(
            f"dataset={dataset!r} is a path, not a dataset (a string would be read as its "
            "characters); open it first, e.g. meshfeed.sources.TokenWindows(path, seq_len=...) "
            "for a token corpus or ParquetSource(path) for Parquet files"
        )


def dataset_length(dataset: Any) -> int:
    """``len(dataset)`` of a map-style dataset with at least one sample, else a clear error."""
    try:
        length = len(dataset)
    except TypeError:
        raise ValueError(
            f"dataset of type {type(dataset).__name__} has no len(); meshfeed.DataLoader "
            "needs a map-style dataset (__len__ and __getitem__)"
        ) from None
    if length < 1:
        raise ValueError(f"dataset is empty (len {length}); give the loader at least one sample")
    return int(length)


def build_dataset(make: Callable[[], Any]) -> Any:
    """``make()``, the dataset a callable describes (Twinkle's call shape); refused by name if
    it is not one."""
    name = getattr(make, "__qualname__", None) or repr(make)
    try:
        built = make()
    except TypeError as exc:
        raise TypeError(
            f"dataset={name} is callable but not a dataset, and calling it with no arguments "
            f"failed ({exc}); pass a map-style dataset or a function that builds one"
        ) from exc
    if not isinstance(built, Source):
        raise TypeError(
            f"dataset={name}() returned {type(built).__name__}, not a map-style dataset "
            "(__len__ and __getitem__)"
        )
    return built


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderOptions:
    """Every option of a loader, validated once, here (the loader keeps it as ``options``).

    The same options mean the same thing for map-style data and streams; a bad value is a
    ``TypeError`` / ``ValueError`` naming it and the fix (see :func:`check_loader_arguments`).
    ``on_error`` None means the default, ``"substitute"``.
    """

    batch_size: int
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = True
    pad_last: bool = True
    #: Worker processes, or ``"auto"`` (see :mod:`meshfeed.services.auto`).
    num_workers: int | Literal["auto"] = 0
    prefetch: int = 2
    #: A function of the batch's items (map-style and streams: a list of samples; the store:
    #: the :class:`~meshfeed.queue.Batch` it assembled).
    collate_fn: Callable[[Any], Any] | None = None
    pin_memory: bool = False
    timeout: float = 300.0
    on_error: OnError | None = None
    max_retries: int = 0
    multiprocessing_context: str | None = None
    #: Where batches are delivered (see :mod:`meshfeed.delivery`): None keeps them where the
    #: loader makes them; ``"cuda"`` copies them ahead on a side stream.
    device: Any = None
    #: Batches the delivery thread may hold ready (pinned / on ``device``) ahead of the loop.
    device_prefetch: int = 2
    #: Called after every batch with a :class:`meshfeed.telemetry.StepTiming` (dashboards).
    on_step: Callable[[Any], Any] | None = None
    #: Warn once when the loop waits more than this share of its time (None: never).
    warn_wait_share: float | None = 0.25
    #: A batch-size ramp (:class:`~meshfeed.order.rampup.BatchRampup`, or Megatron's triple
    #: ``(start, increment, samples)``); the final global batch is ``batch_size`` x data ranks.
    rampup: Any = None

    def __post_init__(self) -> None:
        check_loader_arguments(
            batch_size=self.batch_size,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            pin_memory=self.pin_memory,
            num_workers=self.num_workers,
            prefetch=self.prefetch,
            timeout=self.timeout,
            on_error=self.on_error,
            max_retries=self.max_retries,
            multiprocessing_context=self.multiprocessing_context,
        )
        _flag("pad_last", self.pad_last)
        if self.drop_last and not self.pad_last:
            raise ValueError(
                "pad_last=False would be ignored with drop_last=True (the last incomplete batch "
                "is dropped, nothing is padded); pass drop_last=False, pad_last=False to "
                "truncate it to equal lengths per rank"
            )
        if self.on_error is None:
            object.__setattr__(self, "on_error", "substitute")
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise TypeError(
                f"collate_fn must be a function of a list of samples, or None for the default "
                f"collation (got collate_fn={self.collate_fn!r})"
            )
        check_delivery(self.device, self.device_prefetch, self.on_step, self.warn_wait_share)
        object.__setattr__(self, "rampup", as_rampup(self.rampup))

    @property
    def wait_timeout(self) -> float:
        """What waits are given: ``math.inf`` and huge timeouts clamped (see resolve_timeout)."""
        return resolve_timeout(self.timeout)

    def check_service(self, service: object) -> None:
        """Refuse options a ``service`` would silently ignore: it decides where batches are
        made, so workers are asked for with ``num_workers`` only when there is no service."""
        if service is None:
            return
        name = type(service).__name__
        if self.num_workers:
            raise ValueError(
                f"num_workers={self.num_workers} and service={name} both say where batches are "
                f"made; num_workers asks for worker processes of this loader, service={name} "
                "makes the batches elsewhere: pass one of them"
            )
        from meshfeed.protocols import GlobalService

        if isinstance(service, GlobalService) and (self.pin_memory or self.device is not None):
            raise ValueError(
                f"pin_memory={self.pin_memory!r} / device={self.device!r} would be ignored: "
                f"with service={name} a batch stays where it is made (a RemoteBatch of "
                "references), so this process has nothing to pin or copy; resolve each rank's "
                "batch where it trains (ray.get(batch.for_rank(rank))) and pin or copy it "
                "there, and leave out pin_memory and device"
            )
        for field, default in (
            ("prefetch", 2),
            ("timeout", 300.0),
            ("multiprocessing_context", None),
        ):
            value = getattr(self, field)
            if value != default:
                raise ValueError(
                    f"{field}={value!r} would be ignored: with service={name} the service "
                    f"decides it; configure it on the service (e.g. {name}({field}=...)) and "
                    f"leave the loader's {field} at its default"
                )
