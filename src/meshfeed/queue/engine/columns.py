"""Columnar storage: a put's tensor or array column stays one :class:`Chunk`.

A sample's field then holds a :class:`Cell` ``(chunk, row)`` instead of its own tensor, so a put
of ``n`` rows costs one reference per row, not ``n`` tensor objects (and, on Ray, one pickled
column, not ``n``). :func:`gather` builds a batch column from cells with one ``index_select``
/ ``take`` per run of cells from one chunk and one ``cat`` over the runs; when the rows are
contiguous in one chunk the result is a *view* of the put's column (no copy). A reader may write
into what a get hands it: where the store keeps the rows for another read (another task, a
shared plan's retry or replica peer, a hold, a lease, a resume's re-delivery) the embedded
backend hands out :func:`owned` copies instead (a view only for the rows' last read). Fields of
one sample may come from different puts: each field's cells point into its own chunks.

On Ray a large put's column is a :class:`RemoteChunk`: the column itself lives in Ray's object
store and the store actor holds only its reference (the data plane apart from the control
plane). :func:`gather` of remote cells returns :class:`Runs` (which rows of which chunk), and
the consuming client fetches the chunks and assembles the column with :func:`assemble`.
"""

from __future__ import annotations

import copy
import itertools
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Bits",
    "Cell",
    "Chunk",
    "Gathered",
    "RemoteChunk",
    "Runs",
    "assemble",
    "gather",
    "gather_runs",
    "own",
    "owned",
    "resolve",
    "signature",
    "transportable",
]


class Chunk:
    """One put's column (a tensor or array of shape ``[n, ...]``)."""

    __slots__ = ("data", "n", "row_nbytes")

    def __init__(self, data: Any) -> None:
        self.data = data
        self.n = n = int(data.shape[0])  # not len(): a tensor's __len__ is a Python call
        nbytes = data.nbytes if isinstance(data, np.ndarray) else data.element_size() * data.numel()
        self.row_nbytes = int(nbytes) // n

    def __len__(self) -> int:
        return self.n

    def __reduce__(self) -> Any:
        data = self.data
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(data, torch.Tensor):
            data = data.contiguous().clone() if data._base is not None else data.contiguous()
            bits = Bits.of(data)
            if bits is not None:  # torch cannot load float8, ... it pickled: move the bits
                return (_chunk_of_bits, (bits,))
        elif isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data)  # a broadcast view would pickle its full size
        return (Chunk, (data,))


def _chunk_of_bits(bits: Bits) -> Chunk:
    return Chunk(bits.tensor())


@dataclass(eq=False, slots=True)
class Bits:
    """A CPU tensor of a dtype numpy lacks (bfloat16, float8, complex32, ...) on its way
    through Ray: its raw bits as an ``array`` of the integer dtype of its width, and the
    tensor's ``dtype`` name (:func:`meshfeed.runtime.transport.bits_carrier`). Ray moves the
    array out-of-band (zero-copy where it can); torch's own pickling of such a tensor cannot
    be loaded (float8, complex32) or costs a copy more (bfloat16)."""

    array: np.ndarray
    dtype: str

    @staticmethod
    def of(data: Any) -> Bits | None:
        """``data`` as bits when it is a plain CPU tensor of a dtype numpy lacks, else None."""
        torch = sys.modules.get("torch")
        if (
            torch is None
            or type(data) is not torch.Tensor
            or data.device.type != "cpu"
            or data.layout != torch.strided
            or data.requires_grad
        ):
            return None
        from meshfeed.runtime.transport import bits_carrier

        carrier = bits_carrier(data.dtype)
        if carrier is None:
            return None
        return Bits(data.detach().view(carrier[0]).numpy(), carrier[1])

    def tensor(self, array: np.ndarray | None = None) -> Any:
        """The tensor again (of ``array``, rows of :attr:`array`, when given), in memory of
        its own: a read-only array (mapped from Ray's object store) is copied."""
        import torch

        from meshfeed.runtime.transport import from_bits

        array = self.array if array is None else array
        return from_bits(
            torch.from_numpy(array if array.flags.writeable else array.copy()), self.dtype
        )


class RemoteChunk:
    """A put's column held in Ray's object store: its ``ref`` (an ``ObjectRef``), length,
    bytes per row and ``sig`` (kind, dtype, row shape: what :func:`gather` compares).

    The store actor keeps a chunk alive exactly as long as one of its cells is held: when
    every declared task consumed every row (or the samples / partition are deleted) the last
    reference goes, and Ray frees the object. ``data`` fetches the column (checkpoints,
    samplers reading a field): the hot path never does."""

    __slots__ = ("__weakref__", "_small", "n", "ref", "row_nbytes", "sig")

    def __init__(self, ref: Any, n: int, row_nbytes: int, sig: tuple[Any, ...]) -> None:
        self.ref, self.n, self.row_nbytes, self.sig = ref, n, row_nbytes, sig
        self._small: Any = None

    def __len__(self) -> int:
        return self.n

    def __reduce__(self) -> Any:
        return (RemoteChunk, (self.ref, self.n, self.row_nbytes, self.sig))

    @property
    def data(self) -> Any:
        import ray

        if self._small is not None:
            return self._small
        data = ray.get(self.ref)
        if type(data) is Bits:
            data = data.tensor()
        elif not self.sig[0] and isinstance(data, np.ndarray):  # a CPU tensor sent as an array
            import torch

            data = torch.from_numpy(data.copy())
        if self.row_nbytes <= 16:  # scalar rows a sampler reads one by one: fetch once
            self._small = data
        return data


def transportable(data: Any) -> Any:
    """What to ``ray.put`` for a chunk: a CPU tensor as the array sharing its memory (Ray
    writes and reads arrays out-of-band, about 10x faster than a pickled tensor; measured
    with 16 MiB float32), one of a dtype numpy lacks as its :class:`Bits` (bfloat16, float8,
    complex32: torch cannot load some of them pickled), anything else (numpy, GPU, quantized)
    as it is."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor) and data.device.type == "cpu":
        try:
            return data.detach().numpy()
        except (TypeError, RuntimeError):  # no numpy dtype
            bits = Bits.of(data)
            return data if bits is None else bits
    return data


def signature(data: Any) -> tuple[Any, ...]:
    """What two chunks must share to be gathered into one column (a tensor's :class:`Bits`:
    the tensor's)."""
    if type(data) is Bits:
        return (False, f"torch.{data.dtype}", tuple(data.array.shape[1:]))
    return (isinstance(data, np.ndarray), str(data.dtype), tuple(data.shape[1:]))


@dataclass(eq=False, slots=True)
class Runs:
    """A batch column still to assemble: ``runs`` of ``(ref or array, rows)`` in order, where
    a ref's ``rows`` index its fetched chunk and an array is already the rows (a small chunk
    held by the actor); ``is_np``: numpy, else torch."""

    runs: list[tuple[Any, list[int] | None]]
    is_np: bool


def assemble(column: Runs, fetched: dict[Any, Any]) -> Gathered:
    """The column of ``column`` given its chunks, ``fetched`` by ref (one ``index_select`` /
    ``take`` per run, a view for one contiguous run of an array: read-only, it maps the object
    store). A tensor column whose chunks travelled as arrays (see :func:`transportable`) is
    copied out of the object store into a tensor of its own (writable)."""
    pieces = []
    for piece, rows in column.runs:
        if rows is None:
            pieces.append(piece.tensor() if type(piece) is Bits else piece)
            continue
        data = fetched[piece]
        if type(data) is Bits:
            pieces.append(data.tensor(_take(data.array, rows, True)))
        elif not column.is_np and isinstance(data, np.ndarray):
            import torch

            part = _take(data, rows, True)
            pieces.append(torch.from_numpy(part if part.flags.writeable else part.copy()))
        else:
            pieces.append(_take(data, rows, column.is_np))
    return _concat(pieces, column.is_np)


@dataclass(eq=False, slots=True)
class Cell:
    """Row ``row`` of ``chunk``: one sample's value of one field."""

    chunk: Chunk
    row: int

    def value(self) -> Any:
        return self.chunk.data[self.row]


@dataclass(eq=False, slots=True)
class Gathered:
    """A batch column already assembled from cells (``store.collate`` passes it through)."""

    data: Any

    def __reduce__(self) -> Any:
        bits = Bits.of(self.data)  # a dtype numpy lacks: its bits (see Bits)
        return (Gathered, (self.data,)) if bits is None else (_gathered_of_bits, (bits,))


def _gathered_of_bits(bits: Bits) -> Gathered:
    return Gathered(bits.tensor())


def owned(columns: dict[str, Any]) -> dict[str, Any]:
    """``columns`` of a batch whose rows the store still keeps, as memory of the reader's own:
    a column that is a view of a stored chunk is copied, and so is every value of a column of
    plain values (a stored sample's own object, or a row of a chunk) that can be changed in
    place: tensors and arrays, and lists, tuples and dicts with their contents, at any depth
    (as Ray's pickling copies them). Columns gathered into new memory (a ``take`` or ``cat``)
    and scalars pass as they are. So an in-place edit by one reader never reaches what
    another task, a retry or a resume reads."""
    return {f: _owned(v) for f, v in columns.items()}


def _owned(value: Any) -> Any:
    if type(value) is Gathered:
        data = value.data
        if type(data) is list:  # a run's scalars (puts.run_columns), a new list already
            return value
        if isinstance(data, np.ndarray):
            return Gathered(data.copy()) if data.base is not None else value
        return Gathered(data.clone()) if data._base is not None else value
    if type(value) is list:
        return [_own(v) for v in value]
    return value


_IMMUTABLE = frozenset({int, float, str, bool, bytes, complex, type(None)})


def own(value: Any) -> Any:
    """A copy of a batch column (or any value) that shares nothing it could change in place:
    tensors and arrays copied (a view: only its own elements), lists, tuples and dicts with
    their contents at any depth, scalars as they are, anything else deep-copied."""
    return _own(value)


def _own(value: Any) -> Any:
    """A copy of ``value`` that shares nothing it could change in place (scalars as they are)."""
    t = type(value)
    if t in _IMMUTABLE:
        return value
    if t is list:
        return [_own(v) for v in value]
    if t is tuple:
        return tuple(_own(v) for v in value)
    if t is dict:
        return {k: _own(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.copy()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.generic):  # a numpy scalar: immutable
        return value
    return copy.deepcopy(value)  # anything else a producer put (a dataclass, a set, ...)


def resolve(value: Any) -> Any:
    """The plain value of a stored field value (a cell's row, else the value itself)."""
    return value.value() if type(value) is Cell else value


def gather(values: list[Any]) -> Any:
    """A batch column from the stored values of one field, in order.

    All cells of chunks of one kind, dtype and row shape: a :class:`Gathered` column (a view
    for one contiguous run of one chunk). Otherwise a list of plain values.
    """
    if not values or any(type(v) is not Cell for v in values):
        return [resolve(v) for v in values]
    if any(type(v.chunk) is RemoteChunk for v in values):
        return _gather_remote(values)
    if not _same_layout([v.chunk.data for v in values]):
        return [resolve(v) for v in values]
    is_np = isinstance(values[0].chunk.data, np.ndarray)
    return _concat([_take(chunk.data, rows, is_np) for chunk, rows in _runs_of(values)], is_np)


def _same_layout(datas: list[Any]) -> bool:
    """Whether arrays / tensors ``datas`` are of one kind, dtype and row shape (stackable)."""
    first = datas[0]
    is_np = isinstance(first, np.ndarray)
    return all(
        isinstance(d, np.ndarray) == is_np
        and d.dtype == first.dtype
        and d.shape[1:] == first.shape[1:]
        for d in datas
    )


def _concat(pieces: list[Any], is_np: bool) -> Gathered:
    """One column from row blocks of one layout (the block itself when there is one)."""
    if len(pieces) == 1:
        return Gathered(pieces[0])
    if is_np:
        return Gathered(np.concatenate(pieces))
    import torch

    return Gathered(torch.cat(pieces))


def gather_runs(records: list[Any], ids: list[Any], fields: tuple[str, ...]) -> Any:
    """The batch columns of samples ``ids`` stored in runs (``records[i]`` holds ``ids[i]``;
    see :class:`meshfeed.queue.engine.records.Run`), as :func:`gather` would build them from their
    cells, with O(runs) Python operations: a slice (a view) per contiguous block of a run,
    one ``cat`` over the blocks; a column of scalars as a :class:`Gathered` list (what
    ``collate`` would make of it). ``None`` when the samples are not in blocks of whole runs
    (the caller gathers cell by cell)."""
    kind = type(records[0])
    n = len(ids)
    blocks: list[tuple[Any, Any]] = []  # (run, slice of its rows, or a list of rows)
    i = 0
    while i < n:
        run = records[i]
        if type(run) is not kind:
            return None
        c = records.count(run)
        if records[i : i + c].count(run) != c:  # the run's samples are not one block
            return None
        keys = ids[i : i + c]
        if run.index is None:
            lo = keys[0] - run.first
            rows: Any = (
                slice(lo, lo + c)
                if keys == list(range(keys[0], keys[0] + c))
                else [k - run.first for k in keys]
            )
        else:
            rows = list(map(run.index.__getitem__, keys))
            if rows == list(range(rows[0], rows[0] + c)):
                rows = slice(rows[0], rows[0] + c)
        blocks.append((run, rows))
        i += c
    return {f: _gather_blocks([(run.columns[f], rows) for run, rows in blocks]) for f in fields}


def _gather_blocks(blocks: list[tuple[Any, Any]]) -> Any:
    """One column from ``(chunk or list, rows)`` blocks; the rules of :func:`gather`."""
    if len(blocks) == 1 and type(blocks[0][1]) is slice:  # the common case: one view
        column, rows = blocks[0]
        if type(column) is list:
            return Gathered(column[rows])
        data = column.data
        return Gathered(_slice(data, rows, isinstance(data, np.ndarray)))
    if all(type(c) is list for c, _ in blocks):
        return Gathered(_plain_rows(blocks))  # a run's lists hold scalars: nothing to collate
    if all(type(c) is Chunk for c, _ in blocks) and (
        len(blocks) == 1 or _same_layout([c.data for c, _ in blocks])
    ):
        is_np = isinstance(blocks[0][0].data, np.ndarray)
        return _concat([_pick(c.data, rows, is_np) for c, rows in blocks], is_np)
    return _plain_rows(blocks)  # mixed kinds or layouts: the plain values, as gather does


def _plain_rows(blocks: list[tuple[Any, Any]]) -> list[Any]:
    """The values of the blocks' rows, one by one (a list column's own values)."""
    values: list[Any] = []
    for column, rows in blocks:
        if type(column) is list:
            values.extend(column[rows] if type(rows) is slice else map(column.__getitem__, rows))
            continue
        data = column.data
        picked = range(len(column))[rows] if type(rows) is slice else rows
        values.extend(data[r] for r in picked)
    return values


def _pick(data: Any, rows: slice | list[int], is_np: bool) -> Any:
    return _slice(data, rows, is_np) if type(rows) is slice else _take(data, rows, is_np)


def _gather_remote(values: list[Cell]) -> Any:
    """Runs of cells when some live in the object store: the consumer fetches them."""
    sigs = {
        v.chunk.sig if type(v.chunk) is RemoteChunk else signature(v.chunk.data) for v in values
    }
    if len(sigs) != 1:  # mixed kinds or shapes: plain values (fetched here, rare)
        return [resolve(v) for v in values]
    runs = _runs_of(values)
    is_np = next(iter(sigs))[0]
    return Runs(
        [
            (c.ref, rows) if type(c) is RemoteChunk else (_portable(c.data, rows, is_np), None)
            for c, rows in runs
        ],
        is_np,
    )


def _portable(data: Any, rows: list[int], is_np: bool) -> Any:
    """Rows of a chunk the actor holds, as a piece of :class:`Runs` (a dtype numpy lacks as
    its :class:`Bits`: it travels pickled)."""
    piece = _take(data, rows, is_np)
    bits = None if is_np else Bits.of(piece)
    return piece if bits is None else bits


def _slice(data: Any, rows: slice, is_np: bool) -> Any:
    """Rows ``rows.start:rows.stop`` of a column, a view (``narrow``: a tensor's slicing
    parses its index in Python)."""
    if is_np:
        return data[rows]
    return data.narrow(0, rows.start, rows.stop - rows.start)


def _take(data: Any, rows: list[int], is_np: bool) -> Any:
    lo = rows[0]
    if all(b - a == 1 for a, b in itertools.pairwise(rows)):
        return data[lo : lo + len(rows)]  # contiguous: a view
    if is_np:
        return data.take(rows, axis=0)
    import torch

    return data.index_select(0, torch.as_tensor(rows, device=data.device))


def _runs_of(values: list[Cell]) -> list[tuple[Any, list[int]]]:
    """``values`` grouped into runs of consecutive cells of one chunk: ``(chunk, rows)``."""
    runs: list[tuple[Any, list[int]]] = []
    for v in values:
        if runs and runs[-1][0] is v.chunk:
            runs[-1][1].append(v.row)
        else:
            runs.append((v.chunk, [v.row]))
    return runs
