"""URL outputs of the writers: which outputs upload, and what is refused before any work.

The uploads themselves run against moto's S3 server in tests/storage/test_storage_remote_writers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshfeed.sources import read_index, write_shards
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.storage.output import Upload, check_writable, upload_target


def test_upload_target_tells_urls_from_local_paths(tmp_path: Path) -> None:
    assert upload_target("s3://bucket/prefix/") == "s3://bucket/prefix"
    assert upload_target("gs://b/x") == "gs://b/x"
    assert upload_target(f"file://{tmp_path}/x") is None  # a local folder
    assert upload_target(tmp_path / "x") is None and upload_target("rel/x") is None


def test_file_urls_are_written_in_place(tmp_path: Path) -> None:
    index = write_shards(range(10), f"file://{tmp_path}/ds", rows_per_shard=5)
    assert index == tmp_path / "ds" / "index.json" and read_index(index).num_rows == 10
    corpus = write_indexed(f"file://{tmp_path}/c", [[1, 2], [3]])
    assert corpus.num_documents == 2 and (tmp_path / "c.idx").is_file()


def test_a_url_cache_dir_and_an_unknown_protocol_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="cache_dir takes a local path"):
        Upload("s3://bucket/cache")
    with pytest.raises(ValueError, match=r"cannot write the shards to nope://b/x: .*Protocol"):
        check_writable("nope://b/x", what="the shards")
    with pytest.raises(ValueError, match=r"cannot write the shards to nope://b/x"):
        write_shards(range(3), "nope://b/x", cache_dir=tmp_path / "cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert not list((tmp_path / "cache").glob(".upload-*"))  # the staging folder went too
