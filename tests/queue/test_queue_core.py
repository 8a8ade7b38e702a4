"""StoreCore: the non-blocking bookkeeping both backends share."""

from __future__ import annotations

from typing import Any

import pytest

from meshfeed.queue.engine.columns import Gathered
from meshfeed.queue.engine.core import PartitionClosed, Ref, StoreCore, StoreOptions, nbytes_of
from meshfeed.queue.request import GetRequest, PutRequest
from meshfeed.queue.samplers import RankAwareSampler, Sampler, SequentialSampler


def _put(core: StoreCore, partition: str, rows: dict, ids: Any, groups: Any) -> Any:
    return core.try_put(PutRequest(partition=partition, rows=rows, ids=ids, groups=groups))


SEQ = SequentialSampler()


def _plain(rows: dict[str, Any]) -> dict[str, Any]:
    """Batch columns as lists (a column gathered from a run of one put comes wrapped)."""
    return {f: list(v.data) if isinstance(v, Gathered) else v for f, v in rows.items()}


def _req(batch_size: int, sampler: Sampler = SEQ, **kwargs: Any) -> GetRequest:
    return GetRequest(
        task="t", fields=("x",), batch_size=batch_size, partition="p", sampler=sampler, **kwargs
    )


def test_try_methods_return_none_instead_of_blocking():
    core = StoreCore(StoreOptions(capacity=3))
    assert _put(core, "p", {"x": [1, 2]}, None, None) == [0, 1]
    assert _put(core, "p", {"x": [3, 4]}, None, None) is None  # full: the caller waits
    assert core.try_get(_req(3)) is None  # not enough ready yet
    assert _put(core, "p", {"y": [5]}, [0], None) == [0]  # new fields need no space


def test_pinned_samples_outlive_eviction_until_every_reader_has_read():
    core = StoreCore(StoreOptions(tasks=("t",)))
    _put(core, "p", {"x": [1, 2]}, None, None)
    lead = RankAwareSampler(data_rank=0, replica_rank=0, replica_size=2)
    lag = RankAwareSampler(data_rank=0, replica_rank=1, replica_size=2)
    ids, rows, _, _ = core.try_get(_req(2, lead, batch_index=0))
    assert core.held == 2  # consumed by every task but pinned by the shared entry
    again = core.try_get(_req(2, lag, batch_index=0))
    assert again is not None and again[0] == ids == [0, 1] and again[2:] == (None, None)
    assert _plain(again[1]) == _plain(rows) == {"x": [1, 2]}
    # Kept until both readers moved on: a retry of batch 0 must get the same batch.
    assert core.held == 2 and core.stats()["cache_entries"] == 1
    assert core.try_get(_req(2, lead, batch_index=1)) is None
    assert core.held == 2  # the lagging reader may still retry batch 0
    assert core.try_get(_req(2, lag, batch_index=1)) is None
    assert core.held == 0 and core.stats()["cache_entries"] == 0


def test_closed_and_drained_raises_partition_closed():
    core = StoreCore(StoreOptions())
    _put(core, "p", {"x": [1]}, None, None)
    core.close("p")
    assert core.try_get(_req(5))[0] == [0]
    with pytest.raises(PartitionClosed):
        core.try_get(_req(5))


def test_refs_count_as_object_store_bytes_not_held_bytes():
    core = StoreCore(StoreOptions())
    _put(core, "p", {"x": [Ref("ref", 1000), Ref("ref", 24)]}, None, None)
    stats = core.stats()
    assert stats["bytes_held"] == 0 and stats["bytes_in_object_store"] == 1024
    assert nbytes_of(b"abc") == 3


def test_options_reject_a_non_positive_capacity():
    with pytest.raises(ValueError, match="capacity must be a positive number"):
        StoreOptions(capacity=0)
