"""A shard dataset of many shards on a real S3 API (moto): a cold start asks for the index
alone, not a request per shard, and ``meshfeed index`` rewrites a bucket's index (#32)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from meshfeed import StreamLoader
from meshfeed.errors import SourceError
from meshfeed.sources import ShardedStream, write_shards
from meshfeed.sources.shards.index import reindex
from tests.sources.test_sources_shards_index import as_version_1
from tests.storage.conftest import S3

SHARDS, ROWS = 150, 450


def _upload(s3: S3, tmp: Path, *, shards: int = SHARDS, version: int = 2) -> Path:
    samples = ({"x": np.int64(i)} for i in range(ROWS))
    index = Path(write_shards(samples, tmp / "ds", rows_per_shard=ROWS // shards))
    if version == 1:
        as_version_1(index)
    for f in sorted(index.parent.iterdir()):
        if f.name != "index.json":
            s3.client.upload_file(str(f), s3.bucket, f"ds/{f.name}")
    s3.client.upload_file(str(index), s3.bucket, "ds/index.json")
    return index


def test_a_cold_start_of_many_shards_asks_for_the_index_not_for_every_shard(
    s3: S3, tmp_path: Path
) -> None:
    _upload(s3, tmp_path)
    s3.proxy.reset()
    stream = ShardedStream.from_index(
        s3.url("ds"), cache_dir=tmp_path / "cache", storage_options=s3.options
    )
    assert s3.proxy.counts["HEAD"] == 1  # the index's identity: no request per shard
    assert sum(s3.proxy.counts.values()) == 2  # ... and the index itself
    with StreamLoader(stream, batch_size=4, mesh={"dp": 4}, rank=1, seed=0) as loader:
        assert len(next(iter(loader))["x"]) == 4
        loader.state_dict()  # the fingerprint: no request per shard either
    assert s3.proxy.counts["HEAD"] == 1
    listings = s3.proxy.counts["GET"] - sum(s3.proxy.object_gets.values())
    assert listings == 0
    fetched = [p for p in s3.proxy.object_gets if p.endswith(".mfs")]
    assert 0 < len(fetched) < SHARDS // 2  # the shards read and downloaded ahead, not all
    assert max(s3.proxy.object_gets.values()) == 1
    # its download-aheads stop with the test (left running, they retried against the stopped
    # endpoint through later tests, and the process waited for them at exit)
    stream.reader.cache.close()


def test_meshfeed_index_rewrites_a_bucket_s_version_1_index(s3: S3, tmp_path: Path) -> None:
    index = _upload(s3, tmp_path, shards=10, version=1)
    assert json.loads(index.read_text())["version"] == 1
    got = reindex(s3.url("ds"), verify=True, storage_options=s3.options)  # hashes all
    assert len(got) == 10 and got.num_rows == ROWS
    body = s3.client.get_object(Bucket=s3.bucket, Key="ds/index.json")["Body"].read()
    assert json.loads(body)["version"] == 2
    stream = ShardedStream.from_index(
        s3.url("ds"), cache_dir=tmp_path / "cache", storage_options=s3.options
    )
    assert stream.__getitems__([0, 5, ROWS - 1]) == [{"x": 0}, {"x": 5}, {"x": ROWS - 1}]


def test_meshfeed_index_refuses_a_changed_object_by_name(s3: S3, tmp_path: Path) -> None:
    _upload(s3, tmp_path, shards=10, version=1)
    key = "ds/shard-00007.mfs"
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    time.sleep(1.1)  # the bucket's modified times count whole seconds
    s3.put(key, bytes(body))  # same size, written after the index: hashed without --verify
    with pytest.raises(SourceError, match=r"shard s3://.*/ds/shard-00007\.mfs has content hash"):
        reindex(s3.url("ds"), storage_options=s3.options)
    s3.put(key, bytes(body[:-1]))
    with pytest.raises(SourceError, match=r"shard-00007\.mfs has \d+ bytes but"):
        reindex(s3.url("ds"), storage_options=s3.options)
    index = s3.client.get_object(Bucket=s3.bucket, Key="ds/index.json")["Body"].read()
    assert json.loads(index)["version"] == 1  # nothing written
