"""StreamingDataLoader: a per-rank iterator over a :class:`SampleStore` for a training loop.

The mesh is touched here only: the loader turns ``(mesh, rank)`` into a data rank and a replica
group, and (unless given another sampler) reads with a :class:`RankAwareSampler`, so tensor /
context / pipeline peers of one data rank receive identical batches while data ranks receive
disjoint ones. Batch ``j`` of stream ``w`` is the store's shared key ``(data rank, w, j)``.

With ``num_workers=W`` the loader runs W fetching threads, worker ``w`` reading its own stream
``w`` (keys ``(data rank, w, 0), (data rank, w, 1), ...``) and the loader yielding round-robin
over the streams. Each batch is consumed once in the store, so no two workers (and no two
data ranks) ever get the same sample; replica peers must use the same ``num_workers``. The
iterator ends when the partition is closed and drained for every stream.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from meshfeed.mesh import DataMesh, default_rank, resolve_mesh
from meshfeed.queue.core import PartitionClosed
from meshfeed.queue.samplers import RankAwareSampler, Sampler
from meshfeed.queue.store import Batch, SampleStore

_DONE = object()


class StreamingDataLoader:
    """Iterate batches of ``fields`` for ``task`` from ``partition``, as global ``rank`` of
    ``mesh`` (a :class:`DataMesh`, ``DeviceMesh``, dict of axis sizes, or ``None`` for the
    torchrun world).

    ``timeout`` bounds each wait for a batch (``TimeoutError``). ``state_dict()`` records the
    position of every stream (restore the store with ``SampleStore.load`` or
    ``load_state_dict``); it is available with ``num_workers=0``, because batches prefetched by
    workers are already consumed in the store.
    """

    def __init__(
        self,
        store: SampleStore,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        partition: str,
        mesh: Any = None,
        rank: int | None = None,
        *,
        sampler: Sampler | None = None,
        timeout: float | None = None,
        num_workers: int = 0,
        prefetch: int = 2,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int (got {batch_size=!r})")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0 (got {num_workers=!r})")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1 (got {prefetch=!r})")
        self.mesh: DataMesh = resolve_mesh(mesh)
        self.rank = default_rank() if rank is None else rank
        self.data_rank = self.mesh.data_rank(self.rank)
        self.replica_group = self.mesh.replica_group(self.rank)
        self.sampler = (
            sampler if sampler is not None else RankAwareSampler.from_mesh(self.mesh, self.rank)
        )
        self.store, self.task, self.fields = store, task, list(fields)
        self.batch_size, self.partition, self.timeout = batch_size, partition, timeout
        self.num_workers, self.prefetch = num_workers, prefetch
        streams = max(1, num_workers)
        self._index = [0] * streams  # next batch index per stream
        self._turn = 0  # the stream the next batch comes from
        self._done = [False] * streams
        self._queues: list[queue.Queue[Any]] | None = None

    def _fetch(self, stream: int, index: int) -> Batch | None:
        try:
            return self.store.get(
                self.task,
                self.fields,
                self.batch_size,
                self.partition,
                self.sampler,
                self.timeout,
                batch_index=index,
                stream=stream,
            )
        except PartitionClosed:
            return None

    def _worker(self, stream: int, out: queue.Queue[Any]) -> None:
        index = self._index[stream]
        while True:
            try:
                batch = self._fetch(stream, index)
            except BaseException as exc:  # handed to the consumer, which re-raises
                out.put(exc)
                return
            out.put(_DONE if batch is None else batch)
            if batch is None:
                return
            index += 1

    def _start(self) -> list[queue.Queue[Any]]:
        if self._queues is None:
            self._queues = []
            for w in range(self.num_workers):
                q: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
                if not self._done[w]:
                    threading.Thread(target=self._worker, args=(w, q), daemon=True).start()
                self._queues.append(q)
        return self._queues

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        streams = len(self._index)
        for _ in range(streams):
            w = self._turn
            self._turn = (w + 1) % streams
            if self._done[w]:
                continue
            if self.num_workers == 0:
                item: Any = self._fetch(w, self._index[w])
                item = _DONE if item is None else item
            else:
                # The worker's own get is bounded by self.timeout; its result always arrives.
                item = self._start()[w].get()
            if isinstance(item, BaseException):
                self._done[w] = True
                raise item
            if item is _DONE:
                self._done[w] = True
                continue
            self._index[w] += 1
            return item
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        """The position of every stream, as of the last batch returned.

        Raises ``ValueError`` once worker threads run: batches they prefetched are consumed in
        the store but not yet returned, so a checkpoint now would lose them.
        """
        if self._queues is not None:
            raise ValueError(
                "state_dict() with num_workers > 0 after iteration started would lose the "
                "batches workers prefetched; checkpoint a loader with num_workers=0"
            )
        return {
            "version": 1,
            "task": self.task,
            "partition": self.partition,
            "data_rank": self.data_rank,
            "index": list(self._index),
            "turn": self._turn,
            "done": list(self._done),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the store must be restored to the same moment."""
        if state.get("version") != 1:
            raise ValueError(
                f"loader state version {state.get('version')!r} is not 1; use a state of this meshfeed"
            )
        if len(state["index"]) != len(self._index):
            raise ValueError(
                f"the state has {len(state['index'])} streams but this loader has "
                f"{len(self._index)} (num_workers={self.num_workers}); resume with the same num_workers"
            )
        if self._queues is not None:
            raise ValueError(
                "load_state_dict must come before iteration starts; build a fresh loader"
            )
        self._index = [int(i) for i in state["index"]]
        self._turn = int(state["turn"])
        self._done = [bool(d) for d in state["done"]]
