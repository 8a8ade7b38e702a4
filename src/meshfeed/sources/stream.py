"""Sharded streams: data that is read in order, never by index.

A :class:`ShardedStream` is a list of shards (file paths, or zero-arg callables returning an
iterable) and a ``reader(shard, start_row, stop_row)`` that yields the rows of one shard in
``[start_row, stop_row)`` (``stop_row=None``: to the end). Shards are assigned to
``(data rank, worker)`` slots by arithmetic, so every rank reads only its own data; nothing is
read and dropped on behalf of another rank.

Assignment for ``R`` data ranks and ``W`` workers per rank (``W = max(1, num_workers)``), after
an optional per-epoch shard permutation (``shuffle``):

- Without row counts, or when the number of shards divides ``R * W``: whole shards. Shard
  ``i`` goes to rank ``i % R``, worker ``(i // R) % W``. When the count does not divide, some
  slots hold one shard more than others; the ranks still stop together (the first rank to run
  out ends the epoch for all), so up to one shard per slot of data is left unread each epoch.
  Every rank needs at least one shard.
- With ``rows=[rows of shard 0, ...]`` and a count that does not divide: the global row space
  (shards back to back) is cut into ``R * W`` contiguous ranges balanced to one row, and each
  slot reads its range (pieces of at most a few shards, through ``reader``'s row range).

The default reader handles callables (``itertools.islice`` over the iterable: skipping a
row range reads and drops rows of *this* shard only) and text files (one row per line; a
``.jsonl`` line is parsed as JSON). Give a seeking reader for large shards.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from meshfeed.nodes.base import Node
from meshfeed.order.permutation import Permutation, derive_seed

__all__ = ["Piece", "ShardedStream", "default_reader"]

Reader = Callable[[Any, int, "int | None"], Iterable[Any]]
_SHARD_OP = 0x5348_4152


def default_reader(shard: Any, start_row: int, stop_row: int | None) -> Iterator[Any]:
    """Rows ``[start_row, stop_row)`` of a callable shard or a text / JSON-lines file."""
    if callable(shard):
        return itertools.islice(iter(shard()), start_row, stop_row)
    path = os.fspath(shard)
    return _read_lines(path, start_row, stop_row)


def _read_lines(path: str, start: int, stop: int | None) -> Iterator[Any]:
    as_json = path.endswith(".jsonl")
    with open(path, encoding="utf-8") as f:
        for line in itertools.islice(f, start, stop):
            yield json.loads(line) if as_json else line.rstrip("\n")


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, stop)`` of shard ``shard`` (``stop=None``: the whole shard from start)."""

    shard: int
    start: int
    stop: int | None


class ShardedStream:
    """Shards plus a reader; see the module docstring for the assignment rule.

    ``shuffle_buffer`` is the size of the seeded per-worker shuffle buffer (0: none); ``seed``
    keys the shard permutation and the buffer together with the loader's seed. Both are used
    only when the loader has ``shuffle=True``. ``rows`` (row counts per shard, optional) lets
    shards be split by row ranges and gives the loader a ``len()``.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        reader: Reader | None = None,
        *,
        shuffle_buffer: int = 0,
        seed: int = 0,
        rows: Sequence[int] | None = None,
    ) -> None:
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence) or not shards:
            raise ValueError(
                f"shards must be a non-empty list of file paths or zero-arg callables (got "
                f"{shards!r})"
            )
        for s in shards:
            if not (callable(s) or isinstance(s, (str, os.PathLike))):
                raise TypeError(f"shard {s!r} is neither a path nor a zero-arg callable")
        if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int):
            raise ValueError(f"shuffle_buffer must be an int >= 0 (got {shuffle_buffer=!r})")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be an int >= 0 (got {shuffle_buffer=!r})")
        if rows is not None:
            rows = [int(r) for r in rows]
            if len(rows) != len(shards) or any(r < 0 for r in rows):
                raise ValueError(
                    f"rows must give one non-negative row count per shard ({len(shards)} "
                    f"shards, got {len(rows)} counts); omit rows= if they are unknown"
                )
        self.shards = list(shards)
        self.reader: Reader = reader or default_reader
        self.shuffle_buffer = shuffle_buffer
        self.seed = int(seed)
        self.rows = rows

    @property
    def num_rows(self) -> int | None:
        return None if self.rows is None else sum(self.rows)

    @property
    def fingerprint(self) -> str:
        names = [
            getattr(s, "__qualname__", None) or repr(s) if callable(s) else os.fspath(s)
            for s in self.shards
        ]
        h = hashlib.blake2b(json.dumps([names, self.rows]).encode(), digest_size=10)
        return f"stream:{len(self.shards)}:{h.hexdigest()}"

    def shard_order(self, epoch: int, *, seed: int, shuffle: bool) -> list[int]:
        """The shard sequence of ``epoch`` (a seeded permutation when ``shuffle``)."""
        n = len(self.shards)
        if not shuffle or n == 1:
            return list(range(n))
        perm = Permutation(n, derive_seed(_SHARD_OP, self.seed, seed, epoch))
        return [perm[i] for i in range(n)]

    def assign(
        self, epoch: int, data_world_size: int, num_slots_per_rank: int, *, seed: int, shuffle: bool
    ) -> list[list[list[Piece]]]:
        """``pieces[rank][worker]``: what each slot reads in ``epoch`` (pure arithmetic)."""
        R, W = data_world_size, max(1, num_slots_per_rank)
        order = self.shard_order(epoch, seed=seed, shuffle=shuffle)
        out: list[list[list[Piece]]] = [[[] for _ in range(W)] for _ in range(R)]
        S = R * W
        if self.rows is None or len(order) % S == 0:
            if len(order) < R:
                raise ValueError(
                    f"{len(order)} shards cannot feed {R} data ranks without splitting; give "
                    "rows= (row counts per shard) so shards are split by row ranges, or use "
                    "more shards"
                )
            for i, shard in enumerate(order):
                out[i % R][(i // R) % W].append(Piece(shard, 0, None))
            return out
        total = sum(self.rows)
        if total < S:
            raise ValueError(
                f"the stream has {total} rows for {S} (rank, worker) slots; use fewer ranks "
                "or workers"
            )
        bounds = [j * total // S for j in range(S + 1)]
        starts = list(itertools.accumulate((self.rows[s] for s in order), initial=0))
        for j in range(S):
            lo, hi = bounds[j], bounds[j + 1]
            pieces = out[j // W][j % W]
            for k, shard in enumerate(order):
                a, b = max(lo, starts[k]), min(hi, starts[k + 1])
                if a < b:
                    pieces.append(Piece(shard, a - starts[k], b - starts[k]))
        return out

    def read(self, piece: Piece, offset: int = 0) -> Iterator[Any]:
        """The rows of ``piece`` from ``offset`` rows into it."""
        stop = piece.stop
        return iter(self.reader(self.shards[piece.shard], piece.start + offset, stop))

    def load_rows(self, refs: list[list[int]]) -> list[Any]:
        """Re-read rows given as ``[shard, row]`` references (restoring a shuffle buffer)."""
        by_shard: dict[int, list[int]] = {}
        for shard, row in refs:
            by_shard.setdefault(int(shard), []).append(int(row))
        found: dict[tuple[int, int], Any] = {}
        for shard, wanted in by_shard.items():
            lo, hi = min(wanted), max(wanted) + 1
            want = set(wanted)
            for r, row in enumerate(self.reader(self.shards[shard], lo, hi), start=lo):
                if r in want:
                    found[(shard, r)] = row
        missing = [ref for ref in refs if (int(ref[0]), int(ref[1])) not in found]
        if missing:
            raise ValueError(
                f"rows {missing[:4]} of the checkpoint's shuffle buffer are no longer in their "
                "shards; the stream changed since the checkpoint"
            )
        return [found[(int(s), int(r))] for s, r in refs]


class PieceReader(Node[tuple[list[int], Any]]):
    """Reads a slot's pieces in order, yielding ``([shard, row], row)``.

    State: ``{"piece": i, "row": rows consumed in piece i}``; restore re-opens piece i at that
    row through the reader (no re-reading of earlier pieces). Rows that are None are skipped
    and counted in ``skipped``.
    """

    def __init__(self, stream: ShardedStream, pieces: list[Piece]) -> None:
        self.stream, self.pieces = stream, pieces
        self.piece, self.row = 0, 0
        self.skipped = 0
        self._it: Iterator[Any] | None = None

    def next(self) -> tuple[list[int], Any]:
        while self.piece < len(self.pieces):
            p = self.pieces[self.piece]
            if self._it is None:
                self._it = self.stream.read(p, self.row)
            for row in self._it:
                ref = [p.shard, p.start + self.row]
                self.row += 1
                if row is None:
                    self.skipped += 1
                    continue
                return ref, row
            self.piece, self.row, self._it = self.piece + 1, 0, None
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {"piece": self.piece, "row": self.row, "skipped": self.skipped}

    def restore(self, state: dict[str, Any]) -> None:
        piece, row = state.get("piece"), state.get("row")
        if not isinstance(piece, int) or not isinstance(row, int) or piece > len(self.pieces):
            raise ValueError(
                f"stream reader state {state!r} does not fit this slot's {len(self.pieces)} "
                "pieces; resume with the same shards, data-parallel size and num_workers"
            )
        self.piece, self.row, self._it = piece, row, None
        self.skipped = int(state.get("skipped", 0))
