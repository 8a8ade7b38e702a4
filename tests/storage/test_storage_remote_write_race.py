"""Two ``write_shards(..., overwrite=False)`` racing on one new S3 prefix (moto's server).

Every object of a new dataset is created with ``If-None-Match: *``: the writer that creates
``shard-00000.mfs`` first goes on, the other raises before it overwrote anything and deletes
none of the winner's objects. Both writers pass the emptiness check before either uploads (a
barrier in their samples).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import meshfeed.sources.shards.upload as upload_mod
from meshfeed.sources import ShardedStream, write_shards
from tests.sources.test_shards_write_race import race
from tests.storage.conftest import S3


def _keys(s3: S3, prefix: str) -> set[str]:
    found = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"] for o in found}


def _rows(s3: S3, url: str, cache: Path) -> list[int]:
    stream = ShardedStream.from_index(url, cache_dir=cache, storage_options=s3.options)
    try:
        return [int(r) for r in stream.__getitems__(list(range(len(stream))))]
    finally:
        stream.close()


def test_two_writers_racing_on_one_new_prefix_exactly_one_wins(s3: S3, tmp_path: Path) -> None:
    for trial in range(3):
        url = s3.url(f"ds{trial}")
        caches = tmp_path / f"cache{trial}"
        result = race(
            url,
            options=lambda k, caches=caches: {
                "cache_dir": caches / str(k),
                "storage_options": s3.options,
            },
        )
        won = [k for k, r in result.items() if not isinstance(r, BaseException)]
        lost = [r for r in result.values() if isinstance(r, BaseException)]
        assert len(won) == 1 and len(lost) == 1, result
        assert isinstance(lost[0], FileExistsError)
        assert f"another writer claimed {url} " in str(lost[0])
        assert "pass overwrite=True" in str(lost[0])
        k = won[0]
        assert _keys(s3, f"ds{trial}/") == {f"ds{trial}/index.json"} | {
            f"ds{trial}/shard-{n:05d}.mfs" for n in range(3)
        }
        assert _rows(s3, url, tmp_path / f"read{trial}") == list(range(k * 1000, k * 1000 + 7))


def test_a_server_without_conditional_puts_gets_plain_uploads(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = upload_mod.filesystem

    class NoConditions:  # a server answering If-None-Match with 501, as s3fs reports it
        def __init__(self, fs: Any) -> None:
            self.fs = fs
            self.protocol = fs.protocol

        def put_file(self, lpath: str, rpath: str, mode: str = "overwrite") -> None:
            assert mode == "create"
            raise OSError(errno.ENOSYS, "A header you provided implies functionality that ...")

        def invalidate_cache(self, path: str) -> None:
            self.fs.invalidate_cache(path)

    def filesystem(url: str, options: Any = None) -> tuple[Any, str]:
        fs, path = real(url, options)
        return NoConditions(fs), path

    monkeypatch.setattr(upload_mod, "filesystem", filesystem)
    url = s3.url("plain")
    write_shards(
        range(5), url, rows_per_shard=2, cache_dir=tmp_path / "c", storage_options=s3.options
    )
    assert _rows(s3, url, tmp_path / "read") == list(range(5))


def test_a_create_whose_reply_was_lost_is_the_writers_own_on_retry(s3: S3, tmp_path: Path) -> None:
    """A conditional create lands but its reply is lost (a 500 in its place): the retry finds
    the object there (412). It carries this write's mark, so the write goes on, whole; another
    writer's object (no mark, or another) is still refused."""
    for lost in (1, 2, 4):  # the first shard's PUT; the second's too; two shards and the index
        url = s3.url(f"lost{lost}")
        s3.proxy.lose_next_puts = lost
        got = write_shards(
            iter(range(7)),
            url,
            rows_per_shard=3,
            cache_dir=tmp_path / f"cache{lost}",
            storage_options=s3.options,
        )
        assert got.endswith("index.json") and s3.proxy.lose_next_puts == 0
        assert _rows(s3, url, tmp_path / f"read{lost}") == list(range(7))
        assert _keys(s3, f"lost{lost}/") == {f"lost{lost}/index.json"} | {
            f"lost{lost}/shard-{n:05d}.mfs" for n in range(3)
        }

    def samples() -> Iterator[int]:  # another writer's object lands after the prefix check
        s3.put("taken/shard-00000.mfs", b"another writer's bytes")
        yield from range(7)

    s3.proxy.lose_next_puts = 1  # and this writer's create is retried: still refused
    with pytest.raises(FileExistsError, match="another writer claimed"):
        write_shards(
            samples(),
            s3.url("taken"),
            rows_per_shard=3,
            cache_dir=tmp_path / "cache-taken",
            storage_options=s3.options,
        )
    assert _keys(s3, "taken/") == {"taken/shard-00000.mfs"}
    assert s3.client.get_object(Bucket=s3.bucket, Key="taken/shard-00000.mfs")["Body"].read() == (
        b"another writer's bytes"
    )


def test_a_refused_create_whose_reply_names_no_condition_keeps_the_winners_objects(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server may answer the refused create with 412 without naming the condition (s3fs
    then raises OSError(EINVAL), not FileExistsError): still another writer's object, and
    the loser removes none of the winner's objects, only its own."""
    import s3fs.core
    import s3fs.errors

    real = s3fs.errors.translate_boto_error

    def translate(error: Any, *args: Any, **kwargs: Any) -> Any:
        reply = getattr(error, "response", None)
        if reply is not None and reply.get("Error", {}).get("Code") == "PreconditionFailed":
            reply["Error"].pop("Condition", None)
        return real(error, *args, **kwargs)

    monkeypatch.setattr(s3fs.core, "translate_boto_error", translate)
    url = s3.url("ds")
    write_shards(
        iter(range(7)), url, rows_per_shard=3, cache_dir=tmp_path / "w1", storage_options=s3.options
    )
    winner = _keys(s3, "ds/")
    s3.client.delete_object(Bucket=s3.bucket, Key="ds/index.json")  # the loser sees no dataset
    monkeypatch.setattr("meshfeed.storage.output.Upload.holds_anything", lambda self, url: False)
    with pytest.raises(FileExistsError, match="another writer claimed"):
        write_shards(
            iter(range(100, 107)),
            url,
            rows_per_shard=3,
            cache_dir=tmp_path / "w2",
            storage_options=s3.options,
        )
    assert _keys(s3, "ds/") == winner - {"ds/index.json"}
