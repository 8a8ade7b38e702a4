"""A forked loader worker must not read through file handles its parent opened: the two
processes would share one file offset, so a seek in one moves the other's reads."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import numpy as np
import pytest

from meshfeed.errors import SourceError
from meshfeed.sources.streams.readers import DefaultReader, ReaderHooks
from meshfeed.sources.streams.remote import CachedReader
from meshfeed.storage import ShardCache


def _take_in_child(reader: DefaultReader, path: str) -> None:
    assert [r["i"] for r in reader.take(path, np.array([350, 7]))] == [350, 7]


def test_default_reader_in_a_forked_worker_opens_its_own_files(tmp_path):
    path = str(tmp_path / "rows.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"i": i, "pad": "x" * (i % 50)}) + "\n" for i in range(400))
    reader = DefaultReader()
    reader.take(path, np.array([0]))  # the parent opens the file
    (f,) = reader._files.values()
    before = os.lseek(f.fileno(), 0, os.SEEK_CUR)
    child = mp.get_context("fork").Process(target=_take_in_child, args=(reader, path))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert os.lseek(f.fileno(), 0, os.SEEK_CUR) == before


# ------------------------------------------------------------------ the declared reader hooks
_HOOKS = ("take", "count", "version", "modified", "plan", "ask", "forget", "close")
_FIELDS = (*_HOOKS, "reads_urls", "newest")


def _base(shard):
    return int(shard.removeprefix("s")) * 100  # shards "s0", "s1": names, not files


def _rows_only(shard, start, stop):
    """A reader with the required call and nothing else."""
    return iter(range(_base(shard) + start, _base(shard) + (10 if stop is None else stop)))


class RowsOnly:
    """The same as a class: ``__call__`` and no hook."""

    def __call__(self, shard, start, stop):
        return _rows_only(shard, start, stop)


class EveryHook:
    """Every hook a stream may call; logs each call, and every lookup of a hook's name."""

    reads_urls = False
    newest = 1234

    def __init__(self):
        self.calls: list[str] = []
        self.looked: list[str] = []

    def __getattribute__(self, name):
        if name in _FIELDS:
            object.__getattribute__(self, "looked").append(name)
        return object.__getattribute__(self, name)

    def __call__(self, shard, start, stop):
        self.calls.append("call")
        return _rows_only(shard, start, stop)

    def take(self, shard, rows):
        self.calls.append("take")
        return [_base(shard) + int(r) for r in rows]

    def count(self, shard):
        self.calls.append("count")
        return 10

    def version(self, shard):
        self.calls.append("version")
        return f"v{shard}"

    def modified(self, shard):
        self.calls.append("modified")
        return 99

    def plan(self, shards):
        self.calls.append("plan")

    def ask(self, shards):
        self.calls.append("ask")

    def forget(self, shard):
        self.calls.append("forget")

    def close(self):
        self.calls.append("close")


def _walk(stream):
    """Everything a loader does with a stream: count, identify, order, read, explain, close."""
    order = stream.make_order(dataset_length=len(stream), global_batch_size=4, seed=3)
    rows = stream.__getitems__(order.indices(0, np.arange(len(stream))).tolist())
    fingerprint = stream.fingerprint
    why = stream.explain_fingerprint("stream:2:x:0")
    stream.close()
    return rows, fingerprint, why


@pytest.mark.parametrize("reader", [_rows_only, RowsOnly()], ids=["function", "class"])
def test_a_reader_with_only_the_required_call_has_no_hooks_and_still_streams(reader):
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    assert ReaderHooks.of(reader) == ReaderHooks()
    stream = ShardedStream(["s0", "s1"], reader)
    assert stream.rows == [10, 10]  # counted by one pass over each shard
    rows, fingerprint, _ = _walk(stream)
    assert sorted(rows) == [*range(10), *range(100, 110)]
    assert fingerprint.startswith("stream:2:")
    loader = StreamLoader(ShardedStream(["s0", "s1"], reader), batch_size=4, seed=1, shuffle=False)
    assert [int(x) for b in loader for x in b] == [*range(10), *range(100, 110)]


def test_every_hook_is_resolved_once_when_the_stream_is_built_and_never_looked_up_again():
    from meshfeed.sources import ShardedStream

    reader = EveryHook()
    stream = ShardedStream(["s0", "s1"], reader, shuffle_buffer=4)
    looked = list(reader.looked)
    assert set(looked) == set(_FIELDS)  # each looked up while the stream was built
    rows, fingerprint, why = _walk(stream)
    assert reader.looked == looked  # ... and never again, however the stream is used
    assert sorted(rows) == [*range(10), *range(100, 110)]
    assert {"count", "ask", "version", "plan", "take", "close"} <= set(reader.calls)
    assert "call" not in reader.calls  # take serves every read, count every size
    assert fingerprint.endswith(":1234")  # newest, not the shards' modified ...
    assert "shard(s) s0, s1 changed" in why  # ... which explains: 99 ns is after 0
    assert reader.calls.count("modified") == 2  # once per shard, by the explanation alone


def test_hooks_resolve_to_the_readers_own_bound_methods():
    reader = EveryHook()
    hooks = ReaderHooks.of(reader)
    for name in _HOOKS:
        assert getattr(hooks, name) == getattr(reader, name), name
    assert hooks.reads_urls is False and hooks.newest == 1234
    plain = DefaultReader()
    assert ReaderHooks.of(plain) == ReaderHooks(
        take=plain.take, count=plain.count, close=plain.close
    )


# ------------------------------------------------------------------ rows past a shard's end
def _ten(shard, start, stop):
    """A reader without ``take`` over shards of 10 rows."""
    return iter(range(start, min(10, 10 if stop is None else stop)))


def test_a_cached_read_without_take_refuses_rows_past_the_shards_end(tmp_path):
    reader = CachedReader(_ten, ShardCache(tmp_path / "cache"), shards=["s0"])
    assert reader.take("s0", np.array([9, 2])) == [9, 2]
    with pytest.raises(SourceError, match="shard s0 holds 10 rows, but row 13 was asked for"):
        reader.take("s0", np.array([2, 13]))
