"""Sharded streams: exclusive assignment, exactly-once reads, shuffle buffer, exact resume."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfeed.sources.stream import ShardedStream
from meshfeed.sources.stream_loader import StreamLoader, StreamRankError
from meshfeed.sources.stream_workers import StreamWorkerError
from meshfeed.testing import assert_resume_equivalence, take
from tests.dist_utils import run_distributed


class CountingReader:
    """A seeking reader over synthetic shards; records every (shard, row) it yields.

    With ``path`` the reads are appended to that file, so reads made in worker processes
    are counted too (one short ``O_APPEND`` write per row).
    """

    def __init__(self, log: list[tuple[int, int]] | None = None, path: str | None = None) -> None:
        self.log = log if log is not None else []
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


def _stream(
    rows: list[int],
    *,
    known: bool,
    buffer: int = 0,
    log: list | None = None,
    path: str | None = None,
) -> tuple[ShardedStream, CountingReader]:
    shards = [f"shard-{i}" for i in range(len(rows))]
    reader = CountingReader(log, path)
    table = dict(zip(shards, enumerate(rows), strict=True))
    return ShardedStream(
        shards,
        lambda s, a, b: reader(table[s], a, b),
        shuffle_buffer=buffer,
        rows=rows if known else None,
    ), reader


def _all_rows(rows: list[int]) -> list[int]:
    return [s * 1000 + r for s, n in enumerate(rows) for r in range(n)]


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(st.integers(0, 30), min_size=1, max_size=9),
    R=st.integers(1, 4),
    W=st.integers(1, 3),
    epoch=st.integers(0, 3),
    known=st.booleans(),
)
def test_assignment_is_exclusive_and_exhaustive(rows, R, W, epoch, known):
    stream, _ = _stream(rows, known=known)
    if (not known or len(rows) % (R * W) == 0) and len(rows) < R:
        with pytest.raises(ValueError, match="shards cannot feed"):
            stream.assign(epoch, R, W, seed=1, shuffle=True)
        return
    if known and len(rows) % (R * W) and sum(rows) < R * W:
        with pytest.raises(ValueError, match="slots"):
            stream.assign(epoch, R, W, seed=1, shuffle=True)
        return
    pieces = stream.assign(epoch, R, W, seed=1, shuffle=True)
    covered = Counter()
    per_slot = []
    for rank in pieces:
        for slot in rank:
            n = 0
            for p in slot:
                stop = rows[p.shard] if p.stop is None else p.stop
                covered.update((p.shard, r) for r in range(p.start, stop))
                n += stop - p.start
            per_slot.append(n)
    assert covered == Counter((s, r) for s, n in enumerate(rows) for r in range(n))
    if known and len(rows) % (R * W):
        assert max(per_slot) - min(per_slot) <= 1  # split by row ranges: balanced to one row


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    ("rows", "known", "R"),
    [([10, 7, 12, 5], False, 2), ([9, 9, 9], True, 2), ([6] * 5, True, 3), ([4, 11], True, 4)],
)
def test_every_row_is_read_once_by_exactly_one_rank(rows, known, R, num_workers, tmp_path):
    """Simulates every data rank in one process; counts the reader's reads per row."""
    delivered, steps, reads = [], [], Counter()
    for r in range(R):
        path = tmp_path / f"reads-{r}.txt"
        path.touch()
        stream, reader = _stream(rows, known=known, buffer=3, path=str(path))
        with StreamLoader(
            stream, batch_size=2, mesh={"dp": R}, rank=r, drop_last=False, num_workers=num_workers
        ) as lo:
            batches = [b.tolist() for b in lo]
        steps.append(len(batches))
        delivered += [x for b in batches for x in b]
        mine = reader.file_reads()
        assert max(mine.values(), default=1) == 1  # nothing read twice, not even within a rank
        assert not set(mine) & set(reads)  # no row read by two ranks
        reads.update(mine)
    assert reads == Counter((s, r) for s, n in enumerate(rows) for r in range(n))
    assert len(delivered) == len(set(delivered))
    if not known:
        assert sorted(delivered) == _all_rows(rows)  # each rank ran to its own end
    else:
        assert len(set(steps)) == 1  # known lengths: ranks stop together by construction


def test_workers_serve_round_robin_and_match_in_process_shards():
    stream, _ = _stream([6, 6, 6, 6], known=True)
    with StreamLoader(stream, batch_size=3, num_workers=2, shuffle=False) as lo:
        got = [b.tolist() for b in lo]
    assert got == [[0, 1, 2], [1000, 1001, 1002], [3, 4, 5], [1003, 1004, 1005],
                   [2000, 2001, 2002], [3000, 3001, 3002], [2003, 2004, 2005], [3003, 3004, 3005]]  # fmt: skip


def test_shuffle_buffer_is_seeded_and_reshuffles_per_epoch():
    stream, _ = _stream([20, 20], known=True, buffer=8)
    a = StreamLoader(stream, batch_size=5, seed=3)
    b = StreamLoader(stream, batch_size=5, seed=3)
    first = [x.tolist() for x in a]
    assert first == [x.tolist() for x in b]
    assert sorted(sum(first, [])) == _all_rows([20, 20])
    assert sum(first, []) != _all_rows([20, 20])
    assert [x.tolist() for x in a] != first  # epoch 1 differs


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_with_shuffle_buffer_across_epochs(num_workers):
    stream, _ = _stream([7, 5, 9], known=False, buffer=4)

    def factory() -> StreamLoader:
        return StreamLoader(stream, batch_size=2, mesh={"dp": 2}, rank=0, num_workers=num_workers)

    ref = assert_resume_equivalence(factory, num_items=12, cleanup=lambda lo: lo.shutdown())
    assert len(ref) == 12


def test_state_holds_shard_cursor_offset_and_buffer_references():
    stream, _ = _stream([10, 10], known=True, buffer=4)
    lo = StreamLoader(stream, batch_size=3, seed=1)
    take(lo, 2)
    state = json.loads(json.dumps(lo.state_dict()))
    shuffle = state["workers"][0]["source"]
    assert set(shuffle) >= {"draws", "buffer", "source"}
    assert shuffle["draws"] == 6 and len(shuffle["buffer"]) == 4
    assert all(len(ref) == 2 for ref in shuffle["buffer"])
    assert set(shuffle["source"]) >= {"piece", "row"}


def test_resume_with_another_configuration_is_refused():
    stream, _ = _stream([8, 8], known=True)
    state = StreamLoader(stream, batch_size=2, mesh={"dp": 2}, rank=0).state_dict()
    with pytest.raises(ValueError, match="data_rank"):
        StreamLoader(stream, batch_size=2, mesh={"dp": 2}, rank=1).load_state_dict(state)
    with pytest.raises(ValueError, match="num_workers"):
        StreamLoader(stream, batch_size=2, mesh={"dp": 2}, num_workers=2, rank=0).load_state_dict(
            state
        )
    with pytest.raises(ValueError, match="on_error="):
        StreamLoader(stream, batch_size=2, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind='loader', expected kind='stream_loader'"):
        StreamLoader(stream, batch_size=2).load_state_dict({"kind": "loader", "version": 2})


def test_a_version_1_stream_state_of_the_previous_release_is_refused_by_version():
    stream, _ = _stream([8, 8], known=True)
    lo = StreamLoader(stream, batch_size=2)
    take(lo, 1)
    old = {**lo.state_dict(), "kind": "stream", "version": 1}  # what meshfeed 0.1 wrote
    with pytest.raises(
        ValueError, match=r"version=1, this meshfeed reads version 2.*meshfeed 0\.1"
    ):
        StreamLoader(stream, batch_size=2).load_state_dict(old)
    with pytest.raises(ValueError, match="version=1, this meshfeed reads version 2"):
        StreamLoader(stream, batch_size=2).load_state_dict({"version": 1})


def test_resume_with_another_shuffle_buffer_or_stream_seed_is_refused():
    """Both decide the order of the rows, so a resume with others would not be exact."""
    stream, _ = _stream([8, 8], known=True, buffer=4)
    lo = StreamLoader(stream, batch_size=2)
    take(lo, 1)
    state = json.loads(json.dumps(lo.state_dict()))
    smaller, _ = _stream([8, 8], known=True, buffer=2)
    with pytest.raises(ValueError, match="shuffle_buffer=4"):
        StreamLoader(smaller, batch_size=2).load_state_dict(state)
    reseeded, _ = _stream([8, 8], known=True, buffer=4)
    reseeded.seed = 9
    with pytest.raises(ValueError, match="stream_seed=0"):
        StreamLoader(reseeded, batch_size=2).load_state_dict(state)


@pytest.mark.parametrize(
    "change",
    [
        {"exhausted": [False, False]},
        {"epoch": None},
        {"next_worker": -1},
        {"steps": "3"},
        {"stats": {"skipped": -1}},
        {"stats": {"skipped": "2"}},
        {"stats": {"skipped": 0, "extra": 1}},
        {"stats": {"skipped": 0}},
        {"stats": {"skipped": 0, "unread_rows": -1}},
        {"stats": {"skipped": 0, "unread_rows": True}},
        {"epoch": 10**30},
        {"steps": -1},
        {"next_worker": 5},
        {"exhausted": [1]},
        {"workers": [5]},
        {"workers": None},
    ],
)
def test_a_corrupted_stream_state_is_refused_with_value_error(change):
    stream, _ = _stream([8, 8], known=True)
    state = {**StreamLoader(stream, batch_size=2).state_dict(), **change}
    with pytest.raises(ValueError, match="checkpoint is corrupted"):
        StreamLoader(stream, batch_size=2).load_state_dict(state)


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("source", "source", "piece"), 99, "piece"),
        (("source", "source", "row"), 10**6, "row"),
        (("source", "draws"), -1, "draws"),
        (("source", "buffer"), [[0, 1]], "holds 1 items of 4"),
        (("source", "source", "kind"), "node.list", "kind='node.list'"),
    ],
)
def test_a_bad_worker_state_is_refused_at_load_not_at_the_first_batch(path, value, field):
    stream, _ = _stream([10, 10], known=True, buffer=4)
    lo = StreamLoader(stream, batch_size=3, seed=1)
    take(lo, 2)
    state = json.loads(json.dumps(lo.state_dict()))
    target = state["workers"][0]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=f"worker 0: .*{field}"):
        StreamLoader(stream, batch_size=3, seed=1).load_state_dict(state)


def test_a_good_worker_state_still_loads_after_the_up_front_check():
    stream, _ = _stream([10, 10], known=True, buffer=4)
    lo = StreamLoader(stream, batch_size=3, seed=1)
    take(lo, 2)
    state = json.loads(json.dumps(lo.state_dict()))
    rest = [b.tolist() for b in lo]
    again = StreamLoader(stream, batch_size=3, seed=1)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest and rest


def _zero_of_81(rank: int) -> StreamLoader:
    """Whole-shard layout: 2 shards (81 rows and 0) on 2 ranks, so rank 1 holds nothing."""
    stream, _ = _stream([81, 0], known=True)
    return StreamLoader(stream, batch_size=4, mesh={"dp": 2}, rank=rank, shuffle=False)


def test_rows_no_rank_reads_are_counted_in_stats_and_warned_about_once(caplog):
    loaders = [_zero_of_81(r) for r in range(2)]  # every rank, simulated in one process
    with caplog.at_level("WARNING", logger="meshfeed"):
        for lo in loaders:
            assert [b.tolist() for b in lo] == []  # ranks stop together: rank 1 has nothing
            assert lo.stats()["unread_rows"] == 81 and lo.stats()["epoch"] == 1
            assert list(lo) == [] and lo.stats()["unread_rows"] == 162
    warnings = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(warnings) == 2  # once per loader, not once per epoch
    assert "81 rows of epoch 0" in warnings[0] and "rows=" in warnings[0]
    assert "divides ranks x workers (2 x 1)" in warnings[0]


def test_unread_rows_are_carried_through_state_and_not_warned_again(caplog):
    lo = _zero_of_81(0)
    list(lo)
    state = json.loads(json.dumps(lo.state_dict()))
    assert state["stats"] == {"skipped": 0, "unread_rows": 81}
    again = _zero_of_81(0)
    again.load_state_dict(state)
    assert again.stats()["unread_rows"] == 81
    caplog.clear()
    with caplog.at_level("WARNING", logger="meshfeed"):
        list(again)
    assert again.stats()["unread_rows"] == 162
    assert not [r for r in caplog.records if "not read" in r.getMessage()]


def test_rows_split_by_row_ranges_leave_nothing_unread(caplog):
    stream, _ = _stream([40, 40], known=True)
    with caplog.at_level("WARNING", logger="meshfeed"):
        for rank in range(2):
            lo = StreamLoader(stream, batch_size=4, mesh={"dp": 2}, rank=rank)
            assert len(list(lo)) == 10
            assert lo.stats()["unread_rows"] == 0
    assert not [r for r in caplog.records if "not read" in r.getMessage()]


def test_default_reader_reads_callables_and_jsonl_files(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps({"x": i}) for i in range(4)) + "\n")
    stream = ShardedStream([str(path), lambda: iter([{"x": 10}, None, {"x": 11}])])
    lo = StreamLoader(stream, batch_size=2, shuffle=False, drop_last=False)
    it = iter(lo)
    got = [next(it)["x"].tolist() for _ in range(3)]
    assert got == [[0, 1], [2, 3], [10, 11]]
    assert lo.stats()["skipped"] == 1  # the None row of the callable shard
    assert list(it) == [] and lo.stats()["epoch"] == 1


def _rows_with_nones() -> ShardedStream:
    rows = [{"x": 0}, None, {"x": 1}, {"x": 2}, None, {"x": 3}]  # two skipped per epoch
    return ShardedStream([lambda: iter(rows)])


def test_skipped_counts_accumulate_across_epochs_and_survive_a_resume():
    lo = StreamLoader(_rows_with_nones(), batch_size=2, shuffle=False)
    assert [b["x"].tolist() for b in lo] == [[0, 1], [2, 3]]
    assert lo.stats()["epoch"] == 1 and lo.stats()["skipped"] == 2
    it = iter(lo)
    assert next(it)["x"].tolist() == [0, 1]
    assert lo.stats()["skipped"] == 3  # not reset to 1 by the new epoch

    state = json.loads(json.dumps(lo.state_dict()))
    resumed = StreamLoader(_rows_with_nones(), batch_size=2, shuffle=False)
    resumed.load_state_dict(state)
    assert resumed.stats()["skipped"] == 3
    assert [b["x"].tolist() for b in resumed] == [[2, 3]]
    assert [b["x"].tolist() for b in it] == [[2, 3]]
    assert (
        resumed.stats()
        == lo.stats()
        == {
            "epoch": 2,
            "steps": 0,
            "skipped": 4,
            "unread_rows": 0,
            "exhausted_workers": 0,
        }
    )


def test_a_stream_state_without_stats_is_refused_naming_the_field():
    """Version 2 states always carry stats; one without is corrupted, not silently reset."""
    lo = StreamLoader(_rows_with_nones(), batch_size=2, shuffle=False)
    list(lo)
    it = iter(lo)
    next(it)
    state = lo.state_dict()
    del state["stats"]
    resumed = StreamLoader(_rows_with_nones(), batch_size=2, shuffle=False)
    with pytest.raises(ValueError, match="missing 'stats'"):
        resumed.load_state_dict(state)


def test_len_is_known_only_with_row_counts():
    known, _ = _stream([5, 5], known=True)
    assert len(StreamLoader(known, batch_size=2)) == 5  # batches span shard boundaries
    unknown, _ = _stream([5, 5], known=False)
    with pytest.raises(TypeError, match="row counts"):
        len(StreamLoader(unknown, batch_size=2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shards": []}, "non-empty list"),
        ({"shards": [3]}, "neither a path"),
        ({"shards": ["a"], "rows": [1, 2]}, "one non-negative row count"),
        ({"shards": ["a"], "shuffle_buffer": -1}, "shuffle_buffer"),
    ],
)
def test_bad_stream_configuration_is_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ShardedStream(**kwargs)


def test_too_few_shards_for_the_ranks_is_refused_at_construction():
    stream, _ = _stream([5], known=False)
    with pytest.raises(ValueError, match="give rows="):
        StreamLoader(stream, batch_size=1, mesh={"dp": 2}, rank=0)


def _slow_shard() -> Any:
    yield 1
    time.sleep(30)
    yield 2


def _bad_shard() -> Any:
    yield 1
    raise OSError("disk gone in shard b")


def _dying_shard() -> Any:
    yield 1
    os._exit(3)


@pytest.mark.parametrize(
    ("shard", "match"),
    [
        (_slow_shard, "no batch within timeout=1.0s"),
        (_bad_shard, "disk gone in shard b"),
        (_dying_shard, "exited with exit code 3"),
    ],
)
def test_a_stalled_failing_or_dead_worker_is_reported_not_waited_for(shard, match):
    stream = ShardedStream([shard, lambda: iter([5, 6, 7])])
    lo = StreamLoader(stream, batch_size=2, num_workers=2, timeout=1.0, shuffle=False)
    start = time.monotonic()
    with pytest.raises(StreamWorkerError, match=match):
        list(lo)
    assert time.monotonic() - start < 10
    lo.shutdown()


# ---------------------------------------------------------------------- real processes
def _uneven_stream_rank(rank: int, world: int) -> dict[str, Any]:
    log: list[tuple[int, int]] = []
    # Unknown lengths, deliberately uneven: rank r owns shards r, r + world, ...
    stream, _ = _stream([3, 9, 14, 6, 2, 8, 5, 1], known=False, buffer=2, log=log)
    lo = StreamLoader(stream, batch_size=2, mesh={"dp": world}, num_workers=0, timeout=30)
    steps = [len(list(lo))]
    reads = list(log)  # epoch 0 only: shards are re-permuted across ranks every epoch
    steps.append(len(list(lo)))
    result: dict[str, Any] = {"steps": steps, "reads": reads}
    if rank != world - 1:  # the last rank never shows up: the others must not wait forever
        lo2 = StreamLoader(stream, batch_size=2, mesh={"dp": world}, timeout=3)
        try:
            list(lo2)
            result["timeout"] = "no error"
        except RuntimeError as exc:
            result["timeout"] = str(exc)
    return result


@pytest.mark.slow
def test_gloo_ranks_stop_together_read_only_their_shards_and_never_hang():
    results = run_distributed(_uneven_stream_rank, 2, timeout=120)
    steps = [r["steps"] for r in results]
    assert all(s == steps[0] for s in steps) and steps[0][0] >= 1
    reads = Counter(x for r in results for x in set(r["reads"]))
    assert max(reads.values()) == 1  # no row is read by two ranks
    for r in results[:-1]:
        assert "timeout=3" in r["timeout"]


# ---------------------------------------------------------------------- arguments and errors
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"on_error": "skip"}, "on_error='skip'"),
        ({"on_error": "substitute"}, "on_error='substitute'"),
        ({"max_retries": 2}, "max_retries=2"),
        ({"curriculum": object()}, "curriculum="),
        ({"service": object()}, "service="),
    ],
)
def test_arguments_a_stream_cannot_honour_are_refused_by_name(kwargs, name):
    stream, _ = _stream([4, 4], known=True)
    with pytest.raises(ValueError, match=f"StreamLoader does not support {name}"):
        StreamLoader(stream, batch_size=2, **kwargs)
    StreamLoader(stream, batch_size=2, on_error="raise", max_retries=0)  # what it does


def _failing_stream(bad_shard: int | None) -> ShardedStream:
    def shard(i: int) -> Any:
        def rows() -> Any:
            for r in range(6):
                if i == bad_shard and r == 3:
                    raise OSError(f"row {r} of shard {i} is unreadable")
                yield i * 100 + r

        return rows

    return ShardedStream([shard(i) for i in range(4)])


def _read_until_error(lo: StreamLoader) -> dict[str, Any]:
    got = 0
    try:
        for _ in lo:
            got += 1
    except StreamRankError as exc:
        return {"steps": got, "error": "StreamRankError", "message": str(exc)}
    except OSError as exc:
        return {"steps": got, "error": "OSError", "message": str(exc)}
    return {"steps": got, "error": None, "message": ""}


def _raise_rank(rank: int, world: int) -> dict[str, Any]:
    # Shard 1 fails after three rows; whichever rank owns it, every rank must stop there.
    stream = _failing_stream(bad_shard=1)
    lo = StreamLoader(stream, batch_size=1, mesh={"dp": world}, shuffle=False, timeout=30)
    return _read_until_error(lo)


def _check_raised_together(results: list[dict[str, Any]]) -> None:
    assert sorted(r["error"] for r in results) == ["OSError", "StreamRankError"]
    assert len({r["steps"] for r in results}) == 1  # the same step on every rank
    own = next(r for r in results if r["error"] == "OSError")
    assert "shard 1 is unreadable" in own["message"]
    other = next(r for r in results if r["error"] == "StreamRankError")
    assert "another data rank failed" in other["message"]


@pytest.mark.slow
def test_gloo_a_failing_rank_makes_every_rank_raise_at_the_same_step():
    _check_raised_together(run_distributed(_raise_rank, 2, timeout=120))


@pytest.mark.parametrize("bad_shard", [1, None])
def test_simulated_ranks_raise_at_the_same_step(monkeypatch, bad_shard):
    """All ranks in one process: threads joined by an all-reduce(MIN) built on a barrier."""
    import threading

    import meshfeed.sources.stream_loader as stream_loader

    world = 2
    barrier = threading.Barrier(world, timeout=30)
    slots: list[list[int]] = [[0], [0]]
    local = threading.local()

    def all_min(values: list[int], *, timeout: float) -> list[int]:
        slots[local.rank] = list(values)
        barrier.wait()
        out = [min(col) for col in zip(*slots, strict=True)]
        barrier.wait()  # everyone has read before the next round writes
        return out

    monkeypatch.setattr(stream_loader, "all_min", all_min)
    monkeypatch.setattr(stream_loader, "is_distributed", lambda: True)
    results: list[dict[str, Any]] = [{}, {}]

    def run(rank: int) -> None:
        local.rank = rank
        stream = _failing_stream(bad_shard)
        lo = StreamLoader(stream, batch_size=1, mesh={"dp": world}, rank=rank, shuffle=False)
        results[rank] = _read_until_error(lo)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    if bad_shard is None:  # nobody fails: every rank reads its 12 rows, nobody raises
        assert results == [{"steps": 12, "error": None, "message": ""}] * 2
    else:
        _check_raised_together(results)
