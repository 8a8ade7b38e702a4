"""A shuffle buffer over shards read forward (a callable shard, a range reader without ``take``):
each shard is read once per pass, whatever order a window's rows are asked for in; only the
rows a window still asks for are kept; the rows and their order are the stream's own."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from meshfeed.order.permutation import Permutation
from meshfeed.sources import LazyDataset
from meshfeed.sources.streams.readers import RowCursor
from meshfeed.sources.streams.stream import ShardedStream
from meshfeed.stream_loader import StreamLoader
from meshfeed.testing import assert_resume_equivalence

SIZES = [300, 133, 517, 7]


def _rows(n: int, base: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {"id": base + i, "seen": []}


def _shards() -> list[Any]:
    return [functools.partial(_rows, n, 1000 * k) for k, n in enumerate(SIZES)]


class Counted:
    """A callable shard that counts its calls and the rows it yields."""

    def __init__(self, n: int, base: int) -> None:
        self.n, self.base = n, base
        self.calls = self.rows = 0

    def __call__(self) -> Iterator[dict[str, Any]]:
        self.calls += 1
        for i in range(self.n):
            self.rows += 1
            yield {"id": self.base + i, "seen": []}


class Indexed:
    """The same rows read by index (``take``): the reference a shard read forward must match."""

    def __init__(self) -> None:
        self.table = {f"s{k}": [r["id"] for r in _rows(n, 1000 * k)] for k, n in enumerate(SIZES)}

    def __call__(self, shard: str, start: int, stop: int | None) -> Iterator[dict[str, Any]]:
        return ({"id": i, "seen": []} for i in self.table[shard][start:stop])

    def take(self, shard: str, rows: np.ndarray) -> list[dict[str, Any]]:
        return [{"id": self.table[shard][r], "seen": []} for r in rows.tolist()]


def _ids(rows: list[dict[str, Any]]) -> list[int]:
    return [r["id"] for r in rows]


def _epochs(stream: ShardedStream, epochs: int = 2, **kw: Any) -> list[list[int]]:
    kw = {"batch_size": 8, "seed": 7, "collate_fn": _ids, "drop_last": False, **kw}
    with StreamLoader(stream, **kw) as loader:
        return [[x for b in loader for x in b] for _ in loader.epochs(epochs)]


# ---------------------------------------------------------------------- the rows and their order
#: The first two epochs of ``_epochs(ShardedStream(_shards(), shuffle_buffer=64))``, as served
#: before shards read forward kept a window's rows (blake2b-64 of their JSON): the order is a
#: checkpoint's meaning, so how rows are read must never change it.
PINNED = "65b43f9ea6140408"


def _digest(epochs: list[list[int]]) -> str:
    return hashlib.blake2b(json.dumps(epochs).encode(), digest_size=8).hexdigest()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_callable_shard_serves_the_rows_of_the_stream_order_in_it(num_workers):
    got = _epochs(ShardedStream(_shards(), shuffle_buffer=64), num_workers=num_workers)
    indexed = Indexed()
    reference = _epochs(ShardedStream(list(indexed.table), indexed, shuffle_buffer=64))
    assert got == reference
    assert _digest(got) == PINNED
    assert sorted(got[0]) == sorted(got[1]) != got[1]  # every row once, reshuffled per epoch


@pytest.mark.parametrize("dp", [1, 3])
def test_each_data_rank_serves_the_rows_an_indexed_read_serves(dp):
    indexed = Indexed()
    for rank in range(dp):
        kw = {"mesh": {"dp": dp}, "rank": rank, "batch_size": 3}
        got = _epochs(ShardedStream(_shards(), shuffle_buffer=50), **kw)
        assert got == _epochs(ShardedStream(list(indexed.table), indexed, shuffle_buffer=50), **kw)


def test_a_stream_resumed_mid_epoch_serves_the_rest_of_the_epoch():
    def make() -> StreamLoader:
        stream = ShardedStream(_shards(), shuffle_buffer=40)
        return StreamLoader(stream, batch_size=16, seed=3, collate_fn=_ids, drop_last=False)

    assert_resume_equivalence(make, num_items=80, every=7)


def add_eos(row: dict[str, Any]) -> dict[str, Any]:  # edits the row in place
    row["seen"].append(0)
    return row


@pytest.mark.parametrize("num_workers", [0, 2])
def test_rows_kept_for_a_window_are_fresh_in_every_epoch(num_workers):
    ds = LazyDataset(ShardedStream(_shards(), shuffle_buffer=64)).map(add_eos)
    with StreamLoader(
        ds, batch_size=8, seed=0, num_workers=num_workers, collate_fn=list, drop_last=False
    ) as loader:
        for _ in loader.epochs(3):
            assert all(r["seen"] == [0] for b in loader for r in b)


# ---------------------------------------------------------------------- one read per pass
@pytest.mark.parametrize("dp", [1, 2])
def test_a_callable_shard_is_read_once_per_pass_and_holds_at_most_its_windows(dp):
    """Asking for a row before the read position started the callable over: with a shuffle
    buffer, several times per window (hundreds of calls per shard and epoch)."""
    window, batch = 64, 8
    for rank in range(dp):
        shards = [Counted(n, 1000 * k) for k, n in enumerate(SIZES)]
        stream = ShardedStream(shards, shuffle_buffer=window, rows=SIZES)
        loader = StreamLoader(
            stream, batch_size=batch, mesh={"dp": dp}, rank=rank, collate_fn=_ids, drop_last=False
        )
        for _ in loader.epochs(3):
            for s in shards:
                s.calls = s.rows = 0
            for _ in loader:
                # a batch draws from one window or two: never more kept than that
                assert all(len(c.span) <= 2 * window for c in stream._cursors.values())
            assert [s.calls for s in shards] == [1] * len(SIZES)
            # no row read twice (a rank reads a shard no further than its last row there)
            read = [s.rows for s in shards]
            assert read == SIZES if dp == 1 else all(map(int.__le__, read, SIZES))


def test_a_range_reader_is_read_once_per_pass_with_a_shuffle_buffer():
    """A seeking reader without ``take`` (the stream's own cursor) reads each row once."""
    reads: Counter[tuple[str, int]] = Counter()

    def reader(shard: str, start: int, stop: int | None) -> Iterator[int]:
        n = SIZES[int(shard[1:])]
        for r in range(start, n if stop is None else stop):
            reads[shard, r] += 1
            yield 1000 * int(shard[1:]) + r

    stream = ShardedStream([f"s{k}" for k in range(len(SIZES))], reader, shuffle_buffer=64)
    len(stream)  # counted: one pass
    reads.clear()
    served = [x for b in StreamLoader(stream, batch_size=8, drop_last=False) for x in b.tolist()]
    assert len(served) == sum(SIZES) == len(set(served))
    assert set(reads.values()) == {1} and len(reads) == sum(SIZES)


def test_the_cursor_reads_a_window_permuted_shard_forward_once():
    calls = []

    def shard() -> Iterator[int]:
        calls.append(1)
        yield from range(1000)

    def reader(shard: Any, start: int, stop: int | None) -> Iterator[int]:
        return itertools.islice(shard(), start, stop)

    window = 100
    cursor = RowCursor(reader, shard, seeks=False, window=window)
    # rows [0, 1000) window by window, each permuted, asked 7 at a time
    order = np.concatenate(
        [w + Permutation(window, w)[np.arange(window)] for w in range(0, 1000, window)]
    )
    got = [x for a in range(0, 1000, 7) for x in cursor.take(order[a : a + 7])]
    assert got == order.tolist() and len(calls) == 1
    assert len(cursor.span) <= window
    assert cursor.take(np.array([5, 3])) == [5, 3] and len(calls) == 2  # a new pass
