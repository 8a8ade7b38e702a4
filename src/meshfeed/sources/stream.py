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
  out ends the epoch for all), so up to one shard per slot of data is left unread each epoch,
  and shards of unequal sizes leave rows unread even when the count divides.
  :meth:`ShardedStream.unread_rows` says how many (given row counts). Every rank needs at
  least one shard.
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
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from meshfeed.nodes.base import Node
from meshfeed.nodes.batch import Batcher
from meshfeed.nodes.shuffle import ShuffleBuffer
from meshfeed.order.permutation import Permutation, derive_seed
from meshfeed.state import MAX_COUNT, check_count, envelope, open_envelope

__all__ = ["Piece", "PieceReader", "ShardedStream", "default_reader", "slot_batches"]

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
        # assign() is a pure function of its arguments, asked for several times per epoch
        # (loader start, len(), the unread count): a few recent answers are kept.
        self._assigned: dict[tuple[int, ...], list[list[list[Piece]]]] = {}

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
        key = (epoch, data_world_size, num_slots_per_rank, seed, int(shuffle))
        if key not in self._assigned:
            if len(self._assigned) >= 8:
                self._assigned.clear()
            self._assigned[key] = self._assign(
                epoch, data_world_size, num_slots_per_rank, seed=seed, shuffle=shuffle
            )
        return [[list(pieces) for pieces in slots] for slots in self._assigned[key]]

    def _assign(
        self, epoch: int, data_world_size: int, num_slots_per_rank: int, *, seed: int, shuffle: bool
    ) -> list[list[list[Piece]]]:
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

    def unread_rows(
        self,
        epoch: int,
        data_world_size: int,
        num_workers: int,
        *,
        seed: int,
        shuffle: bool,
        batch_size: int,
        drop_last: bool,
    ) -> int | None:
        """Rows of ``epoch`` that no data rank reads, or None when ``rows`` are unknown.

        Ranks stop together (the first rank to run out ends the epoch for all), so with
        whole-shard assignment (no ``rows=``, or a shard count that divides ``ranks *
        workers``) the rows that other ranks still hold when one runs out are never read
        that epoch; ``drop_last`` also leaves each worker's last short batch unread. Pure
        arithmetic over the row counts (cost O(ranks * workers) per epoch), for the loader's
        ``stats()``. Without row counts the number is unknowable without reading the shards:
        give ``rows=`` to have it (and to have shards split by row ranges instead).
        """
        if self.rows is None:
            return None
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (got {batch_size=!r})")
        assignment = self.assign(epoch, data_world_size, num_workers, seed=seed, shuffle=shuffle)
        per_rank = [[self._piece_rows(pieces) for pieces in slots] for slots in assignment]
        batches = [
            [r // batch_size if drop_last else -(-r // batch_size) for r in rows]
            for rows in per_rank
        ]
        steps = min(sum(b) for b in batches)
        read = sum(
            _rows_taken(rows, b, batch_size, steps)
            for rows, b in zip(per_rank, batches, strict=True)
        )
        return sum(self.rows) - read

    def _piece_rows(self, pieces: list[Piece]) -> int:
        assert self.rows is not None
        return sum((p.stop if p.stop is not None else self.rows[p.shard]) - p.start for p in pieces)

    def read(self, piece: Piece, offset: int = 0) -> Iterator[Any]:
        """The rows of ``piece`` from ``offset`` rows into it."""
        return iter(self.reader(self.shards[piece.shard], piece.start + offset, piece.stop))

    def load_items(self, refs: list[Any]) -> list[tuple[tuple[int, int], Any]]:
        """``((shard, row), row)`` items for ``[shard, row]`` references, as
        :class:`PieceReader` yields them (the ``load=`` of a stream's shuffle buffer)."""
        rows = self.load_rows(refs)
        return [((int(a), int(b)), row) for (a, b), row in zip(refs, rows, strict=True)]

    def load_rows(self, refs: list[Any]) -> list[Any]:
        """Re-read rows given as ``[shard, row]`` references (restoring a shuffle buffer).

        Every reference is checked against this stream first: a pair of non-negative ints, a
        shard that exists, a row inside the shard (when row counts are known), no reference
        twice; a row the reader no longer yields is refused too. Each is a ``ValueError``
        naming the reference.
        """
        pairs: list[tuple[int, int]] = []
        for ref in refs:
            if (
                not isinstance(ref, (list, tuple))
                or len(ref) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in ref)
                or ref[0] < 0
                or ref[1] < 0
            ):
                raise ValueError(
                    f"shuffle buffer reference {ref!r} is not a [shard, row] pair of "
                    "non-negative ints; the checkpoint is corrupted"
                )
            shard, row = int(ref[0]), int(ref[1])
            if shard >= len(self.shards):
                raise ValueError(
                    f"shuffle buffer reference {[shard, row]} names shard {shard}, but this "
                    f"stream has {len(self.shards)} shards; resume with the shards that wrote "
                    "the checkpoint"
                )
            if self.rows is not None and row >= self.rows[shard]:
                raise ValueError(
                    f"shuffle buffer reference {[shard, row]} names row {row} of shard {shard}, "
                    f"which has {self.rows[shard]} rows; the checkpoint is corrupted or the "
                    "stream changed"
                )
            pairs.append((shard, row))
        if len(set(pairs)) != len(pairs):
            seen: set[tuple[int, int]] = set()
            dup = next(p for p in pairs if p in seen or seen.add(p))  # type: ignore[func-returns-value]
            raise ValueError(
                f"shuffle buffer lists the row {list(dup)} more than once (it would deliver it "
                "twice); the checkpoint is corrupted"
            )
        by_shard: dict[int, list[int]] = {}
        for shard, row in pairs:
            by_shard.setdefault(shard, []).append(row)
        found: dict[tuple[int, int], Any] = {}
        for shard, wanted in by_shard.items():
            lo, hi = min(wanted), max(wanted) + 1
            want = set(wanted)
            for r, row in enumerate(self.reader(self.shards[shard], lo, hi), start=lo):
                if r in want:
                    found[(shard, r)] = row
        missing = [list(p) for p in pairs if p not in found]
        if missing:
            raise ValueError(
                f"rows {missing[:4]} of the checkpoint's shuffle buffer are no longer in their "
                "shards; the stream changed since the checkpoint"
            )
        return [found[p] for p in pairs]


def _rows_taken(rows: list[int], batches: list[int], batch_size: int, steps: int) -> int:
    """Rows a rank reads in ``steps`` round-robin batches over workers with ``rows`` each."""
    taken, k, remaining = 0, 0, steps
    while remaining > 0:
        active = [w for w, b in enumerate(batches) if b > k]
        if not active:
            break
        horizon = min(batches[w] for w in active)
        rounds = min(horizon - k, remaining // len(active))
        if rounds == 0:
            active, rounds = active[:remaining], 1
        for w in active:
            taken += min((k + rounds) * batch_size, rows[w]) - min(k * batch_size, rows[w])
        remaining -= rounds * len(active)
        k += rounds
    return taken


_ROW_BITS = 40
_ROW_MASK = (1 << _ROW_BITS) - 1


def json_refs(keys: list[int]) -> list[list[int]]:
    """``[shard, row]`` pairs of :meth:`PieceReader.next_many_refs` keys (for a checkpoint)."""
    return [[k >> _ROW_BITS, k & _ROW_MASK] for k in keys]


class PieceReader(Node[Any]):
    """Reads a slot's pieces in order, yielding ``((shard, row), row)`` (``refs=False``: the
    rows alone, for pipelines that keep no references, such as one without shuffle buffer).

    State: ``{"piece": i, "row": rows consumed in piece i, "skipped": rows that were None}``;
    loading re-opens piece ``i`` at that row through the reader (no re-reading of earlier
    pieces). Every field is checked against this slot's pieces: ``piece`` at most their
    number, ``row`` inside its piece (checked arithmetically when the piece's length is known,
    else by the reader yielding row ``row - 1`` on the first read), ``skipped`` at most the
    rows of the pieces consumed. Rows that are None are skipped and counted.
    """

    KIND, VERSION = "stream.reader", 1

    def __init__(self, stream: ShardedStream, pieces: list[Piece], *, refs: bool = True) -> None:
        self.stream, self.pieces, self.refs = stream, pieces, refs
        self.piece, self.row = 0, 0
        self.skipped = 0
        self._it: Iterator[Any] | None = None
        self._verify_row = False  # the first read after a restore checks the row exists

    def _length(self, p: Piece) -> int | None:
        if p.stop is not None:
            return p.stop - p.start
        return None if self.stream.rows is None else self.stream.rows[p.shard] - p.start

    def _open(self, p: Piece) -> Iterator[Any]:
        if not (self._verify_row and self.row > 0):
            return self.stream.read(p, self.row)
        self._verify_row = False
        it = self.stream.read(p, self.row - 1)
        if next(it, _END) is _END:
            raise ValueError(
                f"stream reader state has row={self.row} in piece {self.piece} (shard "
                f"{p.shard}, from row {p.start}), but the shard ends before it; the checkpoint "
                "is corrupted or the shards changed"
            )
        return it

    def next(self) -> Any:
        items = self.next_many(1)
        if not items:
            raise StopIteration
        return items[0]

    def next_many_refs(self, n: int) -> tuple[list[Any], list[int]]:
        """Up to ``n`` rows and their keys ``shard << 40 | row`` (ints, made per chunk by
        ``range``: no per-row tuple); :func:`json_refs` writes keys out as ``[shard, row]``."""
        out: list[Any] = []
        keys: list[int] = []
        while len(out) < n and self.piece < len(self.pieces):
            p = self.pieces[self.piece]
            if self._it is None:
                self._it = self._open(p)
            want = n - len(out)
            chunk = list(itertools.islice(self._it, want))
            first = p.start + self.row
            if first + len(chunk) > _ROW_MASK:
                raise ValueError(
                    f"shard {p.shard} has more than {_ROW_MASK} rows; split it into smaller shards"
                )
            base = (p.shard << _ROW_BITS) + first
            if any(map(operator.is_, chunk, itertools.repeat(None))):
                got = [(base + i, r) for i, r in enumerate(chunk) if r is not None]
                out.extend(r for _, r in got)
                keys.extend(k for k, _ in got)
                self.skipped += len(chunk) - len(got)
            else:
                out.extend(chunk)
                keys.extend(range(base, base + len(chunk)))
            self.row += len(chunk)
            if len(chunk) < want:
                self.piece, self.row, self._it = self.piece + 1, 0, None
        return out, keys

    json_refs = staticmethod(json_refs)

    def load_refs(self, refs: list[Any]) -> tuple[list[Any], list[int]]:
        """Re-read the rows of ``[shard, row]`` references (checked by
        :meth:`ShardedStream.load_rows`) and return them with their keys."""
        rows = self.stream.load_rows(refs)
        return rows, [(int(a) << _ROW_BITS) + int(b) for a, b in refs]

    def next_many(self, n: int) -> list[Any]:
        if not self.refs:
            return self._rows(n)
        rows, keys = self.next_many_refs(n)
        # (shard, row) tuples of ints, not lists: the cyclic GC untracks such tuples, so the
        # references a full shuffle buffer keeps alive add nothing to its collections
        return [((k >> _ROW_BITS, k & _ROW_MASK), r) for k, r in zip(keys, rows, strict=True)]

    def _rows(self, n: int) -> list[Any]:
        """``next_many`` without references: the per-batch hot path of an unshuffled slot."""
        out: list[Any] = []
        while len(out) < n and self.piece < len(self.pieces):
            if self._it is None:
                self._it = self._open(self.pieces[self.piece])
            want = n - len(out)
            chunk = list(itertools.islice(self._it, want))
            got = [r for r in chunk if r is not None]
            self.skipped += len(chunk) - len(got)
            self.row += len(chunk)
            if out:
                out.extend(got)
            else:
                out = got
            if len(chunk) < want:
                self.piece, self.row, self._it = self.piece + 1, 0, None
        return out

    def cursor(self) -> tuple[int, int, int]:
        """Where the reader is: ``(piece, row, skipped)`` (cheap; see :meth:`rewind`)."""
        return self.piece, self.row, self.skipped

    def rewind(self, cursor: tuple[int, int, int]) -> None:
        """Go back to ``cursor``, taken before a read that raised: the rows read since are
        read again (the piece is re-opened at that row), so the state is again the one as of
        the last rows returned."""
        self.piece, self.row, self.skipped = cursor
        self._it = None

    def state_dict(self) -> dict[str, Any]:
        return envelope(
            self.KIND, self.VERSION, piece=self.piece, row=self.row, skipped=self.skipped
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        what = "stream reader state"
        s = open_envelope(
            state,
            kind=self.KIND,
            version=self.VERSION,
            fields={"piece": int, "row": int, "skipped": int},
            what=what,
        )
        fix = "resume with the same shards, data-parallel size and num_workers"
        piece, row = s["piece"], s["row"]
        if piece > len(self.pieces):
            raise ValueError(
                f"{what} has piece={piece}, but this slot has {len(self.pieces)} pieces; {fix}"
            )
        length = self._length(self.pieces[piece]) if piece < len(self.pieces) else 0
        if length is not None and row > length:
            raise ValueError(
                f"{what} has row={row} in piece {piece}, which has {length} rows; the "
                f"checkpoint is corrupted, or {fix}"
            )
        check_count(row, name="row", what=what)
        consumed = [self._length(p) for p in self.pieces[:piece]]
        bound = MAX_COUNT if None in consumed else sum(c or 0 for c in consumed) + row
        check_count(s["skipped"], name="skipped", what=what, upper=min(bound, MAX_COUNT))
        self.piece, self.row, self._it = piece, row, None
        self.skipped = s["skipped"]
        self._verify_row = True


_END = object()


def slot_batches(
    stream: ShardedStream,
    pieces: list[Piece],
    *,
    shuffle_buffer: int,
    seed: int,
    batch_size: int,
    drop_last: bool,
) -> Node[list[Any]]:
    """The node of one (data rank, worker) slot: lists of ``batch_size`` rows, exact state.

    ``PieceReader -> ShuffleBuffer -> Batcher`` when ``shuffle_buffer > 1`` (the buffer keeps
    ``(shard, row)`` references and re-reads its rows on load), else ``PieceReader ->
    Batcher`` with no per-row references at all. Batches are plain lists of rows, ready for
    ``collate``; ``state_dict()`` nests reader (and buffer) states under ``"source"``.
    """
    if shuffle_buffer <= 1:
        return Batcher(
            PieceReader(stream, pieces, refs=False), batch_size=batch_size, drop_last=drop_last
        )
    shuffle = ShuffleBuffer(
        PieceReader(stream, pieces), size=shuffle_buffer, seed=seed, source_refs=True
    )
    return Batcher(shuffle, batch_size=batch_size, drop_last=drop_last)
