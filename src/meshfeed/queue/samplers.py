"""Samplers: which ready samples one ``SampleStore.get`` hands out, and to whom.

A sampler is a small, picklable policy object (it travels to the Ray actor with each call);
all state (consumption, the shared-batch cache) lives in the store. ``select`` sees the samples
that are ready for the task, in production order, and returns the batch as one or more
*parts*, or ``None`` to wait for more. ``share`` says whether several callers read the same
selection: the first caller for a key selects and consumes, the others read the cached plan, and the
cache entry is dropped once all ``readers`` have read it, so the cache stays bounded.

- :class:`SequentialSampler`: the first ``batch_size`` ready samples.
- :class:`GroupSampler`: whole groups only (GRPO: ``group_size`` responses per prompt).
- :class:`RankAwareSampler`: the ranks of one data-replica group get the same batch for the
  same ``(task, data rank, batch_index)``.
- :class:`LengthBalancedSampler`: one global batch split across data ranks with balanced token
  totals (Karmarkar-Karp), groups kept whole.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol, runtime_checkable

from meshfeed.queue.rounds import Round

Key = Hashable

__all__ = [
    "GroupSampler",
    "LengthBalancedSampler",
    "RankAwareSampler",
    "ReadyView",
    "Round",
    "Sampler",
    "SequentialSampler",
    "Share",
    "karmarkar_karp",
]


class ReadyView(Protocol):
    """What a sampler may look at: the samples ready for the calling task."""

    @property
    def closed(self) -> bool: ...

    def ready(self) -> Iterator[Key]: ...

    def group(self, key: Key) -> Hashable | None: ...

    def value(self, key: Key, field: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class Share:
    """Callers with the same ``key`` read one plan; ``reader`` reads ``parts[part]``."""

    key: tuple[Any, ...]
    reader: int
    readers: int
    part: int


@runtime_checkable
class Sampler(Protocol):
    """The policy protocol ``SampleStore.get`` calls (under the store's lock)."""

    @property
    def extra_fields(self) -> tuple[str, ...]: ...

    def share(self, context: Mapping[str, Any]) -> Share | None: ...

    def select(self, view: ReadyView, batch_size: int) -> Sequence[list[Key]] | None: ...


def _batch_index(context: Mapping[str, Any], who: str) -> int:
    index = context.get("batch_index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(
            f"{who} needs batch_index=<int >= 0> in get(...) (got batch_index={index!r}); "
            "every replica member passes the same index for the same step"
        )
    return index


def _place(mesh: Any, rank: int) -> dict[str, int]:
    """Global ``rank``'s place on ``mesh``: its data and replica ranks, and their sizes."""
    group = mesh.replica_group(rank)
    return {
        "data_rank": mesh.data_rank(rank),
        "data_world_size": mesh.data_world_size,
        "replica_rank": group.index(rank),
        "replica_size": len(group),
    }


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low} (got {name}={value!r})")


@dataclass(frozen=True, kw_only=True, slots=True)
class SequentialSampler:
    """The first ``batch_size`` ready samples in production order (a shorter last batch
    once the partition is closed)."""

    extra_fields: tuple[str, ...] = ()

    def share(self, context: Mapping[str, Any]) -> Share | None:
        return None

    def select(self, view: ReadyView, batch_size: int) -> list[list[Key]] | None:
        ids = list(islice(view.ready(), batch_size))
        return [ids] if len(ids) == batch_size or (view.closed and ids) else None


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSampler:
    """Whole groups only: ``batch_size // group_size`` groups whose members are all ready.

    By default samples carry an explicit group id (``put(..., groups=...)``); a group is
    handed out once all ``group_size`` members are ready, and never split. Groups still
    incomplete when the partition closes are never handed out.

    ``consecutive_ids=True`` is TransferQueue's ``GRPOGroupNSampler`` rule instead, so a
    producer written for it works unchanged: no group ids; the ready (int) ids are sorted
    and scanned with a window of ``group_size``: a window of consecutive ids
    (``last - first == group_size - 1``) is a group and the scan jumps past it, otherwise it
    moves by one id. Ready ``[0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11]`` with ``group_size=3`` gives
    ``[0, 1, 2]``, ``[3, 4, 5]``, ``[9, 10, 11]``. Prefer explicit ids: with this rule two
    half-ready prompts whose ids touch can be taken for one group.
    """

    group_size: int
    extra_fields: tuple[str, ...] = ()
    consecutive_ids: bool = False

    def __post_init__(self) -> None:
        _check_int("group_size", self.group_size, 1)
        if not isinstance(self.consecutive_ids, bool):
            raise TypeError(f"consecutive_ids must be True or False (got {self.consecutive_ids!r})")

    def share(self, context: Mapping[str, Any]) -> Share | None:
        return None

    def complete_groups(self, view: ReadyView, limit: int | None) -> list[list[Key]]:
        """Complete groups in order of completion, at most ``limit`` of them."""
        if self.consecutive_ids:
            return self._consecutive_groups(view, limit)
        buckets: dict[Hashable, list[Key]] = {}
        done: list[list[Key]] = []
        for key in view.ready():
            gid = view.group(key)
            if gid is None:
                raise ValueError(
                    f"sample {key!r} has no group id but the sampler hands out whole groups; "
                    "put it with groups=[...]"
                )
            bucket = buckets.setdefault(gid, [])
            bucket.append(key)
            if len(bucket) > self.group_size:
                raise ValueError(
                    f"group {gid!r} has more than group_size={self.group_size} ready samples "
                    f"({bucket}); give each group exactly group_size samples"
                )
            if len(bucket) == self.group_size:
                done.append(bucket)
                if limit is not None and len(done) == limit:
                    break
        return done

    def _consecutive_groups(self, view: ReadyView, limit: int | None) -> list[list[Key]]:
        ready = list(view.ready())
        bad = [k for k in ready if type(k) is not int]
        if bad:
            raise ValueError(
                f"GroupSampler(consecutive_ids=True) groups int ids, but ready ids include "
                f"{bad[:5]}; put with ids=None or int ids, or use explicit groups=[...]"
            )
        ids = sorted(ready)  # type: ignore[type-var]
        n, i = self.group_size, 0
        done: list[list[Key]] = []
        while i + n <= len(ids) and (limit is None or len(done) < limit):
            if ids[i + n - 1] - ids[i] == n - 1:  # type: ignore[operator]
                done.append(ids[i : i + n])
                i += n
            else:
                i += 1
        return done

    def select(self, view: ReadyView, batch_size: int) -> list[list[Key]] | None:
        if batch_size % self.group_size:
            raise ValueError(
                f"batch_size={batch_size} is not a multiple of group_size={self.group_size}; "
                "a batch holds whole groups"
            )
        want = batch_size // self.group_size
        groups = self.complete_groups(view, want)
        if len(groups) == want or (view.closed and groups):
            return [[k for g in groups for k in g]]
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class RankAwareSampler:
    """The ranks of one data-replica group receive the same batch.

    The first member asking for ``(task, data_rank, stream, batch_index)`` plans it with
    ``inner``; the other ``replica_size - 1`` members read the cached plan. Asking again for
    the same ``batch_index`` returns the same batch (a retry after a timeout or a lost reply is
    safe, as in TransferQueue); a plan is dropped once every reader asked for a later index. Build it with :meth:`from_mesh` and pass ``batch_index=`` (and ``stream=``, default
    0, when one rank reads several independent streams) to ``get``.

    With ``data_world_size=D > 1`` (what :meth:`from_mesh` sets) batch ``batch_index`` is one
    *round* planned once for all data ranks: ``D * batch_size`` samples split into ``D``
    contiguous parts, so every data rank gets a batch at the same index or none does, and all
    data ranks end at the same step. Rule for the last round after ``close``: ``n`` leftover
    units (samples, or whole groups with a :class:`GroupSampler`) are split as evenly as
    possible (part sizes differ by at most one unit) when ``n >= D``; when ``n < D`` they are
    not handed out (they stay unconsumed in the store) so that no data rank gets an empty batch.
    """

    data_rank: int
    replica_rank: int = 0
    replica_size: int = 1
    data_world_size: int = 1
    inner: Sampler = SequentialSampler()

    def __post_init__(self) -> None:
        _check_int("data_rank", self.data_rank, 0)
        _check_int("replica_size", self.replica_size, 1)
        _check_int("replica_rank", self.replica_rank, 0)
        _check_int("data_world_size", self.data_world_size, 1)
        if self.replica_rank >= self.replica_size:
            raise ValueError(
                f"replica_rank={self.replica_rank} must be < replica_size={self.replica_size}"
            )
        if self.data_rank >= self.data_world_size > 1:
            raise ValueError(
                f"data_rank={self.data_rank} must be < data_world_size={self.data_world_size}"
            )

    @classmethod
    def from_mesh(cls, mesh: Any, rank: int, inner: Sampler | None = None) -> RankAwareSampler:
        """The sampler for global ``rank`` of a :class:`meshfeed.DataMesh`."""
        return cls(**_place(mesh, rank), inner=inner if inner is not None else SequentialSampler())

    @property
    def extra_fields(self) -> tuple[str, ...]:
        return self.inner.extra_fields

    def share(self, context: Mapping[str, Any]) -> Share | None:
        index = _batch_index(context, "RankAwareSampler")
        stream = context.get("stream", 0)
        if self.data_world_size == 1:  # the key names the data rank: only replicas share it
            key = ("rank", self.data_rank, stream, index)
            return Share(key=key, reader=self.replica_rank, readers=self.replica_size, part=0)
        return Share(
            key=("round", stream, index),
            reader=self.data_rank * self.replica_size + self.replica_rank,
            readers=self.data_world_size * self.replica_size,
            part=self.data_rank,
        )

    def select(self, view: ReadyView, batch_size: int) -> Sequence[list[Key]] | None:
        d = self.data_world_size
        if d == 1:
            return self.inner.select(view, batch_size)
        planned = self.inner.select(view, batch_size * d)
        if not planned or not planned[0]:
            return None
        ids = planned[0]
        # Whole groups come consecutive in the plan, group_size samples each.
        size = self.inner.group_size if isinstance(self.inner, GroupSampler) else 1
        if -(-len(ids) // size) < d:
            return None  # fewer units than data ranks: some rank would get an empty batch
        return Round(ids, d, size)  # one id list and the rule: no list per data rank


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthBalancedSampler:
    """One global batch of ``batch_size * data_world_size`` samples split across data ranks.

    Units (whole groups of ``group_size``, or single samples) are assigned with equal-count
    Karmarkar-Karp on their token totals (``length_field``: an int, or anything with ``len``),
    so every data rank gets ``batch_size`` samples and the token totals are close. All
    ``data_world_size * replica_size`` ranks read one cached plan per ``batch_index``. After
    close, a leftover batch with fewer units than data ranks is dropped so no rank gets an
    empty batch.
    """

    length_field: str
    data_rank: int
    data_world_size: int
    replica_rank: int = 0
    replica_size: int = 1
    group_size: int = 1

    def __post_init__(self) -> None:
        _check_int("data_world_size", self.data_world_size, 1)
        _check_int("replica_size", self.replica_size, 1)
        _check_int("group_size", self.group_size, 1)
        _check_int("data_rank", self.data_rank, 0)
        _check_int("replica_rank", self.replica_rank, 0)
        if self.data_rank >= self.data_world_size or self.replica_rank >= self.replica_size:
            raise ValueError(
                f"data_rank={self.data_rank} must be < data_world_size={self.data_world_size} "
                f"and replica_rank={self.replica_rank} < replica_size={self.replica_size}"
            )
        if not isinstance(self.length_field, str) or not self.length_field:
            raise ValueError(f"length_field must be a field name (got {self.length_field!r})")

    @classmethod
    def from_mesh(
        cls, mesh: Any, rank: int, *, length_field: str, group_size: int = 1
    ) -> LengthBalancedSampler:
        return cls(length_field=length_field, group_size=group_size, **_place(mesh, rank))

    @property
    def extra_fields(self) -> tuple[str, ...]:
        return (self.length_field,)

    def share(self, context: Mapping[str, Any]) -> Share | None:
        index = _batch_index(context, "LengthBalancedSampler")
        return Share(
            key=("balanced", index),
            reader=self.data_rank * self.replica_size + self.replica_rank,
            readers=self.data_world_size * self.replica_size,
            part=self.data_rank,
        )

    def _length(self, view: ReadyView, key: Key) -> int:
        value = view.value(key, self.length_field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            return int(value.item())
        try:
            return len(value)
        except TypeError:
            raise ValueError(
                f"length field {self.length_field!r} of sample {key!r} is {type(value).__name__}; "
                "store an int token count or a sequence of tokens"
            ) from None

    def select(self, view: ReadyView, batch_size: int) -> list[list[Key]] | None:
        if batch_size % self.group_size:
            raise ValueError(
                f"batch_size={batch_size} is not a multiple of group_size={self.group_size}; "
                "each data rank receives whole groups"
            )
        want = self.data_world_size * batch_size // self.group_size
        if self.group_size == 1:  # single samples need no group id
            units = [[key] for key in islice(view.ready(), want)]
        else:
            units = GroupSampler(group_size=self.group_size).complete_groups(view, want)
        if len(units) < want and not (view.closed and len(units) >= self.data_world_size):
            return None
        weights = [sum(self._length(view, k) for k in unit) for unit in units]
        equal = len(units) % self.data_world_size == 0
        parts = karmarkar_karp(weights, self.data_world_size, equal_size=equal)
        return [[k for u in sorted(part) for k in units[u]] for part in parts]


def karmarkar_karp(
    weights: Sequence[float], k: int, *, equal_size: bool = False
) -> list[list[int]]:
    """Split indices of ``weights`` into ``k`` parts with close sums (largest differencing).

    With ``equal_size`` every part gets ``len(weights) // k`` items (``len`` must divide by
    ``k``). Deterministic: ties break on insertion order. Parts come back sorted by their
    smallest index. Cost O(n log n * k).
    """
    n = len(weights)
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k=})")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(weights) divisible by k (got {n=}, {k=})")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    counter = 0

    def push(parts: list[tuple[float, list[int]]]) -> None:
        nonlocal counter
        # Ties in the sum put fuller parts first, so empty parts always sort last and are
        # paired with the other side's largest: with zero weights a plain list tie-break put
        # an empty part before a zero-sum one and left parts empty although n >= k.
        parts.sort(key=lambda p: (-p[0], -len(p[1]), p[1]))
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), counter, parts))
        counter += 1

    if equal_size:
        for off in range(0, n, k):
            push([(float(weights[i]), [i]) for i in order[off : off + k]])
    else:
        for i in order:
            push([(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        push([(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)])
    parts = [sorted(items) for _, items in heap[0][2]]
    return sorted(parts, key=lambda p: (p[0] if p else n, len(p)))


def mesh_sampler(sampler: Any, mesh: Any, rank: int) -> Any:
    """The sampler a loader at global ``rank`` of ``mesh`` reads with (one rule for every door).

    None: a :class:`RankAwareSampler` over a :class:`SequentialSampler`. A plain
    :class:`SequentialSampler` or :class:`GroupSampler` is wrapped in a
    :class:`RankAwareSampler` for this rank, so every data rank gets a batch at every index or
    none does (groups stay whole), and every batch is a plan the store keeps by its index until
    the loader has passed it: a loader's state then names an index, never sample ids. A
    rank-aware sampler must describe this rank of this mesh. Any other sampler is wrapped too
    on a mesh of one rank; on a mesh of several it is refused: planned independently per rank,
    data ranks would get different numbers of batches and a training step's collective would
    hang.
    """
    facts = _place(mesh, rank)
    if sampler is None or isinstance(sampler, (SequentialSampler, GroupSampler)):
        return RankAwareSampler.from_mesh(mesh, rank, inner=sampler)  # None: sequential
    if isinstance(sampler, (RankAwareSampler, LengthBalancedSampler)):
        theirs = {k: getattr(sampler, k) for k in facts}
        if theirs != facts:
            raise ValueError(
                f"sampler={type(sampler).__name__} describes {theirs}, but this loader is "
                f"global rank {rank} of the mesh, which is {facts}; build it with "
                f"{type(sampler).__name__}.from_mesh(mesh, rank, ...) for this rank"
            )
        return sampler
    if facts["data_world_size"] == 1 and facts["replica_size"] == 1:
        return RankAwareSampler.from_mesh(mesh, rank, inner=sampler)
    raise ValueError(
        f"sampler={type(sampler).__name__} plans each rank on its own, so on a mesh of "
        f"{facts['data_world_size']} data rank(s) x {facts['replica_size']} replica(s) the "
        "ranks would get different numbers of batches (a hang at the next collective); pass "
        "a SequentialSampler or GroupSampler (wrapped rank-aware for you), or build "
        "RankAwareSampler.from_mesh(mesh, rank, inner=...) / LengthBalancedSampler.from_mesh"
    )
