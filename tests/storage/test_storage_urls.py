from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from meshfeed.errors import SourceError
from meshfeed.storage import (
    RetryPolicy,
    ShardCache,
    file_size,
    file_version,
    is_url,
    list_files,
    local_path_of,
    open_url,
    read_range,
    resolve,
    upload_file,
    version_of,
)
from tests.storage.conftest import S3


@pytest.mark.parametrize(
    "path", ["s3://b/k", "gs://b/k.bin", "hf://datasets/x", "file:///tmp/x", "simplecache::s3://b"]
)
def test_urls_are_recognised(path: str) -> None:
    assert is_url(path)


@pytest.mark.parametrize("path", ["/tmp/x", "rel/x.bin", "C:\\data\\x", "s3:/b", Path("/tmp/x")])
def test_local_paths_are_not_urls(path: object) -> None:
    assert not is_url(path)


def test_file_urls_resolve_to_their_path_without_a_cache(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"abc")
    assert local_path_of(f"file://{f}") == str(f)
    assert resolve(f"file://{f}", cache=None) == str(f)
    assert resolve(f, cache=None) == str(f)


def test_a_url_without_a_cache_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"s3://b/k is a URL.*cache_dir"):
        resolve("s3://b/k", cache=None)


def test_local_version_is_size_and_mtime_ns_and_changes_with_the_file(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"abc")
    st = f.stat()
    assert version_of(f) == f"3-{st.st_mtime_ns}" == version_of(f"file://{f}")
    f.write_bytes(b"abcd")
    assert version_of(f).startswith("4-")


def test_a_url_without_fsspec_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "meshfeed\[remote\]"'):
        file_size("s3://b/k")


def test_an_unknown_protocol_names_what_to_install() -> None:
    with pytest.raises((ImportError, ValueError), match="gcsfs|protocol"):
        file_size("gs://bucket/key", retry_timeout=0)


def test_size_version_range_and_open_against_s3(s3: S3) -> None:
    data = os.urandom(10_000)
    url = s3.put("x/a.bin", data)
    opts = s3.options
    assert file_size(url, storage_options=opts) == 10_000
    v1 = file_version(url, storage_options=opts)
    assert v1 == version_of(url, storage_options=opts) and v1.startswith("10000-")
    assert read_range(url, 100, 250, storage_options=opts) == data[100:250]
    with open_url(url, storage_options=opts) as f:
        assert f.read() == data
    s3.put("x/a.bin", os.urandom(10_000))
    assert file_version(url, storage_options=opts) != v1  # same size, new content


def test_a_missing_object_is_named_at_once(s3: S3) -> None:
    with pytest.raises(FileNotFoundError, match=f"s3://{s3.bucket}/nope"):
        file_size(s3.url("nope"), storage_options=s3.options)
    assert s3.proxy.counts["HEAD"] >= 1


def test_list_files_and_upload(s3: S3, tmp_path: Path) -> None:
    for name in ("b.parquet", "a.parquet", "c.txt"):
        s3.put(f"dir/{name}", b"x")
    urls = list_files(s3.url("dir"), suffix=".parquet", storage_options=s3.options)
    assert urls == [s3.url("dir/a.parquet"), s3.url("dir/b.parquet")]
    f = tmp_path / "up.bin"
    f.write_bytes(b"uploaded")
    upload_file(f, s3.url("dir/up.bin"), storage_options=s3.options)
    body = s3.client.get_object(Bucket=s3.bucket, Key="dir/up.bin")["Body"].read()
    assert body == b"uploaded"


def test_a_down_endpoint_gives_a_source_error_naming_the_url_within_the_bound(s3: S3) -> None:
    url = s3.put("k.bin", b"x")
    s3.proxy.stop()
    with pytest.raises(SourceError, match=rf"{url}: the server at {s3.proxy.endpoint} refused"):
        file_size(url, storage_options=s3.options, retry_timeout=0.5)


def test_refused_connections_get_little_time_other_transient_failures_the_whole_bound() -> None:
    policy = RetryPolicy(timeout=30.0, refused=0.3, base=0.01, cap=0.05)
    calls = 0

    def refused() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionRefusedError(111, "Connection refused")

    t0 = time.monotonic()
    with pytest.raises(
        SourceError, match="cannot read s3://b/k: the server at http://h:1 refused every"
    ):
        policy.call(refused, url="s3://b/k", endpoint="http://h:1")
    assert time.monotonic() - t0 < 2.0 and calls > 1  # retried, briefly
    flaky = iter([ConnectionRefusedError(111, "refused"), TimeoutError("slow"), None])

    def then_timeout() -> str:
        e = next(flaky)
        if e is not None:
            raise e
        return "ok"

    assert policy.call(then_timeout, url="s3://b/k") == "ok"


def test_resolve_downloads_a_url_through_the_cache(s3: S3, tmp_path: Path) -> None:
    url = s3.put("r/a.bin", b"payload")
    with ShardCache(tmp_path, storage_options=s3.options) as cache:
        path = resolve(url, cache=cache)
        assert Path(path).read_bytes() == b"payload"
        assert path == cache.entry_path(url) and path.endswith("a.bin")
