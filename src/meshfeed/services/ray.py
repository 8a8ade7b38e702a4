"""Ray mode: the dataset lives in loader actors; a global batch is one reference per data rank.

``DataLoader(create_dataset, batch_size=b, mesh=m, service=RayService(num_actors=2))`` runs
``create_dataset()`` inside every loader actor (the driver never builds or pickles the
dataset). Iterating the loader in the driver yields one :class:`RemoteBatch` per global step,
holding one ``ray.ObjectRef`` per data rank; a consumer resolves only its own slice with
``ray.get(remote_batch.for_rank(rank))``, so bytes moved per step are one global batch in total,
not one per consumer. Order, mesh and state semantics are those of the in-process loader: rank
``r``'s resolved batch equals what ``DataLoader(create_dataset(), ..., rank=r)`` yields, and
``state_dict()`` is the position of the last ``RemoteBatch`` handed out. ``for_rank`` maps
global ranks through the mesh given to ``RayService.bind_mesh`` (the loader's mesh); with no
mesh bound, global ranks are taken to be data ranks.

Step ``s`` is made by loader actor ``s % num_actors`` (counted per iteration), ``prefetch``
global steps ahead. Fetch tasks are pure (the same indices give the same batch), so when an actor
started with ``actor_options={"max_restarts": n}`` dies, the tasks it lost are resubmitted to the
restarted actor and nothing is lost or duplicated; without restarts the death is reported as a
:class:`LoaderActorError` naming the actor. Ray is imported only when a service is used.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshfeed.fetch import Fetcher, FetchEvents, FetchTask
from meshfeed.mesh import DataMesh
from meshfeed.services.ray_actor import _LoaderActor

__all__ = ["LoaderActorError", "RayService", "RemoteBatch"]


class LoaderActorError(RuntimeError):
    """A Ray loader actor died, could not be restarted, or stalled past the timeout."""


@dataclass(frozen=True, slots=True)
class RemoteBatch:
    """One global batch as one ``ObjectRef`` per data rank (resolve only the one you need).

    ``refs[d]`` holds data rank ``d``'s batch; ``for_rank(r)`` maps a *global* rank through the
    mesh, so tensor / context / pipeline peers of one replica group share a reference. The
    object is small and picklable: send it whole to every consumer and let each pick its own.

    >>> ray.get(remote_batch.for_rank(3))     # doctest: +SKIP  (inside the rank-3 trainer)
    """

    epoch: int
    step: int
    refs: tuple[Any, ...]
    mesh: DataMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mesh is not None and self.mesh.data_world_size != len(self.refs):
            raise ValueError(
                f"a RemoteBatch of {len(self.refs)} references does not fit the mesh "
                f"{self.mesh.sizes} with data_world_size={self.mesh.data_world_size}; build the "
                "loader and the RayService with the same mesh"
            )

    @property
    def data_world_size(self) -> int:
        return len(self.refs)

    def for_rank(self, rank: int) -> Any:
        """The reference to global rank ``rank``'s batch (``ray.get`` it where it is used).

        Without a mesh (the service was never bound to one) global ranks are data ranks.
        """
        if self.mesh is not None:
            return self.refs[self.mesh.data_rank(rank)]
        return self.for_data_rank(rank)

    def for_data_rank(self, data_rank: int) -> Any:
        """The reference to data rank ``data_rank``'s batch."""
        if isinstance(data_rank, bool) or not isinstance(data_rank, (int, np.integer)):
            raise TypeError(f"data_rank must be an int (got {data_rank!r})")
        if not 0 <= data_rank < len(self.refs):
            raise ValueError(
                f"data_rank={data_rank} is out of range for a global batch of {len(self.refs)} "
                f"data ranks; pass a data rank in [0, {len(self.refs)})"
            )
        return self.refs[int(data_rank)]


class _RemoteDataset:
    """The driver's stand-in for a dataset that lives in the loader actors."""

    def __init__(self, length: int, fingerprint: str, name: str) -> None:
        self.length, self.fingerprint, self.name = length, fingerprint, name

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        raise TypeError(
            f"the dataset built by {self.name} lives in the Ray loader actors; iterate the "
            "DataLoader to get RemoteBatch references instead of indexing it in the driver"
        )

    def __repr__(self) -> str:
        return f"RemoteDataset({self.name}, len={self.length})"


@dataclass(slots=True)
class _InFlight:
    tasks: list[FetchTask]
    actor: int
    events: Any
    batches: list[Any]
    attempts: int = 0


def _is_positive_int(value: object) -> bool:
    """``value`` is an int >= 1 (a bool is not)."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


class RayService:
    """Makes global batches in ``num_actors`` Ray actors, ``prefetch`` global steps ahead.

    A :class:`~meshfeed.protocols.GlobalService`: it makes every data rank's batch of a step
    at once (there is no per-rank ``map``); the loader dispatches on that protocol.

    Pass it to ``DataLoader(create_dataset, ..., service=RayService(...))`` with a zero-argument
    callable (a class, a function, a ``functools.partial``) that builds the dataset: it runs in
    each actor, never in the driver. ``actor_options`` go to ``ray.remote(...).options`` (e.g.
    ``{"num_cpus": 1, "max_restarts": 2}``); with ``max_restarts > 0`` a dead actor is
    restarted and its lost steps are remade. Every wait is bounded: a step by ``timeout``
    seconds, starting an actor and building its dataset by ``start_timeout`` seconds.
    Ray must be initialised (``ray.init``) before the loader is built.
    """

    def __init__(
        self,
        num_actors: int = 1,
        actor_options: Mapping[str, Any] | None = None,
        prefetch: int = 2,
        *,
        timeout: float = 300.0,
        start_timeout: float = 600.0,
    ) -> None:
        if not _is_positive_int(num_actors):
            raise ValueError(f"num_actors must be an int >= 1 (got {num_actors=!r})")
        if not _is_positive_int(prefetch):
            raise ValueError(
                f"prefetch must be an int >= 1 global batches in flight (got {prefetch=!r})"
            )
        if actor_options is not None and not isinstance(actor_options, Mapping):
            raise TypeError(
                f"actor_options must be a dict of ray actor options (got {actor_options!r}); "
                "e.g. actor_options={'num_cpus': 1, 'max_restarts': 1}"
            )
        for name, value in (("timeout", timeout), ("start_timeout", start_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be positive seconds (got {name}={value!r})")
        self.num_actors = num_actors
        self.actor_options: dict[str, Any] = dict(actor_options or {})
        restarts = self.actor_options.get("max_restarts", 0)
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < -1:
            raise ValueError(
                f"actor_options['max_restarts'] must be an int >= -1 (got {restarts!r}); "
                "-1 restarts forever, 0 never"
            )
        self.max_restarts = restarts
        self.prefetch = prefetch
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.mesh: DataMesh | None = None
        #: Steps remade on a restarted actor after their first actor died (for stats and tests).
        self.resubmitted = 0
        self._create: Callable[[], Any] | None = None
        self._proxy: _RemoteDataset | None = None
        self._actors: list[Any] = []
        self._pids: list[int] = []
        self._config: Any = None

    # ------------------------------------------------------------------ loader hooks
    def bind_mesh(self, mesh: DataMesh, *, resized: bool = False) -> None:
        """Tell the service the loader's mesh so ``RemoteBatch.for_rank`` maps global ranks;
        ``resized``: the loader it serves was resized (``DataLoader.resize``) to ``mesh``."""
        if not isinstance(mesh, DataMesh):
            raise TypeError(f"bind_mesh() takes a DataMesh (got {type(mesh).__name__})")
        if not resized and self.mesh is not None and self.mesh != mesh:
            raise ValueError(
                f"this RayService is bound to the mesh {self.mesh.sizes}, not {mesh.sizes}; "
                "use one RayService per DataLoader"
            )
        self.mesh = mesh

    def prepare(self, create_dataset: Any) -> _RemoteDataset:
        """Start the actors, build the dataset in each, and return a small driver-side proxy."""
        if self._create is not None:
            raise ValueError(
                "this RayService already serves a DataLoader; create a new RayService(...) "
                "for each DataLoader"
            )
        built = not isinstance(create_dataset, type) and isinstance(create_dataset, Sized)
        if not callable(create_dataset) or built:
            raise TypeError(
                f"RayService needs a zero-argument callable that builds the dataset inside the "
                f"actors (got {type(create_dataset).__name__}); pass e.g. the dataset class or "
                "functools.partial(MyDataset, path) instead of a built dataset"
            )
        self._create = create_dataset
        name = getattr(create_dataset, "__qualname__", None) or repr(create_dataset)
        info = self._start_actors()
        proxy = _RemoteDataset(info["length"], info["fingerprint"], str(name))
        if info["has_make_order"]:
            actor = self._actors[0]

            def make_order(**kwargs: Any) -> Any:
                return self._get(actor.make_order.remote(kwargs), 0, "make_order()")

            proxy.make_order = make_order  # type: ignore[attr-defined]
        self._proxy = proxy
        return proxy

    def start(self, fetcher: Fetcher) -> None:
        """Send the fetch configuration (not the dataset) to the actors; restart them if shut."""
        import ray

        if self._create is None:
            raise RuntimeError(
                "RayService.start() before prepare(); build the DataLoader with "
                "service=RayService(...) so that it prepares the service first"
            )
        if not self._actors:
            info = self._start_actors()
            assert self._proxy is not None
            if (info["length"], info["fingerprint"]) != (
                self._proxy.length,
                self._proxy.fingerprint,
            ):
                raise ValueError(
                    f"create_dataset() built a different dataset on restart (len "
                    f"{info['length']}, fingerprint {info['fingerprint']!r}; before: len "
                    f"{self._proxy.length}, {self._proxy.fingerprint!r}); make it deterministic"
                )
        self._config = ray.put(
            {
                "seed": fetcher.seed,
                "collate_fn": fetcher.collate_fn,
                "postprocess": fetcher.postprocess,
                "on_error": fetcher.on_error,
                "max_retries": fetcher.max_retries,
            }
        )

    def map_global(
        self, step_task_lists: Iterator[list[FetchTask]]
    ) -> Iterator[tuple[RemoteBatch, list[FetchEvents]]]:
        """Submit each step's per-rank tasks to an actor; yield ``RemoteBatch`` es in order."""
        if not self._actors or self._config is None:
            raise RuntimeError(
                "RayService.map_global() without running actors (before start(), or after "
                "shutdown() or a LoaderActorError); call loader.shutdown() and iterate again, or "
                "build a new DataLoader and load_state_dict() the last checkpoint"
            )
        source = iter(step_task_lists)
        inflight: deque[_InFlight] = deque()
        actors = itertools.cycle(range(self.num_actors))

        def submit() -> bool:
            tasks = next(source, None)
            if tasks is None:
                return False
            if self.mesh is not None and len(tasks) != self.mesh.data_world_size:
                raise ValueError(
                    f"the loader made {len(tasks)} tasks per step but the bound mesh "
                    f"{self.mesh.sizes} has data_world_size={self.mesh.data_world_size}"
                )
            job = _InFlight(tasks, next(actors), None, [])
            self._submit(job)
            inflight.append(job)
            return True

        while len(inflight) < self.prefetch and submit():
            pass
        while inflight:
            job = inflight.popleft()
            events = self._await(job)
            submit()
            task = job.tasks[0]
            yield RemoteBatch(task.epoch, task.step, tuple(job.batches), self.mesh), events

    def shutdown(self) -> None:
        """Kill the loader actors (idempotent); a later start() creates them again."""
        actors, self._actors = self._actors, []
        self._config = None
        if actors:
            import ray

            if not ray.is_initialized():
                return  # Ray is gone (e.g. interpreter teardown): so are its actors
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)

    # ------------------------------------------------------------------ internals
    def _start_actors(self) -> dict[str, Any]:
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "RayService needs a running Ray; call ray.init() (or ray.init(address='auto') "
                "on a cluster) before building the DataLoader"
            )
        options = {"max_restarts": self.max_restarts, **self.actor_options}
        cls = ray.remote(_LoaderActor).options(**options)
        self._actors = [
            cls.remote(self._create, i, self.num_actors) for i in range(self.num_actors)
        ]
        pending = [a.describe.remote() for a in self._actors]
        try:
            infos = [self._get(ref, i, "create_dataset()") for i, ref in enumerate(pending)]
        except BaseException:  # create_dataset() raised: no actor outlives the error
            self.shutdown()
            raise
        self._pids = [int(info["pid"]) for info in infos]
        first = infos[0]
        for i, info in enumerate(infos[1:], start=1):
            if (info["length"], info["fingerprint"]) != (first["length"], first["fingerprint"]):
                self.shutdown()
                raise ValueError(
                    f"loader actors built different datasets: actor 0 has len {first['length']} "
                    f"({first['fingerprint']!r}), actor {i} has len {info['length']} "
                    f"({info['fingerprint']!r}); create_dataset must be deterministic"
                )
        return first

    def _submit(self, job: _InFlight) -> None:
        actor = self._actors[job.actor]
        refs = actor.fetch_step.options(num_returns=len(job.tasks) + 1).remote(
            [self._config], job.tasks
        )
        job.events, job.batches = refs[0], list(refs[1:])

    def _describe_actor(self, index: int) -> str:
        actor = self._actors[index] if index < len(self._actors) else None
        actor_id = actor._actor_id.hex() if actor is not None else "unknown"
        pid = f", pid {self._pids[index]}" if index < len(self._pids) else ""
        return f"Ray loader actor {index} of {self.num_actors} (actor id {actor_id}{pid})"

    def _get(self, ref: Any, index: int, what: str) -> Any:
        """``ray.get`` of a start-up call (actor creation, ``create_dataset``, ``make_order``)."""
        import ray

        timeout = self.start_timeout
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            described = self._describe_actor(index)
            self.shutdown()
            raise LoaderActorError(
                f"{described} did not finish {what} within start_timeout={timeout}s; raise "
                "RayService(start_timeout=...) if building the dataset legitimately takes longer"
            ) from None
        except ray.exceptions.RayActorError as exc:
            described = self._describe_actor(index)
            self.shutdown()
            raise LoaderActorError(f"{described} died during {what}: {exc}") from exc

    def _await(self, job: _InFlight) -> list[FetchEvents]:
        """The step's events once its batches exist; remakes the step if its actor restarted."""
        import ray

        task = job.tasks[0]
        what = f"step {task.step} of epoch {task.epoch}"
        while True:
            try:
                events: list[FetchEvents] = ray.get(job.events, timeout=self.timeout)
                return events
            except ray.exceptions.GetTimeoutError:
                described = self._describe_actor(job.actor)
                self.shutdown()
                raise LoaderActorError(
                    f"{described} produced nothing for {what} within timeout={self.timeout}s; "
                    "the dataset may be stuck on I/O. Raise RayService(timeout=...) if single "
                    "steps legitimately take longer"
                ) from None
            except ray.exceptions.RayActorError as exc:
                described = self._describe_actor(job.actor)
                limit = self.max_restarts if self.max_restarts >= 0 else 16
                if job.attempts >= limit or not self._wait_alive(job.actor):
                    self.shutdown()
                    hint = (
                        "it was not restarted: pass RayService(actor_options={'max_restarts': 1}) "
                        "to restart dead actors automatically"
                        if self.max_restarts == 0
                        else f"it died {job.attempts + 1} time(s) on this step or could not be "
                        f"restarted (max_restarts={self.max_restarts})"
                    )
                    raise LoaderActorError(
                        f"{described} died while making {what}; {hint}. Batches up to the last "
                        "one delivered are intact: resume from loader.state_dict() "
                        f"(cause: {type(exc).__name__}: {exc})"
                    ) from exc
                job.attempts += 1
                self.resubmitted += 1
                self._submit(job)  # tasks are pure: the remade step is the lost one

    def _wait_alive(self, index: int) -> bool:
        """Whether actor ``index`` answers again (Ray restarts it) within ``start_timeout``."""
        import ray

        deadline = time.monotonic() + self.start_timeout  # a restart rebuilds the dataset
        delay = 0.05
        while time.monotonic() < deadline:
            try:
                remaining = max(0.1, deadline - time.monotonic())
                self._pids[index] = int(
                    ray.get(self._actors[index].ping.remote(), timeout=remaining)
                )
                return True
            except ray.exceptions.ActorUnavailableError:
                time.sleep(delay)  # restarting: Ray reports it unavailable for a moment
                delay = min(delay * 2, 1.0)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False
        return False
