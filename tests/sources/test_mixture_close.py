"""Mixture.close closes the streams it mixes: their readers' files, held shards and cursors."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed.sources import ShardedStream
from meshfeed.sources.mixture import Mixture


class Handles:
    """A reader over shards "s0", "s1", ... (rows ``100 * shard + row``) that holds a handle
    per shard it reads until ``close``, as a reader of files or cached shards does."""

    def __init__(self) -> None:
        self.open: set[str] = set()
        self.closes = 0

    def __call__(self, shard, start, stop):
        base = int(shard.removeprefix("s")) * 100
        return iter(range(base + start, base + (10 if stop is None else stop)))

    def take(self, shard, rows):
        self.open.add(shard)
        return [int(shard.removeprefix("s")) * 100 + int(r) for r in rows]

    def close(self):
        self.closes += 1
        self.open.clear()


class Broken(Handles):
    def close(self):
        super().close()
        raise OSError(f"cannot close {id(self)}")


def _stream(reader) -> ShardedStream:
    return ShardedStream(["s0", "s1"], reader, rows=[10, 10])


def _read_all(mix: Mixture) -> list:
    return mix.__getitems__(list(range(len(mix))))


def test_closing_a_mixture_closes_every_stream_it_mixes():
    a, b = Handles(), Handles()
    mix = Mixture(
        {"a": _stream(a), "b": _stream(b), "plain": list(range(5))}, {"a": 1, "b": 1, "plain": 1}
    )
    assert len(_read_all(mix)) == 45
    assert a.open == b.open == {"s0", "s1"}  # held while the mixture reads
    mix.close()
    assert a.open == b.open == set()
    assert a.closes == b.closes == 1


def test_closing_a_mixture_drops_the_row_cursors_of_a_stream_without_take():
    stream = ShardedStream(["s0", "s1"], Handles().__call__, rows=[10, 10])  # read forward
    mix = Mixture({"s": stream, "t": list(range(3))}, {"s": 2, "t": 1})
    assert sorted(mix.__getitems__(list(range(20)))) == [*range(10), *range(100, 110)]
    assert stream._cursors  # an open iterator per shard read
    mix.close()
    assert stream._cursors == {}


def test_closing_a_mixture_twice_is_safe_and_reading_again_reopens():
    a = Handles()
    mix = Mixture({"a": _stream(a), "b": list(range(4))}, {"a": 1, "b": 1})
    _read_all(mix)
    mix.close()
    mix.close()  # nothing left open: a no-op for the stream
    assert a.open == set()
    assert _read_all(mix)[:3] == [0, 1, 2]  # the stream re-opens what it reads
    assert a.open == {"s0", "s1"}
    mix.close()
    assert a.open == set()


def test_a_stream_that_raises_on_close_does_not_keep_the_others_open():
    first, ok, second = Broken(), Handles(), Broken()
    mix = Mixture(
        {"x": _stream(first), "y": _stream(ok), "z": _stream(second)}, {"x": 1, "y": 1, "z": 1}
    )
    _read_all(mix)
    with pytest.raises(OSError, match=f"cannot close {id(first)}") as info:
        mix.close()
    assert ok.open == set() and ok.closes == 1  # closed although "x" raised before it
    assert second.closes == 1  # ... and so was the one after it, which raised too
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "closing source 'x'" in notes
    assert "source 'z' also raised" in notes and f"cannot close {id(second)}" in notes


def test_closing_a_mixture_closes_the_streams_of_a_nested_mixture():
    inner_reader, outer_reader = Handles(), Handles()
    inner = Mixture({"i": _stream(inner_reader), "j": list(range(3))}, {"i": 1, "j": 1})
    mix = Mixture({"inner": inner, "o": _stream(outer_reader)}, {"inner": 1, "o": 1})
    _read_all(mix)
    assert inner_reader.open and outer_reader.open
    mix.close()
    assert inner_reader.open == outer_reader.open == set()


def test_a_mixture_of_sources_without_close_closes_quietly():
    mix = Mixture({"a": list(range(3)), "b": np.arange(4)}, {"a": 1, "b": 1})
    mix.close()
    assert mix[0] == 0
