"""Sharded streams whose shards are URLs, read from a real S3 API (moto) through the cache."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from meshfeed import StreamLoader
from meshfeed.errors import SourceError
from meshfeed.sources import ShardedStream
from meshfeed.testing import take
from tests.dist_utils import run_distributed
from tests.optional import NEEDS_ZSTD
from tests.storage.conftest import S3

ROWS = [30, 7, 52, 11, 20]


def _upload(s3: S3, rows: list[int] = ROWS, key: str = "stream") -> list[str]:
    urls = []
    for s, n in enumerate(rows):
        body = "".join(json.dumps({"id": s * 1000 + r}) + "\n" for r in range(n))
        urls.append(s3.put(f"{key}/part-{s:05d}.jsonl", body.encode()))
    return urls


def _ids(rows: list[dict[str, int]]) -> list[int]:
    return [r["id"] for r in rows]


def _loader(urls: list[str], remote: dict[str, Any], **kw: Any) -> StreamLoader:
    stream = ShardedStream(urls, shuffle_buffer=8, **remote)
    return StreamLoader(stream, seed=2, collate_fn=_ids, **kw)


def test_a_stream_of_urls_serves_every_row_once_and_downloads_each_shard_once(
    s3: S3, tmp_path: Path
) -> None:
    urls = _upload(s3)
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    s3.proxy.reset()
    served = []
    for rank in range(2):
        with _loader(urls, remote, batch_size=4, mesh={"dp": 2}, rank=rank) as lo:
            served += [i for b in lo for i in b]
    assert len(served) == len(set(served)) == sum(ROWS) // 8 * 8
    assert len(s3.proxy.object_gets) == len(urls)  # every shard fetched ...
    assert all(n == 1 for n in s3.proxy.object_gets.values())  # ... once for the node
    local = [tmp_path / f"part-{s}.jsonl" for s in range(len(ROWS))]
    for p, u in zip(local, urls, strict=True):
        p.write_bytes(s3.client.get_object(Bucket=s3.bucket, Key=u.split("/", 3)[3])["Body"].read())
    from_disk = []
    for rank in range(2):
        lo = StreamLoader(
            ShardedStream(local, shuffle_buffer=8),
            seed=2,
            collate_fn=_ids,
            batch_size=4,
            mesh={"dp": 2},
            rank=rank,
        )
        from_disk += [i for b in lo for i in b]
    assert served == from_disk  # the same rows in the same order as the local copy


def test_a_shard_rewritten_in_the_bucket_is_refused_on_resume_by_name(
    s3: S3, tmp_path: Path
) -> None:
    urls = _upload(s3)
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    lo = _loader(urls, remote, batch_size=4)
    take(lo, 3)
    state = lo.state_dict()
    lo.dataset.close()  # the job ends: its holds on the cached shards go
    time.sleep(1.1)  # S3 modification times have one-second resolution
    body = "".join(json.dumps({"id": 9000 + r}) + "\n" for r in range(ROWS[2]))
    s3.put("stream/part-00002.jsonl", body.encode())
    with pytest.raises(ValueError, match=r"part-00002\.jsonl changed after the checkpoint"):
        _loader(urls, remote, batch_size=4).load_state_dict(state)


def test_a_restarted_job_reuses_the_cache_without_a_download(s3: S3, tmp_path: Path) -> None:
    urls = _upload(s3)
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    first = [b for b in _loader(urls, remote, batch_size=4)]
    s3.proxy.reset()
    again = [b for b in _loader(urls, remote, batch_size=4)]
    assert again == first
    assert sum(s3.proxy.object_gets.values()) == 0  # no download ...
    # ... and the job's identity check is one listing of the shards' folder: no HEAD per shard
    assert s3.proxy.counts["HEAD"] == 0 and s3.proxy.counts["GET"] == 1


def _gloo_rank(rank: int, world: int, urls: list[str], remote: dict[str, Any]) -> list[int]:
    with _loader(urls, remote, batch_size=2, mesh={"dp": world}, num_workers=2) as lo:
        return [i for b in lo for i in b]


@pytest.mark.slow
def test_two_gloo_ranks_with_two_workers_read_a_stream_from_s3_every_row_once(
    s3: S3, tmp_path: Path
) -> None:
    urls = _upload(s3)
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    s3.proxy.reset()
    results = run_distributed(_gloo_rank, 2, urls, remote)
    served = [i for r in results for i in r]
    assert len(served) == len(set(served)) == sum(ROWS) // 4 * 4
    assert all(n == 1 for n in s3.proxy.object_gets.values())  # once per node
    assert len(s3.proxy.object_gets) == len(urls)


def test_cache_options_for_local_shards_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "a.txt"
    p.write_text("x\n")
    with pytest.raises(ValueError, match="for shards given as URLs"):
        ShardedStream([str(p)], cache_dir=str(tmp_path))


@NEEDS_ZSTD
def test_a_shard_dataset_streams_from_s3_through_its_index(s3: S3, tmp_path: Path) -> None:
    import numpy as np

    from meshfeed.sources import write_shards

    samples = [{"id": i, "x": np.arange(i % 7 + 1)} for i in range(120)]
    index = write_shards(samples, tmp_path / "ds", rows_per_shard=25, compression="zstd")
    for f in sorted(index.parent.iterdir()):
        s3.put(f"ds/{f.name}", f.read_bytes())
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    s3.proxy.reset()
    stream = ShardedStream.from_index(s3.url("ds"), shuffle_buffer=10, **remote)
    assert stream.rows == [25] * 4 + [20]
    local = ShardedStream.from_index(index, shuffle_buffer=10)
    got = [i for b in StreamLoader(stream, batch_size=8, seed=1, collate_fn=_ids) for i in b]
    want = [i for b in StreamLoader(local, batch_size=8, seed=1, collate_fn=_ids) for i in b]
    assert got == want and len(set(got)) == 120
    assert all(n == 1 for n in s3.proxy.object_gets.values())  # each file fetched once


def test_download_ahead_follows_the_streams_own_shuffled_order(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshfeed.sources.streams.remote import CachedReader

    urls = _upload(s3, rows=[10] * 8, key="ahead")
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    planned: list[str] = []
    real = CachedReader.plan
    # the stream resolves its reader's hooks when it is built: spy on the class before that
    monkeypatch.setattr(
        CachedReader, "plan", lambda self, shards: (planned.extend(shards), real(self, shards))
    )
    stream = ShardedStream(urls, shuffle_buffer=4, rows=[10] * 8, **remote)
    lo = StreamLoader(stream, seed=5, collate_fn=_ids, batch_size=4)
    ids = [i for b in lo for i in b]
    read_order = list(dict.fromkeys(urls[i // 1000] for i in ids))
    assert planned[: len(read_order)] == read_order  # asked for in the order it reads them
    assert read_order != urls  # (the shards were shuffled: list order would be wrong)


def _shard_dataset(s3: S3, tmp: Path, ids: range, *, key: str = "ds", only: str = "") -> None:
    """Write the rows ``ids`` as a shard dataset and upload it (index.json last), or only the
    files whose names contain ``only`` and the index."""
    import shutil

    from meshfeed.sources import write_shards

    out = tmp / f"w{ids.start}-{ids.stop}"
    shutil.rmtree(out, ignore_errors=True)
    index = write_shards([{"id": i} for i in ids], out, rows_per_shard=100)
    for f in sorted(index.parent.iterdir()):
        if f.name != "index.json" and only in f.name:
            s3.put(f"{key}/{f.name}", f.read_bytes())
    s3.put(f"{key}/index.json", index.read_bytes())


def _from_index(s3: S3, cache: Path, **kw: Any) -> StreamLoader:
    stream = ShardedStream.from_index(
        s3.url("ds"), cache_dir=cache, storage_options=s3.options, shuffle_buffer=50
    )
    return StreamLoader(stream, seed=3, collate_fn=_ids, batch_size=4, drop_last=False, **kw)


def test_a_dataset_rewritten_in_the_bucket_is_read_anew_by_a_job_with_the_same_cache(
    s3: S3, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    _shard_dataset(s3, tmp_path, range(500))
    assert sorted(i for b in _from_index(s3, cache) for i in b) == list(range(500))
    _shard_dataset(s3, tmp_path, range(1000, 1800))  # more shards: the cached index is stale
    assert sorted(i for b in _from_index(s3, cache) for i in b) == list(range(1000, 1800))
    _shard_dataset(s3, tmp_path, range(5000, 5800))  # the same shard names and count
    assert sorted(i for b in _from_index(s3, cache) for i in b) == list(range(5000, 5800))


def test_a_warm_shard_dataset_epoch_makes_one_request_the_index_check(
    s3: S3, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    _shard_dataset(s3, tmp_path, range(800))
    first = [b for b in _from_index(s3, cache)]
    assert s3.proxy.counts["HEAD"] == 1  # cold: the index's identity, then one GET per file
    assert sum(s3.proxy.object_gets.values()) == 9 and max(s3.proxy.object_gets.values()) == 1
    s3.proxy.reset()
    with _from_index(s3, cache, num_workers=2) as lo:
        again = [b for b in lo]
        lo.state_dict()  # the fingerprint too: no request per shard
    assert again == first
    assert s3.proxy.counts["HEAD"] == 1 and sum(s3.proxy.counts.values()) == 1


def test_a_shard_rewritten_behind_its_index_is_refused_by_name(s3: S3, tmp_path: Path) -> None:
    _shard_dataset(s3, tmp_path, range(800))
    lo = _from_index(s3, tmp_path / "cache")
    take(lo, 3)
    state = lo.state_dict()
    lo.dataset.close()
    body = s3.client.get_object(Bucket=s3.bucket, Key="ds/shard-00002.mfs")["Body"].read()
    flipped = bytearray(body)
    flipped[-5] ^= 0x10  # one bit of a row's payload, same size: the index's hash catches it
    s3.put("ds/shard-00002.mfs", bytes(flipped))
    resumed = _from_index(s3, tmp_path / "fresh")  # a new node: nothing cached
    resumed.load_state_dict(state)
    with pytest.raises(SourceError, match=r"shard s3://.*/ds/shard-00002\.mfs does not match"):
        [b for b in resumed]


def test_a_dataset_partly_rewritten_after_a_checkpoint_is_refused_naming_the_shard(
    s3: S3, tmp_path: Path
) -> None:
    _shard_dataset(s3, tmp_path, range(800))
    lo = _from_index(s3, tmp_path / "cache")
    take(lo, 3)
    state = lo.state_dict()
    lo.dataset.close()
    time.sleep(1.1)  # S3 modification times have one-second resolution
    _shard_dataset(s3, tmp_path, range(800, 1600), only="00002")  # one shard and the index
    with pytest.raises(ValueError, match=r"shard\(s\) s3://\S+/ds/shard-00002\.mfs changed after"):
        _from_index(s3, tmp_path / "cache").load_state_dict(state)


def _json_lines(shard: Any, start: int, stop: int | None) -> Any:
    """A reader with the required call alone (no take, count or version)."""
    with open(shard) as f:
        rows = [json.loads(line) for line in f]
    return iter(rows[start:stop])


def test_url_shards_through_a_reader_with_only_the_required_call(s3: S3, tmp_path: Path) -> None:
    urls = _upload(s3, key="plain")
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    stream = ShardedStream(urls, _json_lines, shuffle_buffer=8, **remote)
    assert stream.rows == ROWS  # counted through the cache by reading each shard
    with StreamLoader(stream, seed=2, collate_fn=_ids, batch_size=4, drop_last=False) as lo:
        served = [i for b in lo for i in b]
    assert sorted(served) == [s * 1000 + r for s, n in enumerate(ROWS) for r in range(n)]


def test_a_limited_reader_tells_the_cache_each_shard_is_finished_after_its_last_row(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshfeed.storage import ShardCache

    _shard_dataset(s3, tmp_path, range(600))  # 6 shards of 100 rows
    read: list[int] = []
    finished: list[str] = []
    real = ShardCache.finished
    monkeypatch.setattr(
        ShardCache,
        "finished",
        lambda self, url: (finished.append(url), real(self, url))[1],
    )
    stream = ShardedStream.from_index(
        s3.url("ds"),
        cache_dir=tmp_path / "cache",
        cache_limit=3 * 1000 + 100 * 64,  # ample for the window, not for the dataset
        storage_options=s3.options,
        shuffle_buffer=50,
        samples_per_epoch=900,  # an epoch and a half: the second pass is cut mid-way
    )
    with StreamLoader(stream, seed=3, collate_fn=_ids, batch_size=4, drop_last=False) as lo:
        for epoch in range(2):
            lo.set_epoch(epoch)
            for batch in lo:
                read.extend(batch)
    shard_of = {url: i for i, url in enumerate(stream.shards)}
    assert sorted(read) == sorted([*range(600), *range(600), *range(600)])
    # each shard once per pass, in the order in which the passes read their last rows
    expect = []
    for p in range(3):
        last = {i // 100: k for k, i in enumerate(read[600 * p : 600 * (p + 1)])}
        expect += sorted(last, key=last.__getitem__)
    assert [shard_of[u] for u in finished] == expect


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_missing_from_the_bucket_is_refused_naming_its_url(
    s3: S3, tmp_path: Path, workers: int
) -> None:
    """A shard its index lists but the bucket no longer holds (a rewrite deleted it under the
    job): the loader substituted other rows for the whole shard, as for bad samples; a local
    dataset refuses the same. Now a SourceError names the URL."""
    from meshfeed.sources import write_shards

    index = write_shards(({"id": i} for i in range(200)), tmp_path / "ds", rows_per_shard=50)
    for f in sorted(index.parent.iterdir()):
        if f.name != "shard-00002.mfs":  # rows 100..149
            s3.put(f"ds/{f.name}", f.read_bytes())
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    stream = ShardedStream.from_index(s3.url("ds"), shuffle_buffer=0, **remote)
    with pytest.raises(SourceError, match=r"ds/shard-00002.mfs is missing from the bucket"):
        with StreamLoader(
            stream, batch_size=25, seed=0, collate_fn=_ids, num_workers=workers
        ) as loader:
            list(loader)


def test_verify_downloads_again_a_copy_damaged_in_the_cache(s3: S3, tmp_path: Path) -> None:
    """verify=True on a URL dataset refused a cached copy damaged on disk as a damaged
    dataset ("rewrite the dataset"), in every later job, though the bucket's copy was fine."""
    from meshfeed.sources import write_shards

    index = write_shards(({"id": i} for i in range(60)), tmp_path / "ds", rows_per_shard=20)
    for f in sorted(index.parent.iterdir()):
        s3.put(f"ds/{f.name}", f.read_bytes())
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    first = ShardedStream.from_index(s3.url("ds"), shuffle_buffer=0, **remote)
    want = [i for b in StreamLoader(first, batch_size=10, seed=0, collate_fn=_ids) for i in b]
    cached = next((tmp_path / "cache").rglob("shard-00001.mfs"))
    data = bytearray(cached.read_bytes())
    data[len(data) // 2] ^= 0x10  # same size: only a hash tells
    cached.write_bytes(bytes(data))
    again = ShardedStream.from_index(s3.url("ds"), shuffle_buffer=0, verify=True, **remote)
    got = [i for b in StreamLoader(again, batch_size=10, seed=0, collate_fn=_ids) for i in b]
    assert got == want and sorted(got) == list(range(60))
