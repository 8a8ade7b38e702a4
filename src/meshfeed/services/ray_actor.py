"""The loader actor of Ray mode (:mod:`meshfeed.services.ray`): what runs inside each Ray actor.

The actor builds the dataset from the user's callable (an error there is kept and re-raised by
``describe`` with its own type), describes it to the driver, and makes every data rank's batch
of one global step with a :class:`~meshfeed.fetch.Fetcher` that it configures, and seeds, on the
first task of each configuration (so an actor that Ray restarted configures itself again).

A batch leaves the actor encoded as a worker's result is (:mod:`meshfeed.runtime.transport`):
each CPU tensor as its raw bytes, out-of-band, a dtype numpy lacks (bfloat16, float8,
complex32, ...) as the bits of an integer dtype of its width, and the rest pickled by Ray's
cloudpickle. Ray would pickle a tensor with torch's own pickling, which cannot load uint16 /
uint32 / uint64 or float8 tensors. ``ray.get`` of the reference rebuilds the batch (each buffer
copied out of the read-only object store: the tensors are writable and the batch's own).
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from meshfeed.fetch import Fetcher, FetchTask
from meshfeed.order.permutation import derive_seed
from meshfeed.protocols import OrderedSource
from meshfeed.runtime.transport import loads, off_host, reduce_tensor
from meshfeed.services.workers import seed_globals
from meshfeed.state import dataset_fingerprint

__all__: list[str] = []

_ACTOR_SEED_OP = 0x5241


class _LoaderActor:
    """Runs inside a Ray actor: builds the dataset from the callable, then makes batches."""

    def __init__(self, create_dataset: Callable[[], Any], index: int, count: int) -> None:
        self.index, self.count = index, count
        self.dataset: Any = None
        self.error: BaseException | None = None
        self.fetcher: Fetcher | None = None
        self.config_id: str | None = None
        try:
            self.dataset = create_dataset()
        except Exception as exc:  # re-raised by describe() with its own type and traceback
            self.error = exc

    def describe(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        ds = self.dataset
        try:
            length = len(ds)
        except TypeError:
            raise TypeError(
                f"create_dataset() returned {type(ds).__name__}, which has no len(); "
                "RayService needs a callable that returns a map-style dataset"
            ) from None
        return {
            "length": length,
            "fingerprint": dataset_fingerprint(ds),
            "has_make_order": isinstance(ds, OrderedSource),
            "pid": os.getpid(),
        }

    def make_order(self, kwargs: dict[str, Any]) -> Any:
        return self.dataset.make_order(**kwargs)

    def ping(self) -> int:
        return os.getpid()

    def fetch_step(self, config: list[Any], tasks: list[FetchTask]) -> tuple[Any, ...]:
        """Every data rank's batch of one step, then (first return) their FetchEvents."""
        fetcher = self._fetcher(config[0])
        made = [fetcher(task) for task in tasks]
        return ([events for _, events in made], *(_Encoded(batch) for batch, _ in made))

    def _fetcher(self, config_ref: Any) -> Fetcher:
        # The configuration travels as a nested reference with every call, so an actor that
        # Ray restarted (which re-runs only __init__) configures itself on its first task.
        key = config_ref.hex()
        if self.fetcher is None or self.config_id != key:
            import ray

            config = ray.get(config_ref)
            seed_globals(derive_seed(config["seed"], _ACTOR_SEED_OP, self.index))
            fetcher = Fetcher(self.dataset, **config)
            fetcher.worker_id, fetcher.num_workers = self.index, self.count
            self.fetcher, self.config_id = fetcher, key
        return self.fetcher


class _Encoded:
    """A batch on its way to Ray's object store; ``ray.get`` gives the batch itself (module
    docstring)."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        out = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []
        _pickler()(out, protocol=5, buffer_callback=buffers.append).dump(self.batch)
        return _decoded, (out.getvalue(), *buffers)  # the buffers travel out-of-band


@functools.cache
def _pickler() -> type:
    """Ray's cloudpickle (functions, classes of ``__main__``), tensors as the transport
    encodes them."""
    from ray import cloudpickle

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            reduced = reduce_tensor(obj)
            if reduced is not NotImplemented:
                return reduced
            error = off_host(obj, "a batch of a Ray loader actor", "the default service")
            if error is not None:
                raise error
            return super().reducer_override(obj)

    return Pickler


def _decoded(header: bytes, *buffers: Any) -> Any:
    """The batch :class:`_Encoded` sent, each buffer copied into memory of its own (Ray maps
    out-of-band buffers read-only from its object store)."""
    return loads(header, [np.frombuffer(b, dtype=np.uint8).copy() for b in buffers])
