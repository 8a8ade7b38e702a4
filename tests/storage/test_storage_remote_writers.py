"""Writers with a URL output, against moto's S3 server: shards and corpora are uploaded (#28, #29).

``write_shards`` / ``write_indexed`` / ``meshfeed convert`` to ``s3://`` upload each file once
complete, the metadata file last, and never leave a local folder named after the URL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed.sources import ShardedStream, write_shards
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_write import IndexedWriter, write_indexed
from tests.storage.conftest import S3, use_env_endpoint


def _keys(s3: S3, prefix: str) -> set[str]:
    found = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"] for o in found}


def test_write_shards_uploads_shard_by_shard_with_the_index_last(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    seen: list[set[str]] = []

    def samples() -> Iterator[dict[str, Any]]:
        for i in range(50):
            if i == 40:  # shard 4 is being cut: shards 0..2 are up, the index is not
                seen.append(_keys(s3, "ds/"))
            yield {"ids": np.arange(i % 7, dtype=np.int32), "i": i}

    url = s3.url("ds")
    remote = {"cache_dir": tmp_path / "cache", "storage_options": s3.options}
    got = write_shards(samples(), url, rows_per_shard=10, **remote)
    assert got == f"{url}/index.json"
    assert {"ds/shard-00000.mfs", "ds/shard-00002.mfs"} <= seen[0]
    assert "ds/index.json" not in seen[0]
    assert _keys(s3, "ds/") == {"ds/index.json"} | {f"ds/shard-{n:05d}.mfs" for n in range(5)}
    assert not Path("s3:").exists() and not list((tmp_path / "cache").glob(".upload-*"))
    s3.proxy.reset()
    fresh = ShardedStream.from_index(url, cache_dir=tmp_path / "other", storage_options=s3.options)
    rows = fresh.__getitems__(list(range(50)))
    assert [int(r["i"]) for r in rows] == list(range(50))
    assert [r["ids"].tolist() for r in rows[:8]] == [list(range(i % 7)) for i in range(8)]
    fresh.close()


def test_shards_a_writer_uploaded_are_read_from_its_cache_without_a_download(
    s3: S3, tmp_path: Path
) -> None:
    remote = {"cache_dir": tmp_path / "cache", "storage_options": s3.options}
    url = write_shards(
        ({"i": i} for i in range(30)), s3.url("adopted"), rows_per_shard=10, **remote
    )
    s3.proxy.reset()
    stream = ShardedStream.from_index(url, **remote)
    assert [int(r["i"]) for r in stream.__getitems__(list(range(30)))] == list(range(30))
    stream.close()
    # the adopted copies carry the index's blake2b digests: only the index itself is fetched
    assert [k for k in s3.proxy.object_gets if not k.endswith("index.json")] == []


def test_a_failed_write_uploads_no_index_and_a_second_write_needs_overwrite(
    s3: S3, tmp_path: Path
) -> None:
    remote = {"cache_dir": tmp_path / "cache", "storage_options": s3.options}
    url = s3.url("ds")

    def bad() -> Iterator[Any]:
        yield from range(25)
        yield "text"  # another kind than row 0: refused

    with pytest.raises(TypeError, match="row 25"):
        write_shards(bad(), url, rows_per_shard=10, **remote)
    assert _keys(s3, "ds/") == set()  # its two uploaded shards removed: nothing left behind
    assert not list((tmp_path / "cache").glob(".upload-*"))
    s3.put("other/notes.txt", b"a user's file")
    with pytest.raises(FileExistsError, match="holds objects but no index.json"):
        write_shards(range(5), s3.url("other"), **remote)
    write_shards(range(5), s3.url("ok"), **remote)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        write_shards(range(3), s3.url("ok"), **remote)
    with pytest.raises(TypeError, match="row 25"):  # a rewrite that fails: the old one stays
        write_shards(bad(), s3.url("ok"), rows_per_shard=10, overwrite=True, **remote)
    fresh = {"cache_dir": tmp_path / "fresh", "storage_options": s3.options}
    old = ShardedStream.from_index(s3.url("ok"), **fresh)
    assert old.__getitems__(list(range(5))) == list(range(5))
    old.close()
    write_shards(range(100, 103), s3.url("ok"), overwrite=True, **remote)
    index = json.loads(s3.client.get_object(Bucket=s3.bucket, Key="ok/index.json")["Body"].read())
    assert sum(index["shards"]["rows"]) == 3
    # the new shards (new names) and the index only: old shards and the failed rewrite's gone
    assert _keys(s3, "ok/") == {f"ok/{f}" for f in index["shards"]["file"]} | {"ok/index.json"}
    new = ShardedStream.from_index(
        s3.url("ok"), cache_dir=tmp_path / "f2", storage_options=s3.options
    )
    assert new.__getitems__([0, 1, 2]) == [100, 101, 102]
    new.close()


@pytest.mark.slow
def test_convert_to_shards_with_a_url_output_uploads(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshfeed.cli import main

    monkeypatch.chdir(tmp_path)
    use_env_endpoint(s3, monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"ids": [n, 300], "t": "x" * n}) + "\n" for n in range(40)))
    url = s3.url("cli/shards")
    cache = ["--cache-dir", str(tmp_path / "cache")]
    argv = ["convert", str(src), "--to", "shards", "-o", url, "--rows-per-shard", "16", *cache]
    assert main(argv) == 0
    assert f"wrote {url}/index.json: 40 samples in 3 shards" in capsys.readouterr().out
    assert "cli/shards/index.json" in _keys(s3, "cli/")
    assert not Path("s3:").exists()  # today's fault: a local folder named after the URL
    stream = ShardedStream.from_index(url, cache_dir=tmp_path / "c2", storage_options=s3.options)
    rows = stream.__getitems__(list(range(40)))
    assert [r["ids"].tolist() for r in rows] == [[n, 300] for n in range(40)]
    assert rows[0]["ids"].dtype == np.uint16  # the narrowest type that holds 0..300
    stream.close()
    assert main(argv) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "-j", "2"]) == 0  # encoded in 2 processes, uploaded here
    again = ShardedStream.from_index(url, cache_dir=tmp_path / "c3", storage_options=s3.options)
    assert [r["ids"].tolist() for r in again.__getitems__(list(range(40)))] == [
        [n, 300] for n in range(40)
    ]
    again.close()


def test_write_indexed_to_a_url_uploads_and_the_streaming_writer_refuses_one(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = s3.url("corpora/c")
    corpus = write_indexed(
        url, [[1, 2, 3], [4]], "uint16", cache_dir=tmp_path / "cache", storage_options=s3.options
    )
    assert corpus.document(1).tolist() == [4]
    assert _keys(s3, "corpora/") == {"corpora/c.bin", "corpora/c.idx"}
    fresh = TokenCorpus.open(url, cache_dir=tmp_path / "other", storage_options=s3.options)
    assert fresh.fingerprint == corpus.fingerprint
    with pytest.raises(ValueError, match="IndexedWriter takes a local path.*write_indexed"):
        IndexedWriter(url)
    assert not Path("s3:").exists()


def test_local_writers_refuse_a_url_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshfeed.curriculum import MetricIndex
    from meshfeed.curriculum.index import save_accumulated
    from meshfeed.queue import SampleStore

    monkeypatch.chdir(tmp_path)
    index = MetricIndex.from_values("m", np.arange(5.0), fingerprint={"length": 5, "hash": "t"})
    with pytest.raises(ValueError, match="MetricIndex.save takes a local path .*output_dir=URL"):
        index.save("s3://bucket/metrics/m")
    with pytest.raises(ValueError, match="save_accumulated takes a local path"):
        save_accumulated("s3://bucket/a", "a", np.zeros(3), {"length": 3, "hash": "t"})
    with pytest.raises(ValueError, match="SampleStore.save takes a local path"):
        SampleStore().save("s3://bucket/store.pt")
    assert list(tmp_path.iterdir()) == []  # no folder named after the URL
    assert index.save(f"file://{tmp_path}/m") == tmp_path / "m"  # a file:// URL is local


def test_a_missing_bucket_fails_before_any_work_naming_the_url(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshfeed.sources.converters.convert import convert

    remote = {"cache_dir": tmp_path / "cache", "storage_options": s3.options}
    read: list[int] = []

    def samples() -> Iterator[int]:
        read.append(1)
        yield 1

    missing = "s3://no-such-bucket-here/ds"
    with pytest.raises(
        FileNotFoundError, match=f"cannot write the shards to {missing}: the bucket"
    ):
        write_shards(samples(), missing, **remote)
    with pytest.raises(FileNotFoundError, match="cannot write the corpus to s3://no-such-bucket"):
        write_indexed(missing, samples(), **remote)
    src = tmp_path / "in.jsonl"
    src.write_text("[1, 2]\n")
    with pytest.raises(FileNotFoundError, match="cannot write the corpus to s3://no-such-bucket"):
        convert(src, missing, progress=False, **remote)
    assert read == [] and not list((tmp_path / "cache").glob(".upload-*"))
