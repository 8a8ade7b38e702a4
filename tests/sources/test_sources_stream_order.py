"""The stream as a source: its order (a pure bijection per pass), its readers, its identity."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from meshfeed.errors import SourceError
from meshfeed.sources.streams.order import StreamOrder, _groups
from meshfeed.sources.streams.readers import DefaultReader, callable_identity
from meshfeed.sources.streams.stream import ShardedStream
from tests.optional import given, settings, st


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda r: sum(r) > 0),
    window=st.sampled_from([0, 1, 3, 16, 1000]),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 5),
)
def test_each_pass_is_a_bijection_of_the_rows_and_windows_stay_in_place(
    rows, window, shuffle, seed, epoch
):
    order = StreamOrder(rows, seed=seed, shuffle=shuffle, window=window, samples_per_epoch=None)
    total = sum(rows)
    idx = order.indices(epoch, np.arange(total))
    assert sorted(idx.tolist()) == list(range(total))
    np.testing.assert_array_equal(order.indices(epoch, np.arange(total)[::-1]), idx[::-1])
    if not shuffle:
        assert idx.tolist() == list(range(total))
    # the rows of a window are the rows of the unshuffled walk (shards in pass order) there
    plain = StreamOrder(rows, seed=seed, shuffle=shuffle, window=0, samples_per_epoch=None)
    walk = plain.indices(epoch, np.arange(total))
    w = max(window, 1) if shuffle else total
    for lo in range(0, total, w):
        assert sorted(idx[lo : lo + w].tolist()) == sorted(walk[lo : lo + w].tolist())


@settings(max_examples=80, deadline=None)
@given(keys=st.lists(st.integers(0, 6), max_size=40))
def test_groups_match_np_unique_and_its_masks(keys):
    arr = np.asarray(keys, dtype=np.int64)
    got = _groups(arr)
    assert [k for k, _ in got] == np.unique(arr).tolist()
    for k, mask in got:
        np.testing.assert_array_equal(mask, arr == k)


def test_planning_a_batch_does_not_import_numpy_ma():
    # np.unique's first call imports numpy.ma (35-50 ms): a resumed loader's first batch
    # would wait for it (#29)
    code = (
        "import sys, numpy as np\n"
        "from meshfeed.sources.streams.stream import StreamOrder\n"
        "o = StreamOrder([50, 70, 30], seed=1, shuffle=True, window=16, samples_per_epoch=100)\n"
        "o.indices(3, np.arange(64))\n"
        "print('numpy.ma' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_shards_are_permuted_per_pass_and_rows_stay_in_order_without_a_window():
    rows = [5] * 8
    order = StreamOrder(rows, seed=1, shuffle=True, window=0, samples_per_epoch=None)
    e0 = order.indices(0, np.arange(40)).reshape(8, 5)
    e1 = order.indices(1, np.arange(40)).reshape(8, 5)
    assert (np.diff(e0, axis=1) == 1).all()  # each shard read front to back
    assert e0[:, 0].tolist() != e1[:, 0].tolist()  # another shard order next epoch


def test_samples_per_epoch_cuts_epochs_from_consecutive_passes():
    order = StreamOrder([4, 6], seed=2, shuffle=True, window=4, samples_per_epoch=3)
    full = StreamOrder([4, 6], seed=2, shuffle=True, window=4, samples_per_epoch=None)
    walk = np.concatenate([full.indices(p, np.arange(10)) for p in range(3)])
    got = np.concatenate([order.indices(e, np.arange(3)) for e in range(10)])
    np.testing.assert_array_equal(got, walk[:30])
    assert order.epoch_length(7) == 3


def test_epochs_far_out_cost_the_same_and_do_not_overflow():
    order = StreamOrder([10**9] * 4, seed=5, shuffle=True, window=4096, samples_per_epoch=10**11)
    idx = order.indices(2**32 - 1, np.arange(0, 10**11, 10**9))
    assert ((idx >= 0) & (idx < 4 * 10**9)).all()


def test_describe_records_what_decides_the_order():
    order = StreamOrder([3], seed=0, stream_seed=9, shuffle=True, window=8, samples_per_epoch=None)
    assert order.describe(0, 0) == {
        "kind": "stream",
        "version": 1,
        "window": 8,
        "stream_seed": 9,
        "samples_per_epoch": 3,
    }
    with pytest.raises(ValueError, match="shuffle_buffer"):
        order.validate({**order.describe(0, 0), "window": 2})


# ---------------------------------------------------------------------- reading
class RunReader:
    """A reader without ``take``: records the runs it is asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int | None]] = []

    def __call__(self, shard: str, start: int, stop: int | None) -> Any:
        self.calls.append((shard, start, stop))
        base = {"a": 0, "b": 100}[shard]
        return [base + r for r in range(start, stop if stop is not None else 10)]


def test_rows_are_read_per_shard_as_one_span_and_the_span_is_kept():
    reader = RunReader()
    stream = ShardedStream(["a", "b"], reader, rows=[10, 10])
    assert stream.__getitems__([3, 4, 5, 12, 13, 8, 3]) == [3, 4, 5, 102, 103, 8, 3]
    assert sorted(reader.calls) == [("a", 3, None), ("b", 2, None)]
    assert stream.__getitems__([7]) == [7]  # inside the kept span: no read
    assert stream.__getitems__([9, 6]) == [9, 6]  # the kept span and the iterator's next row
    assert len(reader.calls) == 2
    assert stream.__getitems__([1]) == [1]  # before both: the shard is opened there
    assert reader.calls[-1] == ("a", 1, None)
    assert stream.__getitems__([1]) == [1]  # handed out already: read again, never re-served
    assert reader.calls[-2:] == [("a", 1, None)] * 2


def test_a_shard_shorter_than_counted_is_named():
    stream = ShardedStream(["a"], lambda s, a, b: range(a, min(b or 4, 4)), rows=[10])
    with pytest.raises(SourceError, match="shard a holds 4 rows, but row 5 was asked for"):
        stream.__getitems__([2, 3, 4, 5])


def test_out_of_range_rows_are_refused():
    stream = ShardedStream([lambda: range(3)])
    with pytest.raises(IndexError, match="out of range"):
        stream[3]


def test_callable_shards_are_read_forward_without_starting_over():
    opened = []

    def shard() -> Any:
        opened.append(1)
        return iter(range(100))

    reader = DefaultReader()
    assert reader.take(shard, np.array([5, 2, 9])) == [5, 2, 9]
    assert reader.take(shard, np.array([10, 40])) == [10, 40]
    assert len(opened) == 1
    assert reader.take(shard, np.array([1])) == [1]  # backwards: opened again
    assert len(opened) == 2
    assert reader.count(shard) == 100


def test_default_reader_drops_its_caches_when_pickled(tmp_path):
    import pickle

    p = tmp_path / "x.txt"
    p.write_text("a\nb\nc\n")
    reader = DefaultReader()
    assert reader.take(str(p), np.array([2, 0])) == ["c", "a"]
    again = pickle.loads(pickle.dumps(reader))
    assert again._offsets == {} and again.take(str(p), np.array([1])) == ["b"]


def _rows(n: int, offset: int = 0) -> range:
    return range(offset, offset + n)


def test_callables_are_identified_by_name_code_and_arguments_not_by_address():
    a = functools.partial(_rows, 3, offset=1)
    b = functools.partial(_rows, 3, offset=1)
    c = functools.partial(_rows, 3, offset=2)
    assert callable_identity(a) == callable_identity(b) != callable_identity(c)
    assert "0x" not in callable_identity(a)
    f = [lambda i=i: range(i) for i in range(2)]
    assert callable_identity(f[0]) == callable_identity(f[1])  # defaults are not closures

    def make(k: int) -> Any:
        return lambda: range(k)

    assert callable_identity(make(1)) != callable_identity(make(2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shards": []}, "non-empty list"),
        ({"shards": "a.jsonl"}, "non-empty list"),
        ({"shards": [3]}, "neither a path"),
        ({"shards": ["a"], "rows": [1, 2]}, "one int row count in \\[0, 2\\*\\*40\\) per shard"),
        ({"shards": ["a"], "rows": [-1]}, "one int row count in \\[0, 2\\*\\*40\\) per shard"),
        ({"shards": ["a"], "rows": [10**30]}, "split larger shards"),
        ({"shards": ["a"], "shuffle_buffer": -1}, "shuffle_buffer must be an int >= 0"),
        ({"shards": ["a"], "shuffle_buffer": True}, "shuffle_buffer must be an int >= 0"),
        ({"shards": ["a"], "samples_per_epoch": 0}, "samples_per_epoch must be an int >= 1"),
        ({"shards": ["a"], "reader": 5}, "not callable"),
    ],
)
def test_bad_stream_configuration_is_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ShardedStream(**kwargs)


def test_an_empty_stream_is_refused_when_a_loader_plans_it():
    from meshfeed.stream_loader import StreamLoader

    with pytest.raises(ValueError, match="empty"):
        StreamLoader(ShardedStream([lambda: []]), batch_size=1)


def test_jsonl_rows_holding_unicode_line_separators_stay_one_row_each(tmp_path):
    p = tmp_path / "u.jsonl"
    rows = [{"t": f"a\u2028b\u0085c{i}"} for i in range(5)]  # legal unescaped in JSON strings
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    reader = DefaultReader()
    assert reader.count(str(p)) == 5
    assert reader.take(str(p), np.array([4, 0, 2])) == [rows[4], rows[0], rows[2]]


def test_a_kept_span_never_serves_a_row_past_its_end(tmp_path, monkeypatch):
    import meshfeed.sources.streams.readers as readers

    monkeypatch.setattr(readers, "_SPAN_BYTES", 40)  # a few lines per span
    p = tmp_path / "n.jsonl"
    p.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(30)))
    reader = DefaultReader()
    for rows in ([0, 1], [2, 3], [3, 4, 5], [7], [6, 8], [29], [0, 29], [12, 11, 13]):
        assert reader.take(str(p), np.array(rows)) == [{"i": r} for r in rows]


def test_readers_keep_the_names_a_0_3_checkpoint_fingerprinted() -> None:
    # Stream fingerprints hash the reader's name; the modules moved into subpackages in 0.4,
    # and a checkpoint written by 0.3 must still resume (#33).
    from meshfeed.sources import MDSReader, ShardFormatReader, TarReader
    from meshfeed.sources.streams.remote import CachedReader

    assert callable_identity(DefaultReader) == "meshfeed.sources.stream_readers.DefaultReader"
    assert callable_identity(ShardFormatReader) == "meshfeed.sources.shards_read.ShardFormatReader"
    assert callable_identity(TarReader) == "meshfeed.sources.webdataset.TarReader"
    assert callable_identity(MDSReader) == "meshfeed.sources.mds.MDSReader"
    assert callable_identity(CachedReader) == "meshfeed.sources.stream_remote.CachedReader"


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda r: sum(r) > 0),
    window=st.sampled_from([0, 1, 3, 16, 1000]),
    seed=st.integers(0, 2**32),
    per_epoch=st.integers(1, 120),
    cuts=st.lists(st.integers(1, 200), min_size=1, max_size=12),
)
def test_returned_tells_each_shard_done_once_per_pass_after_its_rows(
    rows, window, seed, per_epoch, cuts
):
    """``on_done`` names a shard once all its rows of a pass are returned, and no later than
    the return that covers the window holding its last row: the shard cache evicts it first
    then, however many worker processes read its rows (#29)."""
    told: list[list[int]] = []
    order = StreamOrder(
        rows, seed=seed, shuffle=True, window=window, samples_per_epoch=per_epoch,
        on_done=told.append,
    )  # fmt: skip
    total, canon = sum(rows), np.cumsum([0, *rows])
    last: dict[tuple[int, int], int] = {}  # (pass, shard) -> global position of its last row
    done: dict[tuple[int, int], int] = {}  # (pass, shard) -> global position told at
    times = dict.fromkeys(range(len(rows)), 0)
    for epoch in range(2):
        idx = order.indices(epoch, np.arange(per_epoch))
        shard = np.searchsorted(canon, idx, side="right") - 1
        for pos, s in enumerate(shard.tolist()):
            g = epoch * per_epoch + pos
            last[g // total, s] = g
        ends = sorted({min(c, per_epoch) for c in np.cumsum(cuts).tolist()} | {per_epoch})
        for end in ends:
            told.clear()
            order.returned(epoch, end)
            for s in (s for batch in told for s in batch):
                done[times[s], s] = epoch * per_epoch + end  # its k-th telling: pass k
                times[s] += 1
    for p, s in last:
        if (p + 1) * total <= 2 * per_epoch:  # the pass was returned whole: told exactly once
            assert (p, s) in done
    for (p, s), told_at in done.items():
        if rows[s]:
            assert last[p, s] < told_at  # every row of the pass returned first
