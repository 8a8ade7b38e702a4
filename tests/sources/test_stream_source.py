"""sources/stream.py: the slot reader's state, buffer references and unread rows."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfeed.nodes import Batcher, ShuffleBuffer
from meshfeed.sources.stream import Piece, PieceReader, ShardedStream, slot_batches
from meshfeed.sources.stream_loader import StreamLoader
from meshfeed.testing import assert_resume_equivalence, take
from tests.dist_utils import run_distributed


def _callable_stream(rows: list[int], *, known: bool = True, buffer: int = 0) -> ShardedStream:
    shards = [
        lambda s=s, n=n: (None if (s * 1000 + r) % 7 == 6 else s * 1000 + r for r in range(n))
        for s, n in enumerate(rows)
    ]
    return ShardedStream(shards, shuffle_buffer=buffer, rows=rows if known else None)


def _pipeline(stream: ShardedStream, pieces: list[Piece], *, size: int, batch: int) -> Batcher:
    reader = PieceReader(stream, pieces)
    shuffle = ShuffleBuffer(
        reader,
        size=size,
        seed=5,
        ref=lambda item: item[0],
        load=stream.load_items,
    )
    return Batcher(shuffle, batch_size=batch, drop_last=False)


def _values(batches: list) -> list[list[Any]]:
    return [[row for _, row in b] for b in batches]


@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("size", [0, 5])
def test_the_slot_pipeline_resumes_exactly_from_every_batch(known, size):
    stream = _callable_stream([9, 0, 13, 4], known=known)
    pieces = [Piece(0, 0, None), Piece(1, 0, None), Piece(2, 3, 11), Piece(3, 0, None)]
    assert_resume_equivalence(lambda: _pipeline(stream, pieces, size=size, batch=3), num_items=40)


def test_reader_next_many_matches_next_and_counts_none_rows():
    stream = _callable_stream([20, 15])
    pieces = [Piece(0, 2, None), Piece(1, 0, 10)]
    one = list(PieceReader(stream, pieces))
    many = PieceReader(stream, pieces)
    got = many.next_many(3) + many.next_many(7) + many.next_many(100)
    assert got == one and many.next_many(5) == []
    want = [r for r in range(2, 20) if r % 7 != 6] + [
        1000 + r for r in range(10) if (1000 + r) % 7 != 6
    ]
    assert [row for _, row in one] == want
    assert all(row == ref[0] * 1000 + ref[1] for ref, row in one)
    assert many.skipped == 4  # rows 6, 13 of shard 0 and 0, 7 of shard 1


def _reader_state(**fields: Any) -> dict[str, Any]:
    return {"kind": "stream.reader", "version": 1, "piece": 0, "row": 0, "skipped": 0, **fields}


@pytest.mark.parametrize("known", [True, False])
def test_a_row_beyond_its_piece_is_refused_not_skipped(known):
    # before: row=10**6 silently skipped the rest of the piece
    stream = _callable_stream([10, 10], known=known)
    reader = PieceReader(stream, [Piece(0, 0, None), Piece(1, 0, None)])
    if known:
        with pytest.raises(ValueError, match=r"row=1000000 in piece 0, which has 10 rows"):
            reader.load_state_dict(_reader_state(row=10**6))
    else:
        reader.load_state_dict(_reader_state(row=10**6))
        with pytest.raises(ValueError, match=r"row=1000000 in piece 0 .*ends before it"):
            reader.next_many(1)


def test_a_row_at_the_end_of_its_piece_is_a_valid_state():
    stream = _callable_stream([10, 3], known=False)
    reader = PieceReader(stream, [Piece(0, 0, None), Piece(1, 0, None)])
    reader.load_state_dict(_reader_state(row=10))
    assert [row for _, row in reader] == [1001, 1002]  # row 1000 is None: skipped


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"piece": 3}, "piece=3, but this slot has 2 pieces"),
        ({"piece": -1}, "negative"),
        ({"row": -5}, "negative"),
        ({"skipped": 10**30}, "'skipped' is 10{30}, outside"),
        ({"skipped": 11}, r"'skipped' is 11, outside \[0, 10\]"),
        ({"row": "3"}, "'row'"),
        ({"kind": "stream"}, "kind='stream.reader'"),
    ],
)
def test_absurd_reader_counters_are_refused_by_name(fields, match):
    # before: negative counters gave OverflowError, huge ones were accepted
    stream = _callable_stream([10, 10])
    reader = PieceReader(stream, [Piece(0, 0, None), Piece(1, 0, None)])
    with pytest.raises(ValueError, match=match):
        reader.load_state_dict(_reader_state(**{"piece": 1, "row": 0, **fields}))


def _buffered_state() -> tuple[ShardedStream, list[Piece], dict[str, Any]]:
    stream = _callable_stream([30, 30])
    pieces = [Piece(0, 0, None), Piece(1, 0, None)]
    pipe = _pipeline(stream, pieces, size=4, batch=3)
    next(pipe)
    return stream, pieces, json.loads(json.dumps(pipe.state_dict()))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda b: [[7, 1], *b[1:]], r"names shard 7, but this stream has 2 shards"),
        (lambda b: [b[0], b[0], *b[2:]], "more than once"),
        (lambda b: [[0, 99], *b[1:]], r"row 99 of shard 0, which has 30 rows"),
        (lambda b: [[0], *b[1:]], "not a \\[shard, row\\] pair"),
        (lambda b: [[0, -1], *b[1:]], "not a \\[shard, row\\] pair"),
    ],
)
def test_a_bad_buffer_reference_is_refused_by_name(edit, match):
    # before: a missing shard was a bare IndexError and a duplicate delivered a row twice
    stream, pieces, state = _buffered_state()
    state["source"]["buffer"] = edit(state["source"]["buffer"])
    with pytest.raises(ValueError, match=match):
        _pipeline(stream, pieces, size=4, batch=3).load_state_dict(state)


def test_the_loader_refuses_a_duplicated_buffer_reference_instead_of_repeating_a_row():
    stream = _callable_stream([12, 12], buffer=4)
    lo = StreamLoader(stream, batch_size=2, seed=1)
    take(lo, 1)
    state = json.loads(json.dumps(lo.state_dict()))
    buf = state["workers"][0]["source"]["buffer"]
    buf[1] = buf[0]
    fresh = StreamLoader(stream, batch_size=2, seed=1)
    with pytest.raises(ValueError, match="worker 0: .*more than once"):
        fresh.load_state_dict(state)  # refused at load, before any batch


# ----------------------------------------------------------------------- unread rows


def _read_per_epoch(
    stream: ShardedStream, R: int, W: int, B: int, drop_last: bool, *, seed: int = 3
) -> int:
    """Rows all R ranks read in epoch 0, simulated in one process."""
    total = 0
    for rank in range(R):
        lo = StreamLoader(
            stream,
            batch_size=B,
            mesh={"dp": R},
            rank=rank,
            num_workers=0,
            seed=seed,
            drop_last=drop_last,
        )
        # W slots read in one process, round-robin: what W worker processes read, without them
        lo.slots = W
        lo._worker_states = [None] * W
        lo._exhausted = [False] * W
        total += sum(len(b) for b in take(lo, 10**6, max_epochs=1))
    return total


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(0, 25), min_size=1, max_size=8),
    R=st.integers(1, 3),
    W=st.integers(1, 3),
    B=st.integers(1, 4),
    drop_last=st.booleans(),
)
def test_unread_rows_is_what_no_rank_reads(rows, R, W, B, drop_last):
    stream = ShardedStream(
        [lambda n=n, s=s: [s * 1000 + r for r in range(n)] for s, n in enumerate(rows)], rows=rows
    )
    try:
        unread = stream.unread_rows(
            0, R, W, seed=3, shuffle=True, batch_size=B, drop_last=drop_last
        )
    except ValueError:
        return  # a layout the assignment refuses
    assert unread is not None and 0 <= unread <= sum(rows)
    assert sum(rows) - unread == _read_per_epoch(stream, R, W, B, drop_last)


def test_whole_shard_assignment_can_leave_a_rank_with_nothing_and_every_row_unread():
    # 2 shards for 2 ranks (whole shards): rank 1's shard is empty, so no rank reads anything
    stream = ShardedStream([lambda: range(81), lambda: range(0)], rows=[81, 0])
    assert stream.unread_rows(0, 2, 1, seed=0, shuffle=False, batch_size=4, drop_last=True) == 81
    assert _read_per_epoch(stream, 2, 1, 4, True) == 0
    # without row counts the number cannot be known without reading the shards
    blind = ShardedStream([lambda: range(81), lambda: range(0)])
    assert blind.unread_rows(0, 2, 1, seed=0, shuffle=False, batch_size=4, drop_last=True) is None


def test_row_ranges_leave_only_the_drop_last_tails_unread():
    stream = ShardedStream([lambda: range(10), lambda: range(7), lambda: range(5)], rows=[10, 7, 5])
    # 22 rows split into 4 ranges of 5-6 rows; batch 2 drops one row of each 5-row range
    assert stream.unread_rows(0, 2, 2, seed=0, shuffle=True, batch_size=2, drop_last=True) == 2
    assert stream.unread_rows(0, 2, 2, seed=0, shuffle=True, batch_size=2, drop_last=False) == 0
    with pytest.raises(ValueError, match="batch_size"):
        stream.unread_rows(0, 2, 2, seed=0, shuffle=True, batch_size=0, drop_last=True)


# ----------------------------------------------------------------------- slot_batches


@pytest.mark.parametrize("size", [0, 1, 6])
@pytest.mark.parametrize("drop_last", [True, False])
def test_slot_batches_match_the_worker_pipeline_and_resume_exactly(size, drop_last):
    from meshfeed.sources.stream_workers import SlotConfig, SlotPipeline

    stream = _callable_stream([9, 0, 13, 4])
    pieces = [Piece(0, 0, None), Piece(1, 0, None), Piece(2, 3, 11), Piece(3, 0, None)]

    def make() -> Any:
        return slot_batches(
            stream, pieces, shuffle_buffer=size, seed=11, batch_size=3, drop_last=drop_last
        )

    config = SlotConfig(
        stream=stream,
        pieces=pieces,
        batch_size=3,
        drop_last=drop_last,
        shuffle_buffer=size,
        shuffle_seed=11,
        collate_fn=list,
    )
    pipe, want = SlotPipeline(config, None), []
    while (batch := pipe.next()[0]) is not None:
        want.append(batch)
    assert list(make()) == want
    assert all(isinstance(row, int) for batch in want for row in batch)
    assert_resume_equivalence(make, num_items=20)


def test_slot_batches_state_nests_reader_and_buffer():
    stream = _callable_stream([30, 30])
    node = slot_batches(
        stream, [Piece(0, 0, None)], shuffle_buffer=4, seed=0, batch_size=2, drop_last=True
    )
    next(node)
    state = node.state_dict()
    assert state["kind"] == "node.batcher" and state["source"]["kind"] == "node.shuffle"
    assert state["source"]["source"]["kind"] == "stream.reader"
    assert len(state["source"]["buffer"]) == 4


# ---------------------------------------------------------------------- real processes
_GLOO_ROWS = [81, 0, 12, 7]  # whole shards (4 divide 2 ranks x 2 workers); sizes unequal


def _gloo_read_rows(rank: int, world: int) -> dict[str, Any]:
    stream = ShardedStream(
        [lambda n=n, s=s: [s * 1000 + r for r in range(n)] for s, n in enumerate(_GLOO_ROWS)],
        rows=_GLOO_ROWS,
    )
    lo = StreamLoader(stream, batch_size=2, mesh={"dp": world}, num_workers=2, seed=4, timeout=60)
    try:
        read = sum(len(b) for b in take(lo, 10**6, max_epochs=1))
    finally:
        lo.shutdown()
    unread = stream.unread_rows(0, world, 2, seed=4, shuffle=True, batch_size=2, drop_last=True)
    return {"read": read, "unread": unread}


@pytest.mark.slow
def test_gloo_ranks_with_workers_leave_exactly_unread_rows_unread():
    results = run_distributed(_gloo_read_rows, 2, timeout=120)
    unread = {r["unread"] for r in results}
    assert len(unread) == 1  # every rank computes the same number without communication
    assert sum(r["read"] for r in results) + unread.pop() == sum(_GLOO_ROWS)
    # and the single-process simulation of both ranks agrees
    stream = ShardedStream(
        [lambda n=n, s=s: [s * 1000 + r for r in range(n)] for s, n in enumerate(_GLOO_ROWS)],
        rows=_GLOO_ROWS,
    )
    assert _read_per_epoch(stream, 2, 2, 2, True, seed=4) == sum(r["read"] for r in results)


def test_reader_keys_pack_shard_and_row_and_skip_none_rows():
    from meshfeed.sources.stream import json_refs

    stream = _callable_stream([20, 15])
    pieces = [Piece(0, 2, None), Piece(1, 0, 10)]
    pairs = list(PieceReader(stream, pieces))
    keyed = PieceReader(stream, pieces)
    rows, keys = [], []
    for n in (3, 7, 100):
        r, k = keyed.next_many_refs(n)
        rows += r
        keys += k
    assert rows == [row for _, row in pairs]
    assert json_refs(keys) == [list(ref) for ref, _ in pairs]
    assert keyed.state_dict() == PieceReader(stream, pieces).state_dict() | {
        "piece": 2,
        "row": 0,
        "skipped": keyed.skipped,
    }
    assert keyed.skipped == sum(1 for r in range(2, 20) if r % 7 == 6) + sum(
        1 for r in range(10) if (1000 + r) % 7 == 6
    )


@pytest.mark.parametrize("size", [2, 5, 64])
def test_slot_batches_keep_the_order_and_checkpoint_of_per_row_references(size):
    """Keys instead of per-row ``(shard, row)`` tuples change neither the rows nor the
    checkpoint (so checkpoints of earlier releases still load: no version bump)."""
    stream = _callable_stream([9, 0, 13, 4])
    pieces = [Piece(0, 0, None), Piece(1, 0, None), Piece(2, 3, 11), Piece(3, 0, None)]
    old = _pipeline(stream, pieces, size=size, batch=3)
    new = slot_batches(stream, pieces, shuffle_buffer=size, seed=5, batch_size=3, drop_last=False)
    for _ in range(4):
        assert [row for _, row in old.next()] == new.next()
        want = json.loads(json.dumps(old.state_dict()))
        assert new.state_dict() == want
    resumed = slot_batches(
        stream, pieces, shuffle_buffer=size, seed=5, batch_size=3, drop_last=False
    )
    resumed.load_state_dict(want)
    assert list(resumed) == [[row for _, row in b] for b in old]
