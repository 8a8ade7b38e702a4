"""DataMesh: the one place that turns a device mesh into plain data-parallel integers.

Every other part of meshfeed takes plain ints (data rank, data world size, replica group);
only this module knows about axis names, ``DeviceMesh`` objects or the torchrun environment.

>>> mesh = DataMesh.from_sizes(dp=2, tp=2)
>>> mesh.world_size, mesh.data_world_size
(4, 2)
>>> [mesh.data_rank(r) for r in range(4)]
[0, 0, 1, 1]
>>> mesh.replica_group(2)
[2, 3]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.distributed as dist

from meshfeed.dist import is_initialized

#: Outermost first; the last axis varies fastest across consecutive global ranks
#: (the torchtitan / Megatron convention: tensor parallel peers are neighbours).
DEFAULT_AXIS_ORDER: tuple[str, ...] = (
    "pp",
    "dp_replicate",
    "dp",
    "dp_shard",
    "fsdp",
    "ep",
    "cp",
    "tp",
)

#: The largest world a mesh plans. A mesh of axis sizes is arithmetic (no per-rank table: a
#: rank's coordinates, data rank and replica group cost the same at 8 ranks and at 8 million,
#: #32); one built from a ``DeviceMesh`` keeps torch's rank table (8 bytes per rank) and its
#: inverse. The largest training jobs run about 10**6 ranks; a bigger size is a typo
#: (``dp=10**8``) or a unit mix-up.
MAX_WORLD_SIZE = 2**24

#: Other projects' names for their data-parallel ``DeviceMesh`` dims: torch's HSDP mesh
#: (``"replicate"``, ``"shard"``) and torchtitan's data-loading mesh (``"batch"``).
DATA_AXIS_ALIASES: tuple[str, ...] = ("replicate", "shard", "batch")

#: Axes whose ranks see different data. Every other axis replicates the data. Expert parallel
#: (``ep``) is carved out of data parallel (Megatron-LM, torchtitan): its ranks read different
#: data, so ``from_sizes(dp=2, ep=4)`` has 8 data ranks.
DEFAULT_DATA_AXES: frozenset[str] = frozenset(
    {"dp", "fsdp", "dp_replicate", "dp_shard", "ep", *DATA_AXIS_ALIASES}
)

#: Every axis name meshfeed knows what to do with: the laid-out axes and the data aliases.
KNOWN_AXES: frozenset[str] = frozenset(DEFAULT_AXIS_ORDER) | DEFAULT_DATA_AXES


@dataclass(frozen=True, kw_only=True, slots=True)
class DataMesh:
    """A device mesh reduced to what data loading needs.

    ``axis_names`` and ``axis_sizes`` describe the mesh outermost first; ``ranks`` maps mesh
    coordinates to global ranks (None: row-major, computed, no table; a ``DeviceMesh``'s own
    table otherwise). ``data_axes`` shard the data, every other axis replicates it, and
    ``ulysses=k`` folds k consecutive data ranks into one (sequence parallelism that splits one
    sample across ranks).
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    data_axes: frozenset[str] = DEFAULT_DATA_AXES
    ulysses: int = 1
    ranks: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: For a custom ``ranks`` table: the position in it of each global rank (its inverse).
    _position_of: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._check_axes()
        self._check_world_size()
        self._check_data_axes()
        self._set_ranks()
        self._check_ulysses()

    def _check_axes(self) -> None:
        """One size per axis, each name once, each size an integer >= 1."""
        if len(self.axis_names) != len(self.axis_sizes):
            raise ValueError(
                f"axis_names and axis_sizes differ in length ({self.axis_names=}, "
                f"{self.axis_sizes=}); give one size per axis"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"axis names repeat ({self.axis_names=}); name each axis once")
        for name, size in zip(self.axis_names, self.axis_sizes, strict=True):
            _check_size(name, size)

    def _check_world_size(self) -> None:
        """At most :data:`MAX_WORLD_SIZE` ranks."""
        world = math.prod(int(s) for s in self.axis_sizes)
        if world > MAX_WORLD_SIZE:
            raise ValueError(
                f"the mesh {self.sizes} has {world} ranks, more than meshfeed plans "
                f"(MAX_WORLD_SIZE = 2**24 = {MAX_WORLD_SIZE}: larger than any training job, so "
                "likely a typo or a unit mix-up); check the axis sizes"
            )

    def _check_data_axes(self) -> None:
        """``data_axes`` is a collection (not a string) of axes of this mesh or of
        :data:`KNOWN_AXES`."""
        _check_not_str("data_axes", self.data_axes)
        unknown = set(self.data_axes) - set(self.axis_names) - KNOWN_AXES
        if unknown:
            raise ValueError(
                f"data_axes names unknown axes {sorted(unknown)} (mesh axes: "
                f"{list(self.axis_names)}); name axes of the mesh"
            )

    def _set_ranks(self) -> None:
        """Check a given rank table holds each global rank once and keep its inverse; without
        one the layout is row-major and nothing is stored (O(1) memory in the world size)."""
        if self.ranks is None:
            return
        ranks = np.asarray(self.ranks, dtype=np.int64).reshape(self.axis_sizes)
        flat = ranks.ravel()
        position = np.full(flat.size, -1, dtype=np.int64)
        inside = (flat >= 0) & (flat < flat.size)
        position[flat[inside]] = np.arange(flat.size, dtype=np.int64)[inside]
        if not inside.all() or (position < 0).any():
            raise ValueError(
                f"the mesh must hold each of the global ranks 0..{flat.size - 1} once; "
                "build it from the DeviceMesh of the whole world"
            )
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_position_of", position)

    def _check_ulysses(self) -> None:
        """``ulysses`` is a positive int dividing the data-sharding size."""
        raw = self._raw_data_world_size()
        names = [n for n in self.axis_names if n in self.data_axes]
        u = self.ulysses
        if isinstance(u, bool) or not isinstance(u, int) or u < 1 or raw % u:
            raise ValueError(
                f"ulysses={self.ulysses!r} must be a positive divisor of the data-sharding size "
                f"{raw} (axes {names}); choose ulysses from "
                f"{[k for k in range(1, raw + 1) if raw % k == 0]}"
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_sizes(
        cls,
        *,
        order: Iterable[str] | None = None,
        data_axes: Iterable[str] | None = None,
        ulysses: int = 1,
        world_size: int | None = None,
        **sizes: int,
    ) -> DataMesh:
        """Build a mesh from axis sizes, e.g. ``DataMesh.from_sizes(dp=4, tp=2)``.

        Axes are laid out in ``order`` (default :data:`DEFAULT_AXIS_ORDER`, tensor parallel
        innermost). Axes not in the default order are allowed when ``order`` names them.
        ``world_size``, when given, must equal the product of the sizes.
        """
        names, axis_sizes = _axis_layout(order, sizes)
        mesh = cls(
            axis_names=names,
            axis_sizes=axis_sizes,
            data_axes=_data_axes(data_axes),
            ulysses=ulysses,
        )
        if world_size is not None and mesh.world_size != world_size:
            raise ValueError(
                f"mesh sizes {mesh.sizes} multiply to {mesh.world_size}, but the world size is "
                f"{world_size}; make the product of the axis sizes equal the number of processes"
            )
        return mesh

    @classmethod
    def from_device_mesh(
        cls,
        device_mesh: Any,
        *,
        data_axes: Iterable[str] | None = None,
        ulysses: int = 1,
    ) -> DataMesh:
        """Build from a ``torch.distributed.device_mesh.DeviceMesh`` with named dims.

        Without ``data_axes``, every dim is an axis meshfeed knows (:data:`KNOWN_AXES`: torch's
        HSDP ``replicate`` / ``shard`` and torchtitan's ``batch`` are data axes): an unknown
        dim is refused, since it may be data parallel. With ``data_axes``, those dims shard the
        data and every other dim replicates it (a ``("dp", "sp")`` mesh with
        ``data_axes=["dp"]``: sequence-parallel peers read the same samples). The mesh is the root mesh, holding every
        rank of the world (a sub-mesh such as ``world_mesh["dp"]`` is refused).
        """
        names = getattr(device_mesh, "mesh_dim_names", None)
        if not names:
            raise ValueError(
                "the DeviceMesh has no mesh_dim_names; create it with "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp', ...))"
            )
        names = tuple(names)
        axes = _data_axes(data_axes)
        if data_axes is None:  # named: every other dim replicates, as the caller says
            _check_dim_names(names)
        ranks = np.asarray(device_mesh.mesh.cpu().numpy(), dtype=np.int64)
        _check_root_mesh(names, ranks)
        return cls(
            axis_names=names,
            axis_sizes=tuple(int(s) for s in ranks.shape),
            data_axes=axes,
            ulysses=ulysses,
            ranks=ranks,
        )

    @classmethod
    def from_env(
        cls,
        *,
        env: Mapping[str, str] | None = None,
        data_axes: Iterable[str] | None = None,
        ulysses: int = 1,
        **sizes: int,
    ) -> DataMesh:
        """Build from the torchrun environment (``WORLD_SIZE``).

        With no sizes it is pure data parallel. Given the non-data axes (``tp=2``), the ``dp``
        axis takes the rest of the world. Each size is checked (an integer >= 1 of a known
        axis) before any arithmetic.
        """
        env = os.environ if env is None else env
        world = _env_world_size(env)
        _check_env_sizes(sizes)
        if "dp" not in sizes:
            rest = math.prod(sizes.values()) if sizes else 1
            if world % rest:
                raise ValueError(
                    f"WORLD_SIZE={world} is not divisible by the product {rest} of {sizes}; "
                    "make the axis sizes divide the number of processes"
                )
            sizes = {"dp": world // rest, **sizes}
        axis_sizes: dict[str, Any] = {k: int(v) for k, v in sizes.items()}
        return cls.from_sizes(world_size=world, data_axes=data_axes, ulysses=ulysses, **axis_sizes)

    def rescaled(self, world_size: int) -> DataMesh:
        """This mesh on ``world_size`` ranks: the non-data axes (``tp``, ``pp``, ``cp``, ...)
        kept, the one data axis taking the rest (what ``loader.resize()`` without a mesh moves
        to). Refused, asking for the new mesh, where that is not one layout: a mesh with its
        own rank table (from a ``DeviceMesh``), with several data axes or none, or a world the
        kept axes do not divide.

        >>> DataMesh.from_sizes(dp=2, tp=2).rescaled(8).sizes
        {'dp': 4, 'tp': 2}
        """
        fix = "pass the new mesh: loader.resize(mesh) with a DataMesh, a DeviceMesh or a dict"
        if self.ranks is not None:
            raise ValueError(
                f"the mesh {self.sizes} has its own rank table (it came from a DeviceMesh), so "
                f"its layout on {world_size} ranks cannot be guessed; {fix}"
            )
        data = [n for n in self.axis_names if n in self.data_axes]
        if len(data) != 1:
            raise ValueError(
                f"the mesh {self.sizes} has {len(data)} data axes {data}, not one to take the "
                f"{world_size} ranks; {fix} of axis sizes"
            )
        kept = {n: s for n, s in self.sizes.items() if n not in self.data_axes}
        rest = math.prod(kept.values())
        if world_size % rest:
            raise ValueError(
                f"the new world of {world_size} ranks is not divisible by {rest}, the product "
                f"of the mesh's non-data axes {kept} (which a resize without a mesh keeps); "
                f"run on a multiple of {rest} ranks, or {fix} of axis sizes"
            )
        sizes = tuple(world_size // rest if n in data else s for n, s in self.sizes.items())
        return DataMesh(
            axis_names=self.axis_names,
            axis_sizes=sizes,
            data_axes=self.data_axes,
            ulysses=self.ulysses,
        )

    # ----------------------------------------------------------------- queries
    @property
    def world_size(self) -> int:
        return math.prod(self.axis_sizes)

    @property
    def data_world_size(self) -> int:
        """How many distinct data shards there are (after Ulysses folding)."""
        return self._raw_data_world_size() // self.ulysses

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis."""
        self._check_rank(rank)
        return dict(zip(self.axis_names, self._coords(int(rank)), strict=True))

    def data_rank(self, rank: int) -> int:
        """Which data shard ``rank`` reads: data axes flattened row-major, then Ulysses-folded."""
        self._check_rank(rank)
        c = self._coords(int(rank))
        flat = 0
        for i, name in enumerate(self.axis_names):
            if name in self.data_axes:
                flat = flat * self.axis_sizes[i] + c[i]
        return flat // self.ulysses

    def replica_group(self, rank: int) -> list[int]:
        """The global ranks (sorted, including ``rank``) that receive the same data as ``rank``.

        Cost: the size of the group (the product of the replicating axes, times ``ulysses``),
        not the world.
        """
        mine, u = self.data_rank(rank), self.ulysses
        sizes = self.axis_sizes
        data = [i for i, n in enumerate(self.axis_names) if n in self.data_axes]
        other = [i for i, n in enumerate(self.axis_names) if n not in self.data_axes]
        m = math.prod(sizes[i] for i in other)
        raw = np.arange(mine * u, (mine + 1) * u, dtype=np.int64)  # the folded data coordinates
        coords: list[Any] = [None] * len(sizes)
        if data:
            for i, c in zip(data, np.unravel_index(raw, [sizes[i] for i in data]), strict=True):
                coords[i] = np.repeat(c, m)
        if other:
            every = np.arange(m, dtype=np.int64)
            for i, c in zip(other, np.unravel_index(every, [sizes[i] for i in other]), strict=True):
                coords[i] = np.tile(c, u)
        flat = np.ravel_multi_index(tuple(coords), sizes)
        ranks = flat if self.ranks is None else self.ranks.ravel()[flat]
        return sorted(int(r) for r in ranks)

    def replica_groups(self) -> list[list[int]]:
        """All replica groups, indexed by data rank (cost: the world size)."""
        groups: list[list[int]] = [[] for _ in range(self.data_world_size)]
        for r in range(self.world_size):
            groups[self.data_rank(r)].append(r)
        return groups

    # ----------------------------------------------------------------- helpers
    def _raw_data_world_size(self) -> int:
        return math.prod(s for n, s in self.sizes.items() if n in self.data_axes)

    def _coords(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinates of a valid ``rank``: arithmetic, or through the table."""
        position = rank if self._position_of is None else int(self._position_of[rank])
        return tuple(int(x) for x in np.unravel_index(position, self.axis_sizes))

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(
                f"rank must be an int in [0, {self.world_size}) (got rank={rank!r} of type "
                f"{type(rank).__name__}); pass the process's rank as an int"
            )
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank={rank!r} is out of range for a mesh of world size {self.world_size} "
                f"({self.sizes}); pass a rank in [0, {self.world_size})"
            )


def data_sizes_dividing(global_batch_size: int, count: int = 16) -> list[int]:
    """Up to ``count`` of the smallest data-parallel sizes (at most ``MAX_WORLD_SIZE``) that
    divide ``global_batch_size``: what an error suggests, in bounded time for any value
    (divisors found up to 4096, each with its pair).

    >>> data_sizes_dividing(12), data_sizes_dividing(4099)
    ([1, 2, 3, 4, 6, 12], [1, 4099])
    """
    n = int(global_batch_size)
    small = [d for d in range(1, min(math.isqrt(n), 4096) + 1) if n % d == 0]
    both = set(small) | {n // d for d in small if n // d <= MAX_WORLD_SIZE}
    return sorted(both)[:count]


def _axis_layout(
    order: Iterable[str] | None, sizes: Mapping[str, int]
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The axis names (in ``order``, default :data:`DEFAULT_AXIS_ORDER`) and their sizes for
    :meth:`DataMesh.from_sizes`; ``("dp",), (1,)`` when no axis is given. Every sized axis is
    in the order; an order the caller gave names only sized axes."""
    _check_not_str("order", order)
    axis_order = tuple(order) if order is not None else DEFAULT_AXIS_ORDER
    unknown = [name for name in sizes if name not in axis_order]
    if unknown:
        raise ValueError(
            f"unknown mesh axis {unknown} (known: {list(axis_order)}); "
            "pass order=[...] naming every axis to use custom axis names"
        )
    if order is not None:
        missing = [name for name in axis_order if name not in sizes]
        if missing:
            raise ValueError(f"order names axes without a size: {missing}; give their sizes")
    names = tuple(name for name in axis_order if name in sizes)
    if not names:
        return ("dp",), (1,)
    return names, tuple(sizes[n] for n in names)


def _data_axes(data_axes: Iterable[str] | None) -> frozenset[str]:
    _check_not_str("data_axes", data_axes)
    return DEFAULT_DATA_AXES if data_axes is None else frozenset(data_axes)


def _check_size(name: str, size: Any) -> None:
    """An axis size is an integer >= 1 (not a bool, a float or a string)."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"axis {name!r} has size {size!r}; sizes must be integers >= 1")


def _check_env_sizes(sizes: Mapping[str, Any]) -> None:
    """The sizes given to :meth:`DataMesh.from_env`: axes of :data:`DEFAULT_AXIS_ORDER` (it
    takes no ``order``), each an integer >= 1, checked before the world is divided by them."""
    unknown = [name for name in sizes if name not in DEFAULT_AXIS_ORDER]
    if unknown:
        raise ValueError(
            f"unknown mesh axis {unknown} (known: {list(DEFAULT_AXIS_ORDER)}); for custom axis "
            "names use DataMesh.from_sizes(order=[...], world_size=int(os.environ"
            "['WORLD_SIZE']), ...)"
        )
    for name, size in sizes.items():
        _check_size(name, size)


def _check_not_str(name: str, value: Any) -> None:
    """``order`` / ``data_axes`` are lists of axis names: a string would be read letter by
    letter. Megatron writes its order as ``"tp-cp-dp-pp"``, innermost first; meshfeed's lists
    are outermost first, so the suggestion reverses such a string."""
    if isinstance(value, str):
        parts = value.split("-")[::-1] if "-" in value else [value]
        what = "axis names, outermost first" if name == "order" else "axis names"
        raise ValueError(
            f"{name}={value!r} is a string; pass a list of {what}, e.g. {name}={parts!r}"
        )


def _check_dim_names(names: tuple[str, ...]) -> None:
    """Without ``data_axes``, every dim of a ``DeviceMesh`` is an axis meshfeed knows: it
    cannot tell whether the ranks of any other dim read different data."""
    unknown = [n for n in names if n not in KNOWN_AXES]
    if unknown:
        known = [n for n in names if n in DEFAULT_DATA_AXES]
        raise ValueError(
            f"the DeviceMesh dim(s) {unknown} (dims {list(names)}) are not axes meshfeed "
            "knows, so it cannot tell whether their ranks read different samples (data "
            "parallel) or the same ones (sequence, tensor or context parallel); name the dims "
            "that shard data: DataMesh.from_device_mesh(device_mesh, data_axes=[...]), every "
            f"other dim then replicates (here e.g. data_axes={known!r} plus those of {unknown} "
            "that are data parallel), or rename the dims to meshfeed's axes: data "
            f"{sorted(DEFAULT_DATA_AXES)}, replicating {sorted(KNOWN_AXES - DEFAULT_DATA_AXES)}"
        )


def _check_root_mesh(names: tuple[str, ...], ranks: np.ndarray) -> None:
    """A ``DeviceMesh`` holds every rank of the world once (the one ``init_device_mesh``
    returned), not a sub-mesh such as ``world_mesh["dp"]``."""
    flat = np.sort(ranks.ravel())
    world = int(dist.get_world_size()) if is_initialized() else None
    if np.array_equal(flat, np.arange(flat.size)) and world in (None, flat.size):
        return
    shown = ranks.ravel().tolist()
    listed = str(shown) if len(shown) <= 16 else f"{str(shown[:16])[:-1]}, ...]"
    of = f"the {world} ranks of the world" if world is not None else "the world's ranks"
    raise ValueError(
        f"the DeviceMesh with dims {list(names)} is a sub-mesh: it holds {flat.size} rank(s) "
        f"{listed}, not each of {of}; pass the root mesh (the one init_device_mesh returned, "
        "e.g. world_mesh rather than world_mesh['dp']), whose dims name every axis"
    )


def world_size_now() -> int:
    """The world size of the initialised process group, else torchrun's ``WORLD_SIZE`` (1
    without either)."""
    if is_initialized():
        return int(dist.get_world_size())
    return _env_world_size(os.environ)


def default_rank(world_size: int | None = None, *, env: Mapping[str, str] | None = None) -> int:
    """This process's global rank when the caller did not pass one.

    From the process group when one is initialised, else from the ``RANK`` environment
    variable (set by torchrun, by SLURM through torchrun and by Ray Train). Without either, a
    world of one process is rank 0, and a larger world (``world_size``, e.g. the mesh's, or
    ``WORLD_SIZE``) is an error: guessing rank 0 would make every process read the same data.
    """
    if is_initialized():
        return int(dist.get_rank())
    env = os.environ if env is None else env
    raw = env.get("RANK")
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(
                f"the RANK environment variable is not an integer (got RANK={raw!r}); launch "
                "with torchrun, which sets it, or pass rank=... explicitly"
            ) from None
    world, source = world_size, "the mesh"
    if world is None:
        world, source = _env_world_size(env), "WORLD_SIZE"
    if world > 1:
        raise ValueError(
            f"cannot tell this process's rank: the world has {world} processes (from {source}) "
            "but there is no process group and no RANK environment variable; launch with "
            "torchrun (it sets RANK), call torch.distributed.init_process_group first, or pass "
            "rank=... explicitly"
        )
    return 0


def _env_world_size(env: Mapping[str, str]) -> int:
    raw = env.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        raise ValueError(
            f"the WORLD_SIZE environment variable must be a positive integer (got "
            f"WORLD_SIZE={raw!r}); launch with torchrun, which sets it, or unset it"
        )
    return world


def resolve_mesh(mesh: Any) -> DataMesh:
    """Accept a DataMesh, a DeviceMesh, a dict of axis sizes, or None (the torchrun world)."""
    if isinstance(mesh, DataMesh):
        return mesh
    if mesh is None:
        if is_initialized():
            return DataMesh.from_sizes(dp=dist.get_world_size())
        return DataMesh.from_env()
    if isinstance(mesh, Mapping):
        return DataMesh.from_sizes(**dict(mesh))
    if hasattr(mesh, "mesh_dim_names"):
        return DataMesh.from_device_mesh(mesh)
    raise ValueError(
        f"mesh={mesh!r} is not a DataMesh, DeviceMesh or dict of axis sizes; "
        "pass e.g. mesh={'dp': 4, 'tp': 2}"
    )


def place(
    mesh: Any,
    device_mesh: Any,
    rank: int | None,
    *,
    serves_every_rank: bool = False,
    check_env: bool = True,
) -> tuple[DataMesh, int]:
    """The loaders' ``(mesh, device_mesh, rank)`` arguments as ``(DataMesh, rank)``.

        ``device_mesh=`` is another name for ``mesh=`` (the one torch and Twinkle users know);
        both at once is an error. A mesh whose world size differs from an initialised process
        group's is an error, and so is, without a process group, one that differs from torchrun's
        ``WORLD_SIZE`` (:func:`_check_world`; ``check_env=False``: not that one, for a resize
    between two process groups, where the environment still names the old world). Without ``rank`` it comes from :func:`default_rank`
        (``serves_every_rank``: this process makes the batches of every data rank, a Ray driver,
        so a mesh of several ranks does not need this process's own rank). The rank is validated
        against the mesh, and in a process group it must be this process's rank there.
    """
    if mesh is not None and device_mesh is not None:
        raise ValueError(
            "mesh= and device_mesh= both given; they are the same argument (device_mesh= is "
            "the name torch and Twinkle users know): pass one of them"
        )
    resolved = resolve_mesh(device_mesh if mesh is None else mesh)
    _check_world(resolved, serves_every_rank=serves_every_rank, check_env=check_env)
    if rank is None:
        rank = default_rank(1 if serves_every_rank else resolved.world_size)
    resolved.data_rank(rank)  # validates the rank
    if not serves_every_rank:
        _check_own_rank(resolved, rank)
    return resolved, rank


def _check_world(
    mesh: DataMesh, *, serves_every_rank: bool = False, check_env: bool = True
) -> None:
    """The mesh has as many ranks as the job: the initialised process group's world, or,
    without one, torchrun's ``WORLD_SIZE`` when it is above 1 (a mesh of 4 on 2 processes
    would leave half of every epoch unread). A process serving every rank (a Ray driver) is
    not one of the job's ranks, so only the process group is checked for it; so it is without
    ``check_env`` (a resize between two process groups: the environment names the old world)."""
    if is_initialized():
        world, source = int(dist.get_world_size()), "the process group has"
    elif serves_every_rank or not check_env or "WORLD_SIZE" not in os.environ:
        return
    else:
        world = _env_world_size(os.environ)
        source = f"torchrun's WORLD_SIZE={world} says the job has"
        if world == 1:
            return
    if world != mesh.world_size:
        raise ValueError(
            f"the mesh {mesh.sizes} has world size {mesh.world_size} but {source} {world} "
            "ranks; make the mesh sizes multiply to the number of processes"
        )


def _check_own_rank(mesh: DataMesh, rank: int) -> None:
    """In a process group, an explicit ``rank`` is this process's global rank there: any other
    (``LOCAL_RANK`` on several nodes, a literal ``rank=0``) makes ranks read the same data."""
    if is_initialized() and int(rank) != int(dist.get_rank()):
        raise ValueError(
            f"rank={rank} was passed, but this process is rank {dist.get_rank()} of the process "
            f"group of {mesh.world_size} ranks; two processes would read the same data. Pass "
            "the global rank (rank=torch.distributed.get_rank(), not LOCAL_RANK), or leave "
            "rank out to take it from the process group"
        )


def mesh_hash(mesh: DataMesh) -> int:
    """A 63-bit hash of everything that decides which data rank each global rank is (the
    axes in order, their sizes, the data axes, ``ulysses`` and a custom rank table), for the
    ranks to compare in one int64 collective."""
    table = (
        ""
        if mesh.ranks is None
        else hashlib.blake2b(
            np.ascontiguousarray(mesh.ranks, dtype=np.int64).tobytes(), digest_size=8
        ).hexdigest()
    )
    described = [list(mesh.axis_names), list(mesh.axis_sizes), sorted(mesh.data_axes)]
    text = json.dumps([*described, mesh.ulysses, table])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
