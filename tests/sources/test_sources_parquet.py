"""ParquetSource / ArrowSource: random access by global row over Parquet files and Arrow tables."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from meshfeed.loader import DataLoader  # noqa: E402
from meshfeed.sources.parquet import ArrowSource, ParquetSource  # noqa: E402
from meshfeed.testing import assert_resume_equivalence  # noqa: E402
from tests.optional import given, settings, st  # noqa: E402


def write_files(tmp: Path, rows_per_file: list[int], row_group_size: int = 4) -> list[Path]:
    paths, start = [], 0
    for k, n in enumerate(rows_per_file):
        ids = list(range(start, start + n))
        table = pa.table(
            {"id": ids, "text": [f"row {i}" for i in ids], "x": [i * 0.5 for i in ids]}
        )
        path = tmp / f"part-{k:02d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
        start += n
    return paths


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(st.integers(1, 15), min_size=1, max_size=4),
    group=st.integers(1, 6),
    data=st.data(),
)
def test_global_row_i_is_the_ith_row_across_files_and_row_groups(
    tmp_path_factory: pytest.TempPathFactory, rows: list[int], group: int, data: Any
) -> None:
    paths = write_files(tmp_path_factory.mktemp("p"), rows, group)
    src = ParquetSource(paths)
    assert len(src) == sum(rows)
    idx = data.draw(st.lists(st.integers(0, len(src) - 1), max_size=20))
    assert [r["id"] for r in src.__getitems__(idx)] == idx
    assert [src[i]["id"] for i in idx] == idx


def test_a_directory_expands_to_its_sorted_parquet_files(tmp_path: Path) -> None:
    write_files(tmp_path, [5, 5, 5])
    src = ParquetSource(tmp_path)
    assert [src[i]["id"] for i in range(15)] == list(range(15))
    assert src[-1] == {"id": 14, "text": "row 14", "x": 7.0}


def test_columns_select_what_rows_hold(tmp_path: Path) -> None:
    write_files(tmp_path, [6])
    src = ParquetSource(tmp_path, columns=["text"])
    assert src.__getitems__([2]) == [{"text": "row 2"}]
    with pytest.raises(ValueError, match=r"columns \['nope'\] are not in"):
        ParquetSource(tmp_path, columns=["nope"])


def test_columns_are_checked_against_every_file_not_just_the_first(tmp_path: Path) -> None:
    first, second, third = write_files(tmp_path, [4, 4, 4])
    pq.write_table(pa.table({"id": [8, 9], "x": [4.0, 4.5]}), second)  # no "text"
    with pytest.raises(ValueError, match=r"columns \['text'\] are not in .*part-01\.parquet"):
        ParquetSource([first, second, third], columns=["id", "text"])
    assert len(ParquetSource([first, second, third], columns=["id", "x"])) == 10


def test_each_needed_row_group_is_read_once_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_files(tmp_path, [40], row_group_size=10)
    reads: list[int] = []
    original = pq.ParquetFile.read_row_group

    def counting(self: Any, i: int, *args: Any, **kwargs: Any) -> Any:
        reads.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    src = ParquetSource(tmp_path, cache_row_groups=2)
    rows = src.__getitems__([35, 1, 31, 2, 38, 0])
    assert [r["id"] for r in rows] == [35, 1, 31, 2, 38, 0]
    assert sorted(reads) == [0, 3]
    src.__getitems__([3, 33])  # both cached
    assert sorted(reads) == [0, 3]
    src[3]  # group 0 becomes the most recently used
    src.__getitems__([15])  # so group 3 is evicted
    src.__getitems__([35])
    assert len(src._cache) == 2
    assert reads == [0, 3, 1, 3]


def test_cache_is_bounded_by_cache_row_groups(tmp_path: Path) -> None:
    write_files(tmp_path, [100], row_group_size=5)
    src = ParquetSource(tmp_path, cache_row_groups=3)
    src.__getitems__(list(range(0, 100, 5)))
    assert len(src._cache) == 3
    with pytest.raises(ValueError, match="cache_row_groups must be a positive int"):
        ParquetSource(tmp_path, cache_row_groups=0)


def test_pickles_without_handles_or_cache(tmp_path: Path) -> None:
    write_files(tmp_path, [50], row_group_size=50)
    src = ParquetSource(tmp_path)
    src.__getitems__([1, 2])
    again = pickle.loads(pickle.dumps(src))
    assert again._cache == {} and again._handles == {}
    assert again[7] == src[7]


def test_fingerprint_is_stable_and_content_sensitive(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_files(tmp_path / "a", [10])
    write_files(tmp_path / "b", [11])
    fp = ParquetSource(tmp_path / "a").fingerprint
    assert fp == ParquetSource(tmp_path / "a").fingerprint
    assert fp != ParquetSource(tmp_path / "b").fingerprint


def test_bad_paths_and_indices_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ParquetSource(tmp_path / "missing.parquet")
    with pytest.raises(FileNotFoundError, match=r"holds no \*\.parquet"):
        ParquetSource(tmp_path)
    write_files(tmp_path, [4])
    src = ParquetSource(tmp_path)
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        src.__getitems__([0, 4])
    with pytest.raises(IndexError, match="out of range"):
        src[4]


def test_loader_batches_parquet_rows_and_resumes_exactly(tmp_path: Path) -> None:
    write_files(tmp_path, [7, 6], row_group_size=3)

    def collate(rows: list[dict[str, Any]]) -> list[int]:
        return [r["id"] for r in rows]

    ref = assert_resume_equivalence(
        lambda: DataLoader(ParquetSource(tmp_path), batch_size=4, seed=1, collate_fn=collate),
        num_items=9,
    )
    assert sorted(sum(ref[:3], [])) == sorted(set(sum(ref[:3], [])))


def test_arrow_source_reads_tables_and_memory_mapped_ipc_files(tmp_path: Path) -> None:
    table = pa.table({"id": np.arange(20), "y": [str(i) for i in range(20)]})
    src = ArrowSource(table)
    assert [r["id"] for r in src.__getitems__([19, 0, 7])] == [19, 0, 7]
    assert src[-1] == {"id": 19, "y": "19"}
    path = tmp_path / "t.arrow"
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    mapped = ArrowSource(path, columns=["y"])
    assert mapped.__getitems__([3]) == [{"y": "3"}]
    blob = pickle.dumps(mapped)
    assert len(blob) < 1_000, "a mapped file pickles as its path"
    assert pickle.loads(blob)[4] == {"y": "4"}
    assert src.fingerprint == ArrowSource(table).fingerprint
    with pytest.raises(TypeError, match="pyarrow.Table or an Arrow IPC file path"):
        ArrowSource({"id": [1]})


# ----------------------------------------------------------------- damaged files (issue 11.3)
from meshfeed.errors import SourceError  # noqa: E402


def _damaged_copy(tmp: Path, *, checksums: bool, at: str) -> Path:
    table = pa.table({"id": list(range(64)), "text": [f"row {i}" for i in range(64)]})
    good = tmp / "good.parquet"
    pq.write_table(
        table,
        good,
        row_group_size=16,
        compression="none",
        use_dictionary=False,
        write_page_checksum=checksums,
    )
    raw = bytearray(good.read_bytes())
    chunk = pq.ParquetFile(good).metadata.row_group(1).column(1)
    if at == "page header":
        start = chunk.data_page_offset
        raw[start : start + 6] = b"\xff" * 6
    elif at == "page data":
        raw[chunk.data_page_offset + chunk.total_compressed_size - 3] ^= 0x01
    else:  # the footer's thrift metadata, just before its length and the closing magic
        footer = int.from_bytes(raw[-8:-4], "little")
        mid = len(raw) - 8 - footer // 2
        raw[mid - 8 : mid + 8] = b"\xff" * 16
    bad = tmp / "bad.parquet"
    bad.write_bytes(bytes(raw))
    return bad


@pytest.mark.parametrize(("checksums", "at"), [(False, "page header"), (True, "page data")])
def test_damaged_row_group_raises_naming_file_and_row_group(
    tmp_path: Path, checksums: bool, at: str
) -> None:
    source = ParquetSource(_damaged_copy(tmp_path, checksums=checksums, at=at))
    assert source[0] == {"id": 0, "text": "row 0"}  # row group 0 is intact
    with pytest.raises(
        SourceError, match=r"cannot read row group 1 of .*bad\.parquet \(rows 16\.\.31\)"
    ):
        source.__getitems__([3, 20])


def test_damaged_footer_raises_naming_the_file(tmp_path: Path) -> None:
    bad = _damaged_copy(tmp_path, checksums=False, at="footer")
    with pytest.raises(SourceError, match=r"cannot open the Parquet file .*bad\.parquet"):
        ParquetSource(bad)


def test_files_with_different_columns_are_refused_on_open(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [3], "label": [1]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet has columns \{id: int64, label: int64\}"):
        ParquetSource(tmp_path)
    assert len(ParquetSource(tmp_path, columns=["id"])) == 3


def test_files_whose_column_types_differ_are_refused_when_the_source_is_made(tmp_path):
    # Only the column names were compared: label was int64 in one file and string in the
    # next, and batches changed type mid-epoch (a tensor, then a list).
    pq.write_table(pa.table({"label": pa.array([1, 2], pa.int64())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"label": pa.array(["x", "y"])}), tmp_path / "b.parquet")
    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    for columns in (None, ["label"]):
        with pytest.raises(ValueError, match=r"'label': string here, int64 in .*a\.parquet"):
            ParquetSource(paths, columns=columns)
    # string and large_string read alike: accepted
    pq.write_table(pa.table({"label": pa.array(["z"], pa.large_string())}), tmp_path / "c.parquet")
    source = ParquetSource([tmp_path / "b.parquet", tmp_path / "c.parquet"])
    assert [source[i]["label"] for i in range(3)] == ["x", "y", "z"]
