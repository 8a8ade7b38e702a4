"""meshfeed shards: write_shards, read_index and ShardFormatReader, round trip and faults."""

from __future__ import annotations

import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed.errors import SourceError
from meshfeed.sources import ShardFormatReader, read_index, write_shards
from meshfeed.sources.shards.format import PREAMBLE, file_hash
from tests.optional import NEEDS_ZSTD, ZSTD

COMPRESSIONS = [None, ZSTD]


def mixed_samples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Every supported kind; ``tok`` / ``m`` / ``s`` / ``b`` vary in length, the rest do not."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "tok": rng.integers(0, 50_000, int(rng.integers(0, 40))).astype(np.int32),
            "img": torch.randn(3, 4, generator=gen),
            "y": i * 7 - 50,
            "f": i / 3,
            "ok": i % 2 == 0,
            "s": "héllo ✓" * (i % 3),
            "b": bytes([i % 256]) * (i % 5),
            "m": torch.randn(2, i % 4 + 1, generator=gen).to(torch.bfloat16),
            "grid": rng.random((i % 3 + 1, 2)),
            "z": np.array(i, dtype=np.int16),
            "sc": np.float32(i) / 2,
            "mask": torch.tensor([i % 2 == 0, True]),
        }
        for i in range(n)
    ]


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)
    else:
        assert type(a) is type(b) and a == b


def read_all(reader: ShardFormatReader) -> list[Any]:
    return [row for path in reader.shards for row in reader(path)]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_round_trip_of_every_kind(tmp_path: Path, compression: str | None) -> None:
    samples = mixed_samples(60)
    index = write_shards(
        samples, tmp_path / "ds", rows_per_shard=25, compression=compression, block_rows=7
    )
    reader = ShardFormatReader.from_index(index)
    assert [reader.count(p) for p in reader.shards] == [25, 25, 10]
    got = read_all(reader)
    assert len(got) == len(samples)
    for a, b in zip(samples, got, strict=True):
        assert_same(a, b)
    raw = json.loads(index.read_text())
    assert raw["version"] == 2  # the shards by column (#32)
    columns = json.loads(raw["shards"]["layout"][0])["columns"]
    stores = {f["name"]: c["store"] for f, c in zip(raw["fields"], columns, strict=True)}
    assert stores["img"] == stores["y"] == stores["z"] == "fixed"
    assert stores["tok"] == stores["s"] == stores["m"] == stores["grid"] == "var"


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize(
    "samples",
    [
        [torch.arange(n, dtype=torch.int64) for n in range(30)],
        [np.full((2, 3), n, np.float16) for n in range(30)],
        list(range(-15, 15)),
        [f"doc {n} " * n for n in range(30)],
        [bytes(range(n)) for n in range(30)],
    ],
    ids=["var-tensors", "fixed-arrays", "ints", "str", "bytes"],
)
def test_bare_values_round_trip(
    tmp_path: Path, samples: list[Any], compression: str | None
) -> None:
    index = write_shards(samples, tmp_path / "ds", rows_per_shard=11, compression=compression)
    got = read_all(ShardFormatReader.from_index(index))
    assert len(got) == len(samples)
    for a, b in zip(samples, got, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_take_gives_rows_in_the_order_asked_with_repeats_across_blocks(
    tmp_path: Path, compression: str | None, seed: int
) -> None:
    samples = mixed_samples(50, seed)
    index = write_shards(
        samples, tmp_path / "ds", rows_per_shard=50, block_rows=4, compression=compression
    )
    reader = ShardFormatReader.from_index(index)
    rows = np.random.default_rng(seed).integers(0, 50, 80)
    rows[:3] = [49, 0, 49]
    got = reader.take(reader.shards[0], rows)
    assert len(got) == len(rows)
    for r, b in zip(rows.tolist(), got, strict=True):
        assert_same(samples[r], b)
    assert reader.take(reader.shards[0], np.empty(0, np.int64)) == []
    with pytest.raises(IndexError, match="row 50 is outside shard"):
        reader.take(reader.shards[0], np.array([3, 50]))


def _edit_in_place(sample: dict[str, Any]) -> None:
    """Add to every array and tensor of ``sample`` in place (as a transform might)."""
    for v in sample.values():
        if isinstance(v, torch.Tensor):
            v.add_(True if v.dtype == torch.bool else 100)
        elif isinstance(v, np.ndarray):
            v += np.array(True if v.dtype == bool else 100, dtype=v.dtype)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_a_sample_edited_in_place_changes_no_later_read(
    tmp_path: Path, compression: str | None
) -> None:
    from meshfeed import StreamLoader
    from meshfeed.sources import LazyDataset, ShardedStream

    samples = mixed_samples(24)
    index = write_shards(
        samples, tmp_path / "ds", rows_per_shard=12, block_rows=4, compression=compression
    )
    reader = ShardFormatReader.from_index(index, cache_bytes=1)  # zstd: one block cached
    rows = np.array([0, 5, 0, 11, 5])
    for _ in range(2):  # the same rows again, from the same map and cached blocks
        got = reader.take(reader.shards[0], rows)
        for r, b in zip(rows.tolist(), got, strict=True):
            assert_same(samples[r], b)
        for b in got:
            _edit_in_place(b)
    stream = ShardedStream.from_index(index)

    def edit(row: dict[str, Any]) -> dict[str, Any]:
        _edit_in_place(row)
        return row

    lo = StreamLoader(LazyDataset(stream).map(edit), batch_size=6, shuffle=False, collate_fn=list)
    for _ in range(2):  # every epoch reads what the file holds, edited once
        for i, row in enumerate(b for batch in lo for b in batch):
            assert torch.equal(row["img"], samples[i]["img"] + 100)
            assert np.array_equal(row["tok"], samples[i]["tok"] + 100)
    for i in (0, 13):  # the map-style read of the same rows
        assert_same(stream[i], samples[i])


def test_range_form_and_count_and_version(tmp_path: Path) -> None:
    samples = [{"x": np.arange(n % 5, dtype=np.int32), "n": n} for n in range(40)]
    index = write_shards(samples, tmp_path / "ds", rows_per_shard=20, block_rows=3)
    reader = ShardFormatReader()  # finds index.json beside each shard
    paths = [str(tmp_path / "ds" / f"shard-0000{i}.mfs") for i in range(2)]
    assert [reader.count(p) for p in paths] == [20, 20]
    assert [r["n"] for r in reader(paths[1], 5, 17)] == list(range(25, 37))
    assert [r["n"] for r in reader(paths[1], 18, None)] == [38, 39]
    assert list(reader(paths[0], 20, 30)) == []
    versions = [reader.version(p) for p in paths]
    assert versions == [f"blake2b-128:{file_hash(p)}" for p in paths]
    assert versions[0] != versions[1]
    assert read_index(index).num_rows == 40


def test_bytes_per_shard_cuts_shards_by_raw_size(tmp_path: Path) -> None:
    samples = [np.zeros(1000, np.uint8) for _ in range(25)]
    index = write_shards(samples, tmp_path / "ds", bytes_per_shard=10_000)
    assert [s.rows for s in read_index(index).shards] == [10, 10, 5]
    index = write_shards(samples, tmp_path / "ds2", bytes_per_shard=10_000, rows_per_shard=4)
    assert [s.rows for s in read_index(index).shards] == [4] * 6 + [1]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_same_input_writes_the_same_bytes(tmp_path: Path, compression: str | None) -> None:
    samples = mixed_samples(40)
    a = write_shards(samples, tmp_path / "a", rows_per_shard=16, compression=compression)
    b = write_shards(samples, tmp_path / "b", rows_per_shard=16, compression=compression)
    files = sorted(p.name for p in a.parent.iterdir())
    assert files == sorted(p.name for p in b.parent.iterdir())
    for name in files:
        assert (a.parent / name).read_bytes() == (b.parent / name).read_bytes()


@NEEDS_ZSTD
@pytest.mark.slow
def test_num_workers_do_not_change_the_bytes(tmp_path: Path) -> None:
    samples = mixed_samples(90)
    kw: dict[str, Any] = {"rows_per_shard": 16, "compression": "zstd"}
    one = write_shards(samples, tmp_path / "one", num_workers=1, **kw)
    two = write_shards(samples, tmp_path / "two", num_workers=2, **kw)
    files = sorted(p.name for p in one.parent.iterdir())
    assert len(files) == 7 and files == sorted(p.name for p in two.parent.iterdir())
    for name in files:
        assert (one.parent / name).read_bytes() == (two.parent / name).read_bytes()


def failing(n: int) -> Any:
    yield from mixed_samples(n)
    raise RuntimeError("source died")


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_failed_write_leaves_no_index_and_no_temp_files(tmp_path: Path, workers: int) -> None:
    with pytest.raises(RuntimeError, match="source died"):
        write_shards(failing(70), tmp_path / "ds", rows_per_shard=8, num_workers=workers)
    assert list(tmp_path.iterdir()) == []
    bad = [*mixed_samples(20), {**mixed_samples(1)[0], "y": 1.5}]
    with pytest.raises(TypeError, match=r"row 20 field 'y' is float float64.*row 0 had int"):
        write_shards(bad, tmp_path / "ds", rows_per_shard=8, num_workers=workers)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([1, 2], "field 'v': builtins.list is not supported"),
        (None, "field 'v': builtins.NoneType is not supported"),
        ({"a": 1}, "field 'v': builtins.dict is not supported"),
        (np.array(["a"]), "field 'v': dtype <U1 is not numeric"),
        (np.array([object()]), "field 'v': dtype object is not numeric"),
    ],
)
def test_unsupported_types_are_refused_by_name(tmp_path: Path, value: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        write_shards([{"v": value}], tmp_path / "ds", rows_per_shard=1)
    assert list(tmp_path.iterdir()) == []


def test_fields_must_match_the_first_sample(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"row 1 has fields \['a', 'b'\], but row 0 had \['a'\]"):
        write_shards([{"a": 1}, {"a": 1, "b": 2}], tmp_path / "ds", rows_per_shard=2)
    with pytest.raises(TypeError, match="row 1 field 'a' is ndarray int32 of 2 dims"):
        write_shards(
            [{"a": np.zeros(3, np.int32)}, {"a": np.zeros((1, 3), np.int32)}],
            tmp_path / "ds",
            rows_per_shard=2,
        )
    with pytest.raises(ValueError, match="no samples to write"):
        write_shards([], tmp_path / "ds")


def test_existing_output_is_refused_unless_overwriting_a_dataset(tmp_path: Path) -> None:
    write_shards(range(10), tmp_path / "ds", rows_per_shard=4)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        write_shards(range(5), tmp_path / "ds", rows_per_shard=4)
    index = write_shards(range(5), tmp_path / "ds", rows_per_shard=4, overwrite=True)
    assert read_all(ShardFormatReader.from_index(index)) == list(range(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        write_shards(range(5), tmp_path / "other", rows_per_shard=4, overwrite=True)


def test_overwrite_replaces_only_the_old_datasets_files(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    old = read_index(write_shards(range(10), ds, rows_per_shard=4)).files
    (ds / "notes.txt").write_text("keep")
    (ds / "sub").mkdir()
    (ds / "sub" / "more.jsonl").write_text("{}")
    index = write_shards(range(5), ds, rows_per_shard=4, overwrite=True)
    assert read_all(ShardFormatReader.from_index(index)) == list(range(5))
    new = read_index(index).files
    assert not set(new) & set(old)  # new names: the old dataset stayed whole until the swap
    assert sorted(p.name for p in ds.iterdir()) == sorted(["index.json", "notes.txt", "sub", *new])
    assert (ds / "notes.txt").read_text() == "keep" and (ds / "sub" / "more.jsonl").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_overwrite_never_clobbers_a_file_and_a_failed_rewrite_keeps_the_old_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = tmp_path / "ds"
    write_shards(range(10), ds, rows_per_shard=4)
    before = {p.name: p.read_bytes() for p in ds.iterdir()}
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0))  # the new shards' names
    (ds / "shard-00000000-00000.mfs").write_text("not a shard of ds")
    with pytest.raises(FileExistsError, match=r"shard-00000000-00000.mfs exists and is no file"):
        write_shards(range(5), ds, rows_per_shard=4, overwrite=True)
    assert (ds / "shard-00000000-00000.mfs").read_text() == "not a shard of ds"
    (ds / "shard-00000000-00000.mfs").unlink()
    assert {p.name: p.read_bytes() for p in ds.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]

    def bad() -> Any:
        yield from range(5)
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_shards(bad(), ds, rows_per_shard=2, overwrite=True)
    assert {p.name: p.read_bytes() for p in ds.iterdir()} == before
    (ds / "index.json").write_text("{not json")
    with pytest.raises(SourceError, match="remove the old dataset yourself"):
        write_shards(range(5), ds, rows_per_shard=4, overwrite=True)
    assert sorted(p.name for p in ds.iterdir()) == sorted(before)


@NEEDS_ZSTD
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_compressed_and_uncompressed_hold_the_same_samples(
    tmp_path: Path, compression: str | None
) -> None:
    rng = np.random.default_rng(0)
    samples = [{"t": rng.integers(0, 1000, 500).astype(np.int32), "n": i} for i in range(200)]
    plain = write_shards(samples, tmp_path / "plain", rows_per_shard=64)
    packed = write_shards(samples, tmp_path / "packed", rows_per_shard=64, compression="zstd")
    a, b = ShardFormatReader.from_index(plain), ShardFormatReader.from_index(packed)
    rows = rng.integers(0, 64, 100)
    for pa, pb in zip(a.shards, b.shards, strict=True):
        for x, y in zip(
            a.take(pa, rows % a.count(pa)), b.take(pb, rows % b.count(pb)), strict=True
        ):
            assert_same(x, y)
    size = {
        name: sum(s.bytes for s in read_index(i).shards)
        for name, i in (("a", plain), ("b", packed))
    }
    assert size["b"] < 0.75 * size["a"]


@NEEDS_ZSTD
def test_reader_pickles_without_its_maps_and_reopens(tmp_path: Path) -> None:
    index = write_shards(mixed_samples(30), tmp_path / "ds", rows_per_shard=10, compression="zstd")
    reader = ShardFormatReader.from_index(index)
    before = reader.take(reader.shards[2], np.array([3, 1]))
    blob = pickle.dumps(reader)
    assert len(blob) < 20_000
    clone = pickle.loads(blob)
    assert not clone._open and not clone._blocks
    for a, b in zip(before, clone.take(clone.shards[2], np.array([3, 1])), strict=True):
        assert_same(a, b)


@NEEDS_ZSTD
def test_decoded_blocks_stay_within_cache_bytes(tmp_path: Path) -> None:
    samples = [np.full(1024, i, np.int64) for i in range(64)]  # 8 KiB rows
    index = write_shards(
        samples, tmp_path / "ds", rows_per_shard=64, block_rows=2, compression="zstd"
    )
    reader = ShardFormatReader.from_index(index, cache_bytes=40_000)
    got = reader.take(reader.shards[0], np.arange(64)[::-1])
    assert [int(g[0]) for g in got] == list(range(63, -1, -1))
    assert 0 < reader._blocks.held <= 40_000 and len(reader._blocks) == 2


# --- damaged files ------------------------------------------------------------------------


def dataset(tmp_path: Path, compression: str | None = None) -> tuple[Path, Path]:
    index = write_shards(
        mixed_samples(30), tmp_path / "ds", rows_per_shard=15, block_rows=5, compression=compression
    )
    return index, tmp_path / "ds" / "shard-00001.mfs"


def test_a_truncated_shard_is_refused_by_name(tmp_path: Path) -> None:
    index, shard = dataset(tmp_path)
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(SourceError, match=r"shard .*shard-00001.mfs has \d+ bytes but its index"):
        read_index(index)
    with pytest.raises(SourceError, match="shard-00001.mfs has"):
        ShardFormatReader().take(shard, np.array([0]))
    shard.unlink()
    with pytest.raises(SourceError, match="shard-00001.mfs is missing"):
        read_index(index)


def test_wrong_magic_is_refused_by_name(tmp_path: Path) -> None:
    index, shard = dataset(tmp_path)
    raw = bytearray(shard.read_bytes())
    raw[:8] = b"PAR1\x00\x00\x00\x00"
    rewrite_keeping_mtime(shard, bytes(raw))
    reader = ShardFormatReader.from_index(index)  # same size: only the open sees it
    with pytest.raises(SourceError, match=r"shard-00001.mfs is damaged: wrong magic"):
        reader.take(shard, np.array([0]))
    reader.take(reader.shards[0], np.array([0]))  # the other shard still reads


def flip(path: Path, offset: int) -> None:
    """Damage one byte in place, keeping the mtime (bit rot, not a rewrite: the structural
    checks are what see it, not the hash of a shard newer than its index)."""
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    rewrite_keeping_mtime(path, bytes(raw))


def rewrite_keeping_mtime(path: Path, data: bytes) -> None:
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@NEEDS_ZSTD
def test_a_damaged_compressed_block_is_refused_by_name(tmp_path: Path) -> None:
    index, shard = dataset(tmp_path, "zstd")
    entry = read_index(index).shards[1]
    off, stored, _ = entry.layout["columns"][0]["segments"]["data"][1]  # tok, block 1
    flip(shard, entry.payload + off + stored // 2)
    reader = ShardFormatReader.from_index(index)
    reader.take(shard, np.array([0, 14]))  # blocks 0 and 2 are intact
    with pytest.raises(SourceError, match=r"shard-00001.mfs is damaged: block 1 of 'data'"):
        reader.take(shard, np.array([6]))


def test_damaged_offsets_are_refused_not_read_as_garbage(tmp_path: Path) -> None:
    index, shard = dataset(tmp_path)
    entry = read_index(index).shards[1]
    off = entry.layout["columns"][0]["segments"]["offsets"][0][0]
    flip(shard, entry.payload + off + 8 * 3 + 7)  # the high byte of offsets[3]
    with pytest.raises(SourceError, match=r"shard-00001.mfs is damaged: column 'tok' offsets"):
        ShardFormatReader.from_index(index).take(shard, np.array([0]))


def test_a_header_that_disagrees_with_the_index_is_refused(tmp_path: Path) -> None:
    index, shard = dataset(tmp_path)
    raw = bytearray(shard.read_bytes())
    _, _, size = PREAMBLE.unpack_from(raw, 0)
    header = raw[PREAMBLE.size : PREAMBLE.size + size]
    raw[PREAMBLE.size : PREAMBLE.size + size] = header.replace(b'"rows":15', b'"rows":16')
    rewrite_keeping_mtime(shard, bytes(raw))
    with pytest.raises(SourceError, match="shard-00001.mfs is damaged: its header disagrees"):
        ShardFormatReader.from_index(index).take(shard, np.array([0]))


def test_verify_hashes_each_shard_on_first_open(tmp_path: Path) -> None:
    index, shard = dataset(tmp_path)
    entry = read_index(index).shards[1]
    off = entry.layout["columns"][1]["segments"]["data"][0][0]  # img, a fixed float column
    flip(shard, entry.payload + off + 1)  # keeps the mtime: bit rot, not a rewrite
    ShardFormatReader.from_index(index).take(shard, np.array([0]))  # sizes only: unseen
    with pytest.raises(SourceError, match="shard-00001.mfs has content hash"):
        ShardFormatReader.from_index(index, verify=True).take(shard, np.array([0]))
    with pytest.raises(SourceError, match="shard-00001.mfs has content hash"):
        read_index(index, verify=True)


def test_a_bad_index_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="index.json does not exist"):
        read_index(tmp_path)
    index, _ = dataset(tmp_path)
    raw = json.loads(index.read_text())
    index.write_text(json.dumps({**raw, "version": 99}))
    with pytest.raises(SourceError, match="version 99; this meshfeed reads versions 1 and 2"):
        read_index(index)
    index.write_text(
        json.dumps(
            {**raw, "shards": {**raw["shards"], "file": ["../x", *raw["shards"]["file"][1:]]}}
        )
    )
    with pytest.raises(SourceError, match="must be a plain name"):
        read_index(index)
    index.write_text("{not json")
    with pytest.raises(SourceError, match="not a readable meshfeed shard index"):
        read_index(index)


@NEEDS_ZSTD
def test_zstd_levels_read_the_same_and_bad_ones_are_refused(tmp_path: Path) -> None:
    samples = [f"line {n} " * 50 for n in range(100)]
    fast = write_shards(samples, tmp_path / "fast", rows_per_shard=100, compression="zstd")
    slow = write_shards(samples, tmp_path / "slow", rows_per_shard=100, compression="zstd:19")
    assert read_index(fast).compression == read_index(slow).compression == "zstd"
    assert fast.parent.joinpath("shard-00000.mfs").read_bytes() != (
        slow.parent.joinpath("shard-00000.mfs").read_bytes()
    )
    assert read_all(ShardFormatReader.from_index(slow)) == samples
    assert read_all(ShardFormatReader.from_index(fast)) == samples
    for bad in ("zstd:0", "zstd:x", "lz4"):
        with pytest.raises(ValueError, match="compression must be None, 'zstd'"):
            write_shards(samples, tmp_path / "bad", compression=bad)


@NEEDS_ZSTD
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_decode_threads_give_the_same_rows(tmp_path: Path, threads: int) -> None:
    samples = mixed_samples(80, seed=3)
    index = write_shards(
        samples, tmp_path / "ds", rows_per_shard=80, block_rows=3, compression="zstd"
    )
    reader = ShardFormatReader(threads=threads)
    rows = np.random.default_rng(threads).integers(0, 80, 60)
    for r, got in zip(
        rows.tolist(), reader.take(index.parent / "shard-00000.mfs", rows), strict=True
    ):
        assert_same(samples[r], got)
    assert (reader._blocks._threads is None) == (threads == 1)


def _take_in_worker(args: tuple[ShardFormatReader, str, list[int]]) -> list[int]:
    reader, shard, rows = args
    return [int(s["y"]) for s in reader.take(shard, np.asarray(rows))]


@NEEDS_ZSTD
@pytest.mark.slow
def test_a_pickled_reader_reads_in_another_process(tmp_path: Path) -> None:
    import multiprocessing as mp

    index = write_shards(mixed_samples(40), tmp_path / "ds", rows_per_shard=20, compression="zstd")
    reader = ShardFormatReader.from_index(index)
    reader.take(reader.shards[1], np.array([0]))  # open maps and threads stay in this process
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.map(_take_in_worker, [(reader, reader.shards[1], [19, 0, 5, 5])])
    assert got == [[(i + 20) * 7 - 50 for i in (19, 0, 5, 5)]]


def test_a_reader_from_an_index_touches_only_the_shards_it_reads(tmp_path: Path) -> None:
    """#32: opening 10,000 shards cost a stat per shard and a scan of the index per shard; a
    rank now touches the files it reads, and a changed one is refused by name when read."""
    write_shards(({"x": np.int64(i)} for i in range(40)), tmp_path / "d", rows_per_shard=10)
    (tmp_path / "d" / "shard-00002.mfs").unlink()  # not read below: not looked at
    shard = tmp_path / "d" / "shard-00001.mfs"
    shard.write_bytes(shard.read_bytes()[:-10])
    reader = ShardFormatReader.from_index(tmp_path / "d")
    assert [reader.count(s) for s in reader.shards] == [10, 10, 10, 10]
    assert [int(r["x"]) for r in reader.take(reader.shards[3], np.array([0, 9]))] == [30, 39]
    with pytest.raises(SourceError, match=r"shard-00001.mfs has \d+ bytes but its index"):
        reader.take(reader.shards[1], np.array([0]))
    with pytest.raises(SourceError, match="shard-00002.mfs is missing"):
        reader.take(reader.shards[2], np.array([0]))


def test_a_shard_changed_after_its_index_is_hashed_on_open_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard rewritten in place (same size) after write_shards wrote the index is newer
    than index.json: it is hashed when opened, without verify=True, and refused by name;
    untouched shards are not hashed."""
    from meshfeed.sources.shards import format as shards_format

    write_shards(({"x": np.int64(i)} for i in range(40)), tmp_path / "d", rows_per_shard=10)
    written = (tmp_path / "d" / "index.json").stat().st_mtime_ns
    for f in (tmp_path / "d").glob("shard-*.mfs"):
        os.utime(f, ns=(written, written))  # as write_shards leaves them: not newer
    hashed: list[str] = []
    real = shards_format.file_hash
    monkeypatch.setattr(shards_format, "file_hash", lambda p: hashed.append(str(p)) or real(p))
    reader = ShardFormatReader.from_index(tmp_path / "d")
    assert [int(r["x"]) for r in reader.take(reader.shards[0], np.array([0, 9]))] == [0, 9]
    assert hashed == []  # nothing suspect: no read of a whole file
    shard = tmp_path / "d" / "shard-00003.mfs"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # same size: only the hash tells
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(written + 10**9, written + 10**9))
    with pytest.raises(SourceError, match="shard-00003.mfs has content hash"):
        ShardFormatReader.from_index(tmp_path / "d").take(shard, np.array([0]))
    assert hashed == [str(shard)]


@NEEDS_ZSTD
def test_a_forked_worker_decodes_compressed_shards_after_its_parent_did(tmp_path: Path) -> None:
    """The parent decoded through its decode threads (now idle) before the fork: the child
    inherits the pool without its threads and must not wait on them (it hung before)."""
    import time

    write_shards(
        ({"x": np.full(64, i, np.int64)} for i in range(2000)),
        tmp_path, rows_per_shard=1000, compression="zstd", block_rows=50,
    )  # fmt: skip
    reader = ShardFormatReader.from_index(tmp_path)
    first, second = reader.shards
    rows = list(range(0, 1000, 7))  # 20 blocks: decoded side by side
    assert len(reader.take(first, rows)) == len(rows)
    time.sleep(0.2)  # the decode threads go idle
    pid = os.fork()
    if pid == 0:  # the child: read, and say how it went by the exit code
        try:
            got = reader.take(second, rows)
            os._exit(0 if [int(r["x"][0]) for r in got] == [1000 + r for r in rows] else 3)
        except BaseException:
            os._exit(4)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child never finished decoding (it waited on threads it lacks)")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0
