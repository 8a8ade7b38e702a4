"""meshfeed convert --to shards: JSONL records -> shards, typed by a scan of every record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed.cli import main
from meshfeed.sources import ShardFormatReader, read_index
from meshfeed.sources.converters.shards import convert_to_shards, jsonl_samples
from tests.optional import NEEDS_ZSTD


def read_all(index: Path | str) -> list[Any]:
    reader = ShardFormatReader.from_index(index)
    return [row for path in reader.shards for row in reader(path)]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "compression", [[], pytest.param(["--compression", "zstd"], marks=NEEDS_ZSTD)]
)
def test_convert_jsonl_to_shards(
    tmp_path: Path, compression: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [{"text": "é" * n, "ids": list(range(n)), "score": n / 2} for n in range(1, 6)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    assert main(["convert", str(src), "--to", "shards", "-o", str(out), *compression]) == 0
    out_, err = capsys.readouterr()
    assert "5 samples in 1 shards" in out_ and "pass --rows-per-shard N" in err
    got = read_all(out)
    assert [g["text"] for g in got] == [x["text"] for x in lines]
    assert [g["ids"].tolist() for g in got] == [x["ids"] for x in lines]
    assert got[2]["score"] == 1.5
    assert read_index(out).compression == (compression or [None])[-1]
    write_jsonl(src, [{"a": {"nested": 1}}])
    assert main(["convert", str(src), "--to", "shards", "-o", str(tmp_path / "o2")]) == 2
    assert "in.jsonl:1 field 'a': dict {'nested': 1} is not supported" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([[0, 255], [1]], np.uint16),  # not uint8: torch indexes with a uint8 tensor as a mask
        ([[0, 300], []], np.uint16),
        ([[-1, 2], [30000]], np.int16),
        ([[70_000], [5]], np.int32),
        ([[2**32], [0]], np.int64),
        ([[-(2**40)], [0]], np.int64),
        ([[1, 2], [0.5]], np.float64),
        ([[True], [False, True]], np.bool_),
    ],
)
def test_number_lists_keep_the_narrowest_type_and_their_values(
    tmp_path: Path, values: list[list[Any]], dtype: type
) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"ids": v, "n": i} for i, v in enumerate(values)])
    index = convert_to_shards([src], tmp_path / "out")
    assert read_index(index).fields[0].dtype == np.dtype(dtype).name
    got = read_all(index)
    assert [g["ids"].tolist() for g in got] == values
    assert all(g["ids"].dtype == dtype for g in got)


def test_a_field_of_ints_and_floats_is_stored_as_floats_and_bare_records_work(
    tmp_path: Path,
) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"x": 1, "s": "a"}, {"s": "b", "x": 2.5}])
    got = read_all(convert_to_shards([src], tmp_path / "a"))
    assert [g["x"] for g in got] == [1.0, 2.5] and [g["s"] for g in got] == ["a", "b"]
    bare = write_jsonl(tmp_path / "b.jsonl", [[1, 2], [3]])
    assert [g.tolist() for g in read_all(convert_to_shards([bare], tmp_path / "b"))] == [
        [1, 2],
        [3],
    ]
    assert [s.tolist() for s in jsonl_samples([bare])] == [[1, 2], [3]]


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"a": [1, True]}], r"d\.jsonl:1 field 'a': a list holding bool True"),
        ([{"a": [[1, 2], [3]]}], r"d\.jsonl:1 field 'a': a list holding list"),
        ([{"a": 1}, {"b": 1}], r"d\.jsonl:2 has fields \['b'\], but .*d\.jsonl:1 had \['a'\]"),
        ([{"a": [1]}, {"a": 1}], r"d\.jsonl:2 field 'a': a list where earlier rows"),
        ([{"a": "x"}, {"a": 1}], r"d\.jsonl:2 field 'a': int where earlier rows hold str"),
        ([{"a": None}], r"d\.jsonl:1 field 'a': NoneType None is not supported"),
        ([{"a": [2**64]}], r"d\.jsonl:1 field 'a': an int outside int64"),
        ([[1], {"a": 1}], r"d\.jsonl:2 has fields \['a'\], but .*d\.jsonl:1 had none"),
    ],
)
def test_records_the_shards_cannot_hold_are_refused_by_file_and_line(
    tmp_path: Path, records: list[Any], message: str
) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(ValueError, match=message):
        convert_to_shards([src], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_overwrite_on_the_command_line_keeps_inputs_and_other_files_in_the_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    first = write_jsonl(tmp_path / "first.jsonl", [{"x": 1}, {"x": 2}])
    assert main(["convert", str(first), "--to", "shards", "-o", str(out), "-q"]) == 0
    old = read_index(out).files
    more = write_jsonl(out / "more.jsonl", [{"x": 3}, {"x": 4}])
    (out / "NOTES.txt").write_text("notes")
    argv = ["convert", str(more), "--to", "shards", "-o", str(out), "--overwrite", "-q"]
    assert main(argv) == 0
    index = read_index(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["NOTES.txt", "index.json", "more.jsonl", *index.files]
    )
    assert not set(index.files) & set(old)
    assert more.read_text().count("\n") == 2 and (out / "NOTES.txt").read_text() == "notes"
    capsys.readouterr()
    # an input the rewrite would delete (a file the old index names) is refused by name
    shard = out / index.files[0]
    assert (
        main(["convert", str(more), str(shard), "--to", "shards", "-o", str(out), "--overwrite"])
        == 2
    )
    err = capsys.readouterr().err
    assert f"input {shard} is {index.files[0]} of the shard dataset in {out}" in err
    assert read_index(out, verify=True).files == index.files


def test_shard_size_options_workers_and_overwrite_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"ids": list(range(n % 50))} for n in range(600)])
    base = ["convert", str(src), "--to", "shards", "-q"]
    assert main([*base, "-o", str(tmp_path / "r"), "--rows-per-shard", "100"]) == 0
    assert len(read_index(tmp_path / "r").shards) == 6
    assert main([*base, "-o", str(tmp_path / "b"), "--bytes-per-shard", "4K"]) == 0
    by_bytes = read_index(tmp_path / "b")
    assert len(by_bytes.shards) == 8  # 600 rows of 0..49 two-byte ids: 29,400 raw bytes
    assert main([*base, "-o", str(tmp_path / "j2"), "--bytes-per-shard", "4K", "-j", "2"]) == 0
    for a, b in zip(by_bytes.shards, read_index(tmp_path / "j2").shards, strict=True):
        assert a.hash == b.hash  # the same bytes for any -j
    capsys.readouterr()
    assert main([*base, "-o", str(tmp_path / "r"), "--rows-per-shard", "300"]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite" in err and "overwrite=True" not in err and err.count("\n") == 1
    assert main([*base, "-o", str(tmp_path / "r"), "--rows-per-shard", "300", "--overwrite"]) == 0
    assert len(read_index(tmp_path / "r").shards) == 2
    with pytest.raises(SystemExit) as exit_:
        main([*base, "-o", str(tmp_path / "x"), "--bytes-per-shard", "0"])
    assert exit_.value.code == 2
