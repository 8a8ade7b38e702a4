"""ShardedStream.from_index: meshfeed shards as a stream, with every guarantee of the engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshfeed import StreamLoader
from meshfeed.errors import SourceError
from meshfeed.sources import Mixture, ShardedStream, write_shards
from meshfeed.testing import assert_resume_equivalence, take
from tests.optional import ZSTD


def _samples(n: int, offset: int = 0) -> list[dict]:
    rng = np.random.default_rng(offset)
    return [
        {"id": offset + i, "tokens": rng.integers(0, 1000, size=int(rng.integers(3, 40)))}
        for i in range(n)
    ]


def _ids(rows: list[dict]) -> list[int]:
    return [int(r["id"]) for r in rows]


@pytest.fixture(params=[pytest.param(None, id="raw"), ZSTD])
def dataset(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return write_shards(
        _samples(203), tmp_path / "ds", rows_per_shard=37, compression=request.param
    )


def test_a_shard_dataset_is_a_stream_with_its_rows_from_the_index(dataset: Path) -> None:
    stream = ShardedStream.from_index(dataset, shuffle_buffer=16)
    assert len(stream) == 203 and stream.rows == [37] * 5 + [18]
    served = []
    for rank in range(2):
        lo = StreamLoader(stream, batch_size=5, mesh={"dp": 2}, rank=rank, collate_fn=_ids)
        served += [i for b in lo for i in b]
    assert len(served) == len(set(served)) == 200  # every row once; 3 dropped (drop_last)
    assert stream[7]["id"] == 7 and np.array_equal(stream[7]["tokens"], _samples(203)[7]["tokens"])


def test_from_index_resumes_exactly_and_on_another_data_parallel_size(dataset: Path) -> None:
    stream = ShardedStream.from_index(dataset.parent, shuffle_buffer=16, seed=3)

    def make() -> StreamLoader:
        return StreamLoader(stream, batch_size=6, collate_fn=_ids, num_workers=2)

    assert_resume_equivalence(make, num_items=40, every=7, cleanup=lambda lo: lo.shutdown())
    first = StreamLoader(stream, batch_size=3, mesh={"dp": 2}, rank=0, collate_fn=_ids)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    rest = []
    for rank in range(3):
        lo = StreamLoader(stream, batch_size=2, mesh={"dp": 3}, rank=rank, collate_fn=_ids)
        lo.load_state_dict(state)
        rest.append([i for b in lo for i in b])
    whole = [i for b in StreamLoader(stream, batch_size=6, collate_fn=_ids) for i in b]
    assert sorted(whole[30:]) == sorted(i for r in rest for i in r)
    assert len(head) == 5


def test_a_mixture_of_shard_streams_holds_its_weights(tmp_path: Path) -> None:
    a = ShardedStream.from_index(write_shards(_samples(300), tmp_path / "a", rows_per_shard=50))
    b = ShardedStream.from_index(
        write_shards(_samples(100, offset=10_000), tmp_path / "b", rows_per_shard=50)
    )
    mix = Mixture({"a": a, "b": b}, {"a": 3, "b": 1})
    lo = StreamLoader(mix, batch_size=8, collate_fn=_ids)
    ids = [i for batch in take(lo, 25) for i in batch]
    assert sum(i >= 10_000 for i in ids) == 50 and len(set(ids)) == 200


def test_a_truncated_shard_is_a_source_error_naming_it(tmp_path: Path) -> None:
    index = write_shards(_samples(50), tmp_path / "ds", rows_per_shard=25)
    stream = ShardedStream.from_index(index)
    shard = Path(stream.shards[1])
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(SourceError, match=shard.name):
        list(StreamLoader(stream, batch_size=5, collate_fn=_ids))


def test_a_rank_touches_only_the_shards_it_reads_and_a_changed_one_is_refused_by_name(
    tmp_path: Path,
) -> None:
    """#32: start-up stat'ed every shard (twice) and scanned the index per shard; now the
    index alone is read at start, and each shard is checked when it is opened."""
    write_shards(({"x": np.int64(i)} for i in range(200)), tmp_path / "d", rows_per_shard=4)
    for k in range(2, 50):  # 48 of the 50 shards are gone: the first batches never read them
        (tmp_path / "d" / f"shard-{k:05d}.mfs").unlink()
    loader = StreamLoader(ShardedStream.from_index(tmp_path / "d"), batch_size=4, shuffle=False)
    batches = iter(loader)
    assert [int(v) for v in next(batches)["x"]] == [0, 1, 2, 3]
    assert [int(v) for v in next(batches)["x"]] == [4, 5, 6, 7]
    with pytest.raises(SourceError, match="shard-00002.mfs is missing"):
        next(batches)
