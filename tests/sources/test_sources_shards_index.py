"""The shard index by column (#32): version 2 as written, version 1 still read, a rank touches
only the shards it reads, a changed shard refused by name, and ``meshfeed index``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import meshfeed
from meshfeed.cli import main as cli
from meshfeed.errors import SourceError
from meshfeed.sources import ShardedStream, ShardFormatReader, read_index, write_shards
from meshfeed.sources.shards.index import reindex
from tests.dist_utils import run_distributed

ROWS, SHARDS = 600, 200


def dataset(root: Path, shards: int = SHARDS, rows: int = ROWS) -> Path:
    samples = ({"x": np.int64(i), "s": f"row {i}"} for i in range(rows))
    return Path(write_shards(samples, root / "ds", rows_per_shard=rows // shards))


def as_version_1(index: Path) -> None:
    """Rewrite a version-2 ``index.json`` as version 1 (a list of objects), as older
    meshfeed wrote it."""
    raw = json.loads(index.read_text())
    cols = raw["shards"]
    raw["version"] = 1
    raw["shards"] = [
        {
            "file": f,
            "rows": r,
            "bytes": b,
            "hash": h,
            "payload": p,
            "layout": json.loads(layout),
        }
        for f, r, b, h, p, layout in zip(
            *(cols[k] for k in ("file", "rows", "bytes", "hash", "payload", "layout")),
            strict=True,
        )
    ]
    index.write_text(json.dumps(raw))


def first_batch(index: Path, rank: int = 3, world: int = 4) -> list[int]:
    stream = ShardedStream.from_index(index)
    loader = meshfeed.StreamLoader(stream, batch_size=4, mesh={"dp": world}, rank=rank, seed=1)
    return next(iter(loader))["x"].tolist()  # type: ignore[no-any-return]


def _gloo_first_batch(rank: int, world: int, index: str) -> list[int]:
    # the gloo group is up: the ranks check they agree on the plan before the first batch
    return first_batch(Path(index), rank=rank, world=world)


def test_the_index_holds_the_shards_by_column(tmp_path: Path) -> None:
    index = dataset(tmp_path)
    raw = json.loads(index.read_text())
    assert raw["version"] == 2 and sorted(raw["shards"]) == sorted(
        ["file", "rows", "bytes", "hash", "payload", "layout"]
    )
    assert all(len(col) == SHARDS for col in raw["shards"].values())
    got = read_index(index)
    assert got.rows.tolist() == [ROWS // SHARDS] * SHARDS and got.num_rows == ROWS
    header = (index.parent / "shard-00007.mfs").read_bytes()
    assert raw["shards"]["layout"][7].encode() in header  # the shard's header, as text


def test_a_version_1_index_reads_the_same(tmp_path: Path) -> None:
    index = dataset(tmp_path)
    new = read_index(index)
    before = first_batch(index)
    as_version_1(index)
    old = read_index(index)
    assert old.files == new.files and old.hashes == new.hashes
    assert old.rows.tolist() == new.rows.tolist() and old.sizes.tolist() == new.sizes.tolist()
    assert [e.to_json() for e in old.shards] == [e.to_json() for e in new.shards]
    assert first_batch(index) == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rows": [-1]}, "shard rows must be non-negative ints"),
        ({"bytes": [1.5]}, "shard bytes must be non-negative ints"),
        ({"layout": [{}]}, "shard layout {} is not a string"),
        ({"hash": None}, "shards needs the columns"),
    ],
)
def test_a_malformed_column_is_refused_by_name(
    tmp_path: Path, change: dict[str, list[object]], message: str
) -> None:
    index = dataset(tmp_path, shards=2, rows=4)
    raw = json.loads(index.read_text())
    for k, v in change.items():
        raw["shards"][k] = v if v is None else v + raw["shards"][k][1:]
    index.write_text(json.dumps(raw))
    with pytest.raises(SourceError, match=message):
        read_index(index)


def test_columns_of_different_lengths_are_refused(tmp_path: Path) -> None:
    index = dataset(tmp_path, shards=2, rows=4)
    raw = json.loads(index.read_text())
    raw["shards"]["file"] = raw["shards"]["file"][:1]
    index.write_text(json.dumps(raw))
    with pytest.raises(SourceError, match="shard columns differ in length"):
        read_index(index)


def test_a_damaged_layout_is_refused_naming_its_shard_when_read(tmp_path: Path) -> None:
    index = dataset(tmp_path, shards=4, rows=8)
    raw = json.loads(index.read_text())
    raw["shards"]["layout"][2] = "{not json"
    index.write_text(json.dumps(raw))
    reader = ShardFormatReader.from_index(index)  # opening the dataset parses no layout
    assert [s["x"] for s in reader.take(reader.shards[1], np.array([0, 1]))] == [2, 3]
    with pytest.raises(SourceError, match="layout of shard shard-00002.mfs is not JSON"):
        reader.take(reader.shards[2], np.array([0]))


def test_a_rank_touches_only_the_shards_it_reads(tmp_path: Path) -> None:
    index = dataset(tmp_path)
    first = first_batch(index)
    read = {f"shard-{x // (ROWS // SHARDS):05d}.mfs" for x in first}
    for p in index.parent.glob("shard-*.mfs"):
        if p.name not in read:
            p.unlink()  # a stat or an open of any other shard would now fail
    assert len(list(index.parent.glob("*.mfs"))) == len(read) < SHARDS // 10
    assert first_batch(index) == first


@pytest.mark.slow
def test_two_gloo_ranks_each_touch_only_the_shards_they_read(tmp_path: Path) -> None:
    index = dataset(tmp_path)
    firsts = [first_batch(index, rank=r, world=2) for r in range(2)]  # all ranks, one process
    read = {f"shard-{x // (ROWS // SHARDS):05d}.mfs" for batch in firsts for x in batch}
    for p in index.parent.glob("shard-*.mfs"):
        if p.name not in read:
            p.unlink()
    assert len(read) < SHARDS // 10
    assert run_distributed(_gloo_first_batch, 2, str(index)) == firsts


def test_a_shard_changed_after_indexing_is_refused_by_name_by_the_reader_that_reaches_it(
    tmp_path: Path,
) -> None:
    index = dataset(tmp_path, shards=20, rows=200)
    shard = index.parent / "shard-00013.mfs"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size: only the hash can tell (the mtime says it changed)
    shard.write_bytes(bytes(data))
    stream = ShardedStream.from_index(index)  # opens: nothing is hashed or refused yet
    loader = meshfeed.StreamLoader(stream, batch_size=10, seed=0, collate_fn=list)
    seen: list[object] = []
    with pytest.raises(SourceError, match=r"shard-00013\.mfs has content hash"):
        for batch in loader:
            seen += batch
    assert len(seen) < 200  # refused, never served nor replaced by substitutes


def test_meshfeed_index_rewrites_a_version_1_index(tmp_path: Path) -> None:
    index = dataset(tmp_path, shards=10, rows=40)
    before = index.read_text()
    as_version_1(index)
    assert cli(["index", str(index.parent)]) == 0
    assert json.loads(index.read_text())["version"] == 2
    assert index.read_text() == before  # the same index as write_shards wrote
    assert sorted(os.listdir(index.parent)) == ["index.json"] + [
        f"shard-{i:05d}.mfs" for i in range(10)
    ]


def test_meshfeed_index_refuses_a_changed_shard_by_name_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index = dataset(tmp_path, shards=10, rows=40)
    as_version_1(index)
    old = index.read_text()
    shard = index.parent / "shard-00004.mfs"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, written after its index: hashed anyway
    assert cli(["index", str(index)]) == 2
    assert "shard-00004.mfs has content hash" in capsys.readouterr().err
    assert index.read_text() == old
    before = index.stat().st_mtime_ns - 10**9
    os.utime(shard, ns=(before, before))  # damage that keeps an old mtime: only --verify sees it
    assert cli(["index", "--verify", str(index)]) == 2
    assert "shard-00004.mfs has content hash" in capsys.readouterr().err
    assert index.read_text() == old
    assert cli(["index", str(index)]) == 0
    new = index.read_text()
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(SourceError, match=r"shard-00004\.mfs has \d+ bytes but"):
        reindex(index)
    assert index.read_text() == new
