"""A stream never hands the same row object out twice: an in-place edit of a row (a ``map``, a
``collate_fn``) never reaches a later read of that row, as with a fresh call of the shard."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from meshfeed.sources import LazyDataset
from meshfeed.sources.streams.readers import DefaultReader, RowCursor
from meshfeed.sources.streams.stream import ShardedStream
from meshfeed.stream_loader import StreamLoader


def shard():
    for r in range(4):
        yield {"id": r, "tokens": [1, 2, 3]}


def add_eos(row):  # edits the row in place
    row["tokens"].append(0)
    return row


def tokens(rows):
    return [list(r["tokens"]) for r in rows]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle_buffer", [0, 4])
def test_an_in_place_map_is_applied_once_per_read_in_every_epoch(num_workers, shuffle_buffer):
    ds = LazyDataset(ShardedStream([shard], shuffle_buffer=shuffle_buffer)).map(add_eos)
    with StreamLoader(
        ds, batch_size=4, seed=0, num_workers=num_workers, collate_fn=tokens
    ) as loader:
        for _ in loader.epochs(3):
            assert [b for batch in loader for b in batch] == [[1, 2, 3, 0]] * 4


def _range_reader(shard, start, stop):
    """A custom reader with no ``take``: read through the stream's kept span."""
    return ({"i": i, "seen": []} for i in range(start, 10 if stop is None else stop))


def test_a_row_read_again_from_the_kept_span_is_a_new_object():
    cursor = RowCursor(_range_reader, "s")
    first = cursor.take(np.array([2, 0, 1]))  # read [0, 3), kept
    for row in first:
        row["seen"].append("edited")
    again = cursor.take(np.array([1, 2]))
    assert [r["i"] for r in again] == [1, 2] and all(r["seen"] == [] for r in again)
    assert not {id(r) for r in again} & {id(r) for r in first}


def test_rows_of_the_kept_span_not_handed_out_yet_are_served_from_it_once():
    reads = []

    def reader(shard, start, stop):
        reads.append(start)
        return _range_reader(shard, start, stop)

    cursor = RowCursor(reader, "s", seeks=False)
    a = cursor.take(np.array([0, 5]))  # reads [0, 6)
    b = cursor.take(np.array([3, 1, 2, 4]))  # the rest of the span: no read
    assert reads == [0] and [r["i"] for r in a + b] == [0, 5, 3, 1, 2, 4]
    c = cursor.take(np.array([4, 6]))  # 4 was handed out: read again
    assert [r["i"] for r in c] == [4, 6] and c[0] is not b[-1] and reads == [0, 4]


def test_a_row_asked_for_twice_in_one_call_is_two_objects():
    cursor = RowCursor(_range_reader, "s")
    rows = cursor.take(np.array([3, 1, 3]))
    assert [r["i"] for r in rows] == [3, 1, 3] and rows[0] is not rows[2]
    rows = cursor.take(np.array([2, 2]))  # from the kept span
    assert rows[0] is not rows[1] and rows[0]["seen"] is not rows[1]["seen"]


def test_a_forward_run_hands_every_row_out_once():
    cursor = RowCursor(_range_reader, "s", seeks=False)
    first = cursor.take(np.arange(0, 4))
    again = cursor.take(np.arange(0, 4))  # a new epoch: read again
    assert [r["i"] for r in again] == [0, 1, 2, 3]
    assert all(x is not y for x, y in zip(first, again, strict=True))


def test_the_default_readers_callable_shards_give_fresh_rows_on_every_take():
    reader = DefaultReader()
    first = reader.take(shard, np.array([1, 0]))
    first[0]["tokens"].append(0)
    assert [r["tokens"] for r in reader.take(shard, np.array([0, 1, 1]))] == [[1, 2, 3]] * 3


def test_the_default_readers_rows_read_by_offset_asked_twice_are_two_objects(tmp_path):
    path = str(tmp_path / "rows.jsonl")
    pad = "x" * 4096
    with open(path, "w") as f:  # more than one kept span's bytes: read by offsets
        f.writelines(json.dumps({"i": i, "pad": pad, "l": []}) + "\n" for i in range(400))
    rows = DefaultReader().take(path, np.array([399, 0, 399]))
    assert [r["i"] for r in rows] == [399, 0, 399] and rows[0] is not rows[2]


def _uncopyable_reader(shard: Any, start: int, stop: int | None) -> Iterator[Any]:
    for i in range(start, 10 if stop is None else stop):
        yield {"i": i, "lock": threading.Lock()}  # a lock cannot be deep-copied


def test_a_row_asked_twice_that_cannot_be_copied_is_handed_out_as_it_is():
    """Before rows were copied, a row asked twice was served twice as one object: one that
    cannot be deep-copied still is, rather than failing the batch."""
    rows = RowCursor(_uncopyable_reader, "s").take(np.array([3, 1, 3]))
    assert [r["i"] for r in rows] == [3, 1, 3] and rows[0] is rows[2]
