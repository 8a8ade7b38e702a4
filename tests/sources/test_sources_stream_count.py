"""Row counting at start: every shard within the loader's timeout, named when it stalls (#28)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from meshfeed import DataLoader, StreamLoader
from meshfeed.sources.mixture import Mixture
from meshfeed.sources.streams.count import DEFAULT_TIMEOUT, count_rows, wait_limit
from meshfeed.sources.streams.stream import ShardedStream

_STALL_S = 20.0  # long enough that today's unbounded count fails the time check, not forever


def _stalls_on_s1(shard: str, start: int, stop: int | None) -> Any:
    if shard == "s1":
        time.sleep(_STALL_S)
    return iter(range(10)[start:stop])


def test_a_reader_that_stalls_while_rows_are_counted_fails_within_the_loader_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"shard 's1' took more than 1 s.*pass rows="):
        StreamLoader(ShardedStream(["s0", "s1"], _stalls_on_s1), batch_size=2, timeout=1.0)
    assert time.monotonic() - t0 < 5.0


def test_a_mixture_of_streams_counts_within_the_bound_it_is_built_under():
    t0 = time.monotonic()
    with wait_limit(0.5), pytest.raises(TimeoutError, match="'s1'"):
        Mixture({"a": ShardedStream(["s0", "s1"], _stalls_on_s1)}, {"a": 1})
    assert time.monotonic() - t0 < 5.0


def test_counts_are_the_same_and_errors_are_raised_as_themselves():
    stream = ShardedStream([lambda: range(3), lambda: range(5)])
    assert stream.rows == [3, 5]
    assert len(DataLoader(ShardedStream(["s0", "s2"], _stalls_on_s1), batch_size=4)) == 5

    def broken(shard: str) -> int:
        raise OSError(f"cannot open {shard}")

    with pytest.raises(OSError, match="cannot open b"):
        count_rows(broken, ["b"])


def test_the_bound_is_the_default_outside_a_loader_and_restored_after_one():
    with wait_limit(2.0):
        pass
    with wait_limit(float("inf")):
        assert count_rows(len, ["ab", "c"]) == [2, 1]
    from meshfeed.sources.streams.count import _LIMIT

    assert _LIMIT.get() == DEFAULT_TIMEOUT
