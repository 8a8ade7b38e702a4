"""Sharded streams on the loader: every row once, elastic resume, bad rows, identity, mixtures."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from meshfeed.errors import SourceError
from meshfeed.fetch import SampleError
from meshfeed.runtime.failures import WorkerError
from meshfeed.sources import Mixture
from meshfeed.sources.streams.stream import ShardedStream
from meshfeed.stream_loader import StreamLoader
from meshfeed.testing import assert_resume_equivalence, take
from tests.dist_utils import run_distributed
from tests.optional import given, settings, st
from tests.process_checks import SRC


class CountingReader:
    """A seeking reader over synthetic shards ``(shard id, rows)``; logs every row it yields.

    With ``path`` the reads are appended to that file, so reads made in worker processes
    are counted too (one short ``O_APPEND`` write per row).
    """

    def __init__(self, path: str | None = None) -> None:
        self.log: list[tuple[int, int]] = []
        self.path = path

    def __call__(self, shard: Any, start: int, stop: int | None) -> Any:
        sid, n = shard
        for r in range(start, n if stop is None else min(stop, n)):
            self.log.append((sid, r))
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(f"{sid},{r}\n")
            yield sid * 1000 + r

    def file_reads(self) -> Counter[tuple[int, int]]:
        assert self.path is not None
        with open(self.path) as f:
            return Counter(tuple(map(int, line.split(","))) for line in f)


class TableShards:
    """Shards named ``shard-i`` resolved through a table (a reader picklable to workers)."""

    def __init__(self, rows: list[int], path: str | None = None) -> None:
        self.table = {f"shard-{i}": (i, n) for i, n in enumerate(rows)}
        self.inner = CountingReader(path)

    def __call__(self, shard: str, start: int, stop: int | None) -> Any:
        return self.inner(self.table[shard], start, stop)

    def count(self, shard: str) -> int:
        return self.table[shard][1]


def _stream(rows: list[int], *, buffer: int = 0, path: str | None = None, **kw: Any):
    reader = TableShards(rows, path)
    shards = list(reader.table)
    return ShardedStream(shards, reader, shuffle_buffer=buffer, **kw), reader


def _all_rows(rows: list[int]) -> list[int]:
    return [s * 1000 + r for s, n in enumerate(rows) for r in range(n)]


def _rank_batches(stream: ShardedStream, R: int, **kw: Any) -> list[list[list[int]]]:
    """The batches of every data rank of an R-rank mesh, simulated in one process."""
    out = []
    for rank in range(R):
        lo = StreamLoader(stream, mesh={"dp": R}, rank=rank, **kw)
        out.append([b.tolist() for b in lo])
    return out


# ---------------------------------------------------------------------- every row, every epoch
@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(0, 30), min_size=1, max_size=9).filter(lambda r: sum(r) >= 8),
    R=st.integers(1, 4),
    B=st.integers(1, 3),
    buffer=st.sampled_from([0, 4, 17]),
    shuffle=st.booleans(),
)
def test_every_row_is_served_exactly_once_per_epoch_across_ranks(rows, R, B, buffer, shuffle):
    stream, _ = _stream(rows, buffer=buffer)
    total = sum(rows)
    if total < R * B:
        return
    per_rank, padded = [], 0
    for rank in range(R):
        lo = StreamLoader(
            stream, mesh={"dp": R}, rank=rank, batch_size=B, shuffle=shuffle, drop_last=False
        )
        per_rank.append([b.tolist() for b in lo])
        padded += lo.stats()["padded"]
    assert len({len(b) for b in per_rank}) == 1  # ranks stop together by construction
    served = [x for batches in per_rank for batch in batches for x in batch]
    assert set(served) == set(_all_rows(rows))  # every row ...
    assert len(served) == total + padded  # ... once, but for the counted padding
    assert padded < R


@pytest.mark.parametrize(
    ("rows", "R", "W"),
    [
        ([3, 9, 14, 6, 49], 3, 2),  # 5 shards of different sizes on 3 ranks x 2 workers
        ([17] * 6, 5, 1),  # 6 equal shards on 5 slots
        ([10, 12, 9, 8, 11, 9], 3, 2),  # a shard count that divides the slots
    ],
)
def test_uneven_shards_on_ranks_and_workers_lose_no_row(rows, R, W, caplog):
    stream, _ = _stream(rows)
    B = 2
    per_rank = []
    for rank in range(R):
        lo = StreamLoader(stream, batch_size=B, mesh={"dp": R}, rank=rank, num_workers=W)
        with lo, caplog.at_level(logging.WARNING, logger="meshfeed"):
            per_rank.append([b.tolist() for b in lo])
        unread = lo.stats()["unread_rows"]
    served = [x for batches in per_rank for b in batches for x in b]
    assert len(set(served)) == len(served)
    assert len(served) + unread == sum(rows)
    assert unread == sum(rows) % (R * B)  # only the dropped last global batch
    if unread:
        assert "drop_last" in caplog.text and "unread_rows" in caplog.text


def test_unread_rows_are_arithmetic_and_survive_a_resume():
    stream, _ = _stream([7, 8])  # 15 rows, global batch 4: 3 unread per epoch
    lo = StreamLoader(stream, batch_size=2, mesh={"dp": 2}, rank=0)
    for _ in lo.epochs(2):
        list(lo)
    assert lo.stats()["unread_rows"] == 6
    again = StreamLoader(stream, batch_size=2, mesh={"dp": 2}, rank=1)
    again.load_state_dict(json.loads(json.dumps(lo.state_dict())))
    assert again.stats()["unread_rows"] == 6
    assert StreamLoader(stream, batch_size=2, drop_last=False).stats()["unread_rows"] == 0


def test_len_is_known_for_every_stream_and_counts_without_rows():
    stream = ShardedStream([lambda: range(5), lambda: range(7)])
    assert len(stream) == 12
    lo = StreamLoader(stream, batch_size=4)
    assert len(lo) == 3 == len(list(lo))


# ---------------------------------------------------------------------- resume
@pytest.mark.parametrize("buffer", [0, 5])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.slow
def test_exact_resume_from_every_batch_across_epochs(buffer, num_workers):
    stream, _ = _stream([7, 5, 9, 3], buffer=buffer)

    def make() -> StreamLoader:
        return StreamLoader(stream, batch_size=3, num_workers=num_workers, seed=4)

    assert_resume_equivalence(
        make, num_items=18, cleanup=lambda lo: lo.shutdown(), max_state_bytes=1024
    )


def test_the_state_is_a_position_of_a_few_hundred_bytes():
    stream, _ = _stream([100_000] * 20, buffer=4096)
    lo = StreamLoader(stream, batch_size=32, mesh={"dp": 2}, rank=0)
    take(lo, 100)
    state = lo.state_dict()
    assert state["position"] == 100 * 64
    assert len(json.dumps(state)) < 600


@pytest.mark.parametrize(("dp_from", "dp_to", "w_to"), [(2, 4, 0), (4, 2, 2), (2, 1, 1)])
def test_a_state_saved_on_one_dp_size_resumes_on_another_with_the_remaining_rows(
    dp_from, dp_to, w_to
):
    rows = [23, 9, 31, 17]
    stream, _ = _stream(rows, buffer=8)
    G = 8
    first = []
    for rank in range(dp_from):
        lo = StreamLoader(stream, batch_size=G // dp_from, mesh={"dp": dp_from}, rank=rank)
        first.append(take(lo, 3))
    state = json.loads(json.dumps(lo.state_dict()))
    rest = []
    for rank in range(dp_to):
        lo2 = StreamLoader(
            stream, batch_size=G // dp_to, mesh={"dp": dp_to}, rank=rank, num_workers=w_to
        )
        lo2.load_state_dict(state)
        with lo2:
            rest.append([b.tolist() for b in lo2])
    served = [x for batches in first for b in batches for x in b.tolist()]
    served += [x for batches in rest for b in batches for x in b]
    assert len(served) == len(set(served)) == sum(rows) // G * G
    # the same global batches as a run that never stopped, on any dp size
    whole = StreamLoader(stream, batch_size=G, mesh={"dp": 1}, rank=0)
    assert sorted(served) == sorted(x for b in whole for x in b.tolist())


def test_workers_serve_the_same_batches_as_the_main_process():
    stream, _ = _stream([13, 4, 22, 9], buffer=6)
    a = [b.tolist() for b in StreamLoader(stream, batch_size=4)]
    with StreamLoader(stream, batch_size=4, num_workers=2) as lo:
        b = [x.tolist() for x in lo]
    assert a == b


def test_a_version_2_stream_state_of_the_previous_release_is_refused_by_version():
    stream, _ = _stream([4, 4])
    old = {"kind": "stream_loader", "version": 2, "epoch": 0, "steps": 1}
    with pytest.raises(ValueError, match=r"meshfeed 0\.2.*Restart the epoch"):
        StreamLoader(stream, batch_size=2).load_state_dict(old)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"buffer": 3}, "shuffle_buffer"),
        ({"seed": 1}, "seed"),
        ({"samples_per_epoch": 9}, "samples_per_epoch"),
    ],
)
def test_resume_with_another_stream_order_is_refused(change, match):
    stream, _ = _stream([8, 8], buffer=4)
    lo = StreamLoader(stream, batch_size=2)
    take(lo, 2)
    buffer = change.pop("buffer", 4)
    other, _ = _stream([8, 8], buffer=buffer, **change)
    with pytest.raises(ValueError, match=match):
        StreamLoader(other, batch_size=2).load_state_dict(lo.state_dict())


# ---------------------------------------------------------------------- shuffle
def test_shuffle_buffer_windows_are_seeded_and_reshuffle_per_epoch():
    stream, _ = _stream([30, 30], buffer=10)
    lo = StreamLoader(stream, batch_size=5)
    e0 = [x for b in lo for x in b.tolist()]
    e1 = [x for b in lo for x in b.tolist()]
    assert sorted(e0) == sorted(e1) == _all_rows([30, 30])
    assert e0 != e1
    assert e0 == [x for b in StreamLoader(stream, batch_size=5) for x in b.tolist()]
    # a window of 10 rows: every row lands within its window of the pass
    unshuffled = [x for b in StreamLoader(stream, batch_size=5, shuffle=False) for x in b.tolist()]
    assert unshuffled == _all_rows([30, 30])


def test_without_a_buffer_each_step_reads_one_contiguous_run():
    stream, reader = _stream([40, 40])
    lo = StreamLoader(stream, batch_size=4, mesh={"dp": 2}, rank=1)
    for batch in lo:
        xs = batch.tolist()
        assert xs == list(range(xs[0], xs[0] + 4))
    assert len(reader.inner.log) == 40  # rank 1 read only its own 40 rows


# ---------------------------------------------------------------------- epoch size
@pytest.mark.parametrize("per_epoch", [10, 55])
def test_samples_per_epoch_walks_on_through_passes_and_resumes(per_epoch):
    stream, _ = _stream([12, 8], buffer=5, samples_per_epoch=per_epoch)
    lo = StreamLoader(stream, batch_size=5, drop_last=False)
    assert len(lo) == -(-per_epoch // 5)
    epochs = [[x for b in lo for x in b.tolist()] for _ in range(4)]
    assert all(len(e) == per_epoch for e in epochs)
    flat = [x for e in epochs for x in e]
    for p in range(len(flat) // 20):  # each pass of 20 rows serves every row once
        assert sorted(flat[p * 20 : (p + 1) * 20]) == _all_rows([12, 8])

    def make() -> StreamLoader:
        return StreamLoader(stream, batch_size=5, drop_last=False)

    assert_resume_equivalence(make, num_items=3 * len(lo) + 1)


# ---------------------------------------------------------------------- bad rows
def _bad_row_reader(shard: Any, start: int, stop: int | None) -> Any:
    for r in range(start, 10 if stop is None else stop):
        if shard == "s1" and r == 3:
            raise ValueError(f"row {r} of {shard} does not parse")
        yield (0 if shard == "s0" else 100) + r


@pytest.mark.parametrize("on_error", ["skip", "substitute", "raise"])
def test_a_bad_row_is_retried_then_skipped_substituted_or_raised(on_error, caplog):
    stream = ShardedStream(["s0", "s1"], _bad_row_reader, rows=[10, 10])
    lo = StreamLoader(stream, batch_size=4, shuffle=False, on_error=on_error, max_retries=1)
    if on_error == "raise":
        with pytest.raises(SampleError, match="row 3 of s1 does not parse"):
            list(lo)
        return
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        rows = [x for b in lo for x in b.tolist()]
    assert 103 not in rows
    stats = lo.stats()
    assert stats["retries"] == 1 and stats["failures"][0]["index"] == 13
    if on_error == "skip":
        assert stats["skipped"] == 1 and len(rows) == 19
    else:
        assert stats["substituted"] == 1 and len(rows) == 20
        again = [x for b in StreamLoader(stream, batch_size=4, shuffle=False) for x in b.tolist()]
        assert again == rows  # the substitute is deterministic
    assert "substituted or skipped" in caplog.text


def test_rows_that_are_none_are_rejected_like_filtered_samples():
    stream = ShardedStream([lambda: [1, None, 3, 4], lambda: [5, 6, None, 8]])
    lo = StreamLoader(stream, batch_size=2, shuffle=False, on_error="skip", drop_last=False)
    assert [x for b in lo for x in b.tolist()] == [1, 3, 4, 5, 6, 8]
    assert lo.stats()["skipped"] == 2


def _damaged_reader(shard: Any, start: int, stop: int | None) -> Any:
    raise SourceError(f"shard {shard} is truncated")


def test_a_damaged_shard_is_a_source_error_never_a_bad_row():
    stream = ShardedStream(["x"], _damaged_reader, rows=[4])
    with pytest.raises(SourceError, match="shard x is truncated"):
        list(StreamLoader(stream, batch_size=2))


def _slow_shard() -> Any:
    yield 1
    time.sleep(30)
    yield 2


def _dying_shard() -> Any:
    yield 1
    os._exit(3)


@pytest.mark.parametrize(
    ("shard", "match"),
    [(_slow_shard, "nothing for step 0 within timeout=1.0s"), (_dying_shard, "exit code 3")],
)
def test_a_stalled_or_dead_stream_worker_is_reported_not_waited_for(shard, match):
    stream = ShardedStream([shard, lambda: iter([5, 6, 7])], rows=[2, 3])
    lo = StreamLoader(stream, batch_size=2, num_workers=2, timeout=1.0, shuffle=False)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=match):
        list(lo)
    assert time.monotonic() - start < 10
    lo.shutdown()


# ---------------------------------------------------------------------- identity
def test_a_rewritten_shard_is_refused_on_resume_by_name(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"part-{i}.jsonl"
        p.write_text("".join(json.dumps({"x": i * 10 + r}) + "\n" for r in range(6)))
        paths.append(str(p))
    stream = ShardedStream(paths)
    lo = StreamLoader(stream, batch_size=2, collate_fn=lambda rows: [r["x"] for r in rows])
    take(lo, 2)
    state = lo.state_dict()
    time.sleep(0.01)
    # same size, new content
    (tmp_path / "part-1.jsonl").write_text(
        "".join(json.dumps({"x": 90 + r}) + "\n" for r in range(6))
    )
    with pytest.raises(ValueError, match=r"part-1\.jsonl changed after the checkpoint"):
        StreamLoader(ShardedStream(paths), batch_size=2).load_state_dict(state)


def _rows_of(n: int, offset: int = 0) -> range:
    return range(offset, offset + n)


@pytest.mark.slow
def test_partial_shards_have_the_same_fingerprint_in_every_process():
    code = (
        "import functools, sys\n"
        "from meshfeed.sources import ShardedStream\n"
        "from tests.sources.test_sources_stream import _rows_of\n"
        "s = ShardedStream([functools.partial(_rows_of, 5, offset=i) for i in range(3)])\n"
        "print(s.fingerprint.rsplit(':', 1)[0])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, root]))
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        ).stdout.strip()
        for _ in range(2)
    }
    here = ShardedStream([functools.partial(_rows_of, 5, offset=i) for i in range(3)])
    assert outs == {here.fingerprint.rsplit(":", 1)[0]}
    other = ShardedStream([functools.partial(_rows_of, 5, offset=i + 1) for i in range(3)])
    assert other.fingerprint != here.fingerprint


# ---------------------------------------------------------------------- files
def test_jsonl_and_text_files_are_read_by_index(tmp_path):
    j = tmp_path / "a.jsonl"
    j.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(9)))
    t = tmp_path / "b.txt"
    t.write_text("\n".join(f"line {i}" for i in range(4)))  # no final newline
    stream = ShardedStream([str(j), str(t)], shuffle_buffer=5)
    assert len(stream) == 13
    assert stream[10] == "line 1" and stream[2] == {"i": 2}
    lo = StreamLoader(stream, batch_size=13, collate_fn=list)
    (batch,) = list(lo)
    assert sorted(map(str, batch)) == sorted(
        map(str, [{"i": i} for i in range(9)] + [f"line {i}" for i in range(4)])
    )


def _jsonl_shards(folder: Any, n: int = 3, rows: int = 10) -> list[Any]:
    paths = []
    for s in range(n):
        path = folder / f"part-{s}.jsonl"
        path.write_text("".join(json.dumps({"id": s * 100 + r}) + "\n" for r in range(rows)))
        paths.append(path)
    return paths


def _ids(rows: list[dict[str, int]]) -> list[int]:
    return [row["id"] for row in rows]


@pytest.mark.parametrize("change", ["deleted", "shrunk"])
def test_a_jsonl_shard_gone_or_shrunk_after_counting_is_a_source_error_never_substituted(
    tmp_path, change
):
    paths = _jsonl_shards(tmp_path)
    lo = StreamLoader(ShardedStream(paths), batch_size=5, seed=0, collate_fn=_ids)
    if change == "deleted":
        paths[1].unlink()
        match = r"shard .*part-1\.jsonl is missing: it was deleted or moved after"
    else:
        paths[1].write_text("".join(json.dumps({"id": 100 + r}) + "\n" for r in range(4)))
        match = r"shard .*part-1\.jsonl holds 4 rows, but row \d was asked for: it changed"
    with pytest.raises(SourceError, match=match):
        list(lo)
    assert lo.stats()["substituted"] == 0


def _ten_rows() -> Any:
    return ({"id": 100 + r} for r in range(10))


def _ten_rows_no_take(shard: Any, start: int, stop: int | None) -> Any:
    return itertools.islice(({"id": 200 + r} for r in range(10)), start, stop)


@pytest.mark.parametrize("shard", ["jsonl", "generator", "range reader"])
def test_rows_past_a_shards_end_are_a_source_error_never_substituted(tmp_path, shard):
    if shard == "jsonl":
        (path,) = _jsonl_shards(tmp_path, n=1)
        stream = ShardedStream([path], rows=[14])
    elif shard == "generator":
        stream = ShardedStream([_ten_rows], rows=[14])
    else:
        stream = ShardedStream(["s"], _ten_rows_no_take, rows=[14])
    lo = StreamLoader(stream, batch_size=7, shuffle=False, collate_fn=_ids)
    with pytest.raises(SourceError, match=r"holds 10 rows, but row 13 was asked for.*rows="):
        list(lo)
    assert lo.stats()["substituted"] == 0


def test_a_line_of_a_jsonl_shard_that_is_not_json_is_a_bad_row_substituted(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"id": r}) + "\n" for r in range(5)) + "{broken\n")
    lo = StreamLoader(ShardedStream([path]), batch_size=6, shuffle=False, collate_fn=_ids)
    (batch,) = list(lo)
    assert sorted(batch[:5]) == [0, 1, 2, 3, 4] and batch[5] in range(5)
    assert lo.stats()["substituted"] == 1
    assert lo.stats()["failures"][0]["error"] == "JSONDecodeError"


@pytest.mark.parametrize("span_bytes", [1 << 20, 40], ids=["one span", "runs"])
def test_blank_lines_of_a_jsonl_shard_are_no_rows_as_meshfeed_convert_reads_it(
    tmp_path, monkeypatch, span_bytes
):
    from meshfeed.sources.converters.shards import convert_to_shards
    from meshfeed.sources.streams import readers
    from meshfeed.sources.streams.readers import DefaultReader, default_reader

    monkeypatch.setattr(readers, "_SPAN_BYTES", span_bytes)  # "runs": a read per run of rows
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rec = [json.dumps({"id": i}) for i in range(9)]
    # blank lines first, between rows, whitespace-only, CRLF, and a trailing blank line
    a.write_text(f"\n{rec[0]}\n\n \t\n{rec[1]}\r\n{rec[2]}\n\x0c\n{rec[3]}\n\n")
    b.write_text(f"{rec[4]}\n\n{rec[5]}\n{rec[6]}\n  \n\n{rec[7]}\n{rec[8]}")  # no final newline
    index = convert_to_shards([a, b], tmp_path / "shards", rows_per_shard=4)
    converted = [row["id"] for row in ShardedStream.from_index(index)]
    assert converted == list(range(9))
    stream = ShardedStream([a, b])
    assert len(stream) == 9 and stream.rows == [4, 5]
    assert [stream[i]["id"] for i in range(9)] == converted  # row index -> the same record
    assert _ids(stream.__getitems__([8, 0, 5, 3, 3, 1])) == [8, 0, 5, 3, 3, 1]
    for path, first in ((a, 0), (b, 4)):  # the range form agrees with take
        n = stream.rows[first > 0]
        assert _ids(default_reader(path, 0, None)) == list(range(first, first + n))
        assert _ids(default_reader(path, 2, 3)) == [first + 2]
    assert DefaultReader().count(b) == 5
    lo = StreamLoader(stream, batch_size=3, seed=1, collate_fn=_ids)
    assert sorted(x for batch in lo for x in batch) == converted
    assert_resume_equivalence(
        lambda: StreamLoader(ShardedStream([a, b]), batch_size=2, seed=1, collate_fn=_ids),
        num_items=7,
    )


# ---------------------------------------------------------------------- mixtures of streams
def test_a_mixture_of_streams_holds_its_weights_in_every_prefix_and_resumes():
    a, _ = _stream([200, 400], buffer=16)
    b = ShardedStream([lambda: range(5000, 5150), lambda: range(6000, 6050)], shuffle_buffer=16)
    mix = Mixture({"a": a, "b": b}, {"a": 3, "b": 1}, seed=1)
    lo = StreamLoader(mix, batch_size=8, mesh={"dp": 2}, rank=0)
    served = [x for batch in take(lo, 25) for x in batch.tolist()]
    assert len(served) == len(set(served)) == 200
    counts = lo.stats()["order"]["consumed"]
    assert abs(counts["a"] - 3 * 400 / 4) <= 1 and abs(counts["b"] - 400 / 4) <= 1

    def make() -> StreamLoader:
        return StreamLoader(mix, batch_size=8, mesh={"dp": 2}, rank=1)

    assert_resume_equivalence(make, num_items=20, every=3)


def test_stream_loader_refuses_a_map_style_dataset_by_name():
    with pytest.raises(TypeError, match="use meshfeed.DataLoader"):
        StreamLoader(list(range(8)), batch_size=2)


# ---------------------------------------------------------------------- real processes
def _elastic_rank(rank: int, world: int, state: dict[str, Any] | None) -> dict[str, Any]:
    stream, _ = _stream([23, 9, 31, 17, 12], buffer=8)
    lo = StreamLoader(stream, batch_size=8 // world, mesh={"dp": world}, timeout=60)
    if state is None:
        got = [b.tolist() for b in take(lo, 3)]
        return {"rows": got, "state": lo.state_dict(), "steps_left": len(lo) - 3}
    lo.load_state_dict(state)
    got = [b.tolist() for b in lo]
    return {"rows": got, "steps": len(got)}


def _elastic_first(rank: int, world: int) -> dict[str, Any]:
    return _elastic_rank(rank, world, None)


def _elastic_second(rank: int, world: int) -> dict[str, Any]:
    with open(os.environ["MESHFEED_TEST_STATE"]) as f:
        return _elastic_rank(rank, world, json.load(f))


@pytest.mark.slow
def test_gloo_ranks_resume_a_stream_on_another_dp_size_with_every_row_once(tmp_path, monkeypatch):
    first = run_distributed(_elastic_first, 2, timeout=120)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(first[0]["state"]))
    monkeypatch.setenv("MESHFEED_TEST_STATE", str(path))
    second = run_distributed(_elastic_second, 4, timeout=120)
    assert len({r["steps"] for r in second}) == 1  # ranks stop together
    assert second[0]["steps"] == first[0]["steps_left"]
    served = [x for r in first + second for b in r["rows"] for x in b]
    total = 23 + 9 + 31 + 17 + 12
    assert len(served) == len(set(served)) == total // 8 * 8


def _failing_rank(rank: int, world: int) -> dict[str, Any]:
    stream = ShardedStream(["s0", "s1"], _bad_row_reader, rows=[10, 10])
    lo = StreamLoader(
        stream, batch_size=2, mesh={"dp": world}, shuffle=False, on_error="raise", timeout=30
    )
    got = 0
    try:
        for _ in lo:
            got += 1
    except Exception as exc:
        return {"steps": got, "error": type(exc).__name__, "message": str(exc)}
    return {"steps": got, "error": None, "message": ""}


@pytest.mark.slow
def test_gloo_a_failing_rank_makes_every_rank_raise_at_the_same_step():
    results = run_distributed(_failing_rank, 2, timeout=120)
    assert all(r["error"] is not None for r in results)
    assert len({r["steps"] for r in results}) == 1
    assert any("row 3 of s1 does not parse" in r["message"] for r in results)


def test_rank_batches_of_simulated_ranks_concatenate_to_the_global_batches():
    stream, _ = _stream([11, 20, 7], buffer=6)
    per_rank = _rank_batches(stream, 2, batch_size=3)
    whole = [b.tolist() for b in StreamLoader(stream, batch_size=6)]
    assert [a + b for a, b in zip(*per_rank, strict=True)] == whole
    np.testing.assert_array_equal(np.array(whole).shape, (len(whole), 6))


def _ray_stream() -> ShardedStream:
    """Built inside each Ray actor (Twinkle's call shape): the driver never reads a shard."""
    return _stream([11, 20, 7, 14], buffer=6)[0]


@pytest.mark.ray
@pytest.mark.slow
def test_a_stream_on_ray_actors_gives_every_data_rank_the_batches_it_gets_in_process(ray_session):
    import ray

    from meshfeed.services.ray import RayService

    lo = StreamLoader(
        _ray_stream, batch_size=3, mesh={"dp": 2}, service=RayService(num_actors=2), seed=5
    )
    with lo:
        remote = list(lo)
        got = {
            rank: [b.tolist() for b in ray.get([rb.for_rank(rank) for rb in remote])]
            for rank in range(2)
        }
    for rank in range(2):
        here = StreamLoader(_ray_stream(), batch_size=3, mesh={"dp": 2}, rank=rank, seed=5)
        assert got[rank] == [b.tolist() for b in here]
