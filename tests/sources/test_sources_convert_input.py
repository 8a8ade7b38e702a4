"""The inputs of meshfeed convert: malformed files are one-line errors naming the file (#28.6).

Each case runs the command as a user does (``meshfeed convert``, both ``--to corpus`` and
``--to shards``): exit code 2, one line on stderr naming the file (and the line where known) and
the fix, no traceback, and no output left behind.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from meshfeed.cli import main
from meshfeed.sources.converters.inputs import jsonl_lines, token_ids

RECORDS = b"".join(json.dumps({"text": [1, 2, 3]}).encode() + b"\n" for _ in range(2000))


def _truncated_gz(path: Path) -> None:
    data = gzip.compress(RECORDS)
    path.write_bytes(data[: len(data) // 2])


def _crc_error(path: Path) -> None:
    data = bytearray(gzip.compress(RECORDS))
    data[-6] ^= 0xFF  # the CRC32 in the trailer
    path.write_bytes(bytes(data))


def _deep(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")


MALFORMED: list[tuple[str, Callable[[Path], None], str]] = [
    ("t.jsonl.gz", _truncated_gz, r"t\.jsonl\.gz: the gzip stream is broken after line \d+"),
    ("c.jsonl.gz", _crc_error, r"c\.jsonl\.gz: the gzip stream is broken .*CRC check failed"),
    ("n.jsonl.gz", lambda p: p.write_bytes(RECORDS), r"n\.jsonl\.gz is named \.gz but is not"),
    ("d.jsonl", _deep, r"d\.jsonl:1 nests lists or objects deeper than"),
    ("b.jsonl", lambda p: p.write_text('{"text": [1, true]}\n'), r"b\.jsonl:1.* bool True"),
    ("r.jsonl", lambda p: p.write_text('{"text": [[1, 2], [3]]}\n'), r"r\.jsonl:1.* list \[1, 2\]"),
]


@pytest.mark.parametrize("to", ["corpus", "shards"])
@pytest.mark.parametrize(("name", "make", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_input_is_one_line_naming_the_file_exit_2_and_no_output(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    to: str,
    name: str,
    make: Callable[[Path], None],
    message: str,
) -> None:
    import re

    make(tmp_path / name)
    out = tmp_path / "out" / "o"
    assert main(["convert", str(tmp_path / name), "--to", to, "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshfeed convert: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and re.search(message, err), err
    assert not out.parent.exists() or not any(out.parent.iterdir())  # nothing left behind


def test_a_gzipped_file_is_read_whatever_its_name(tmp_path: Path) -> None:
    (tmp_path / "plain.jsonl").write_bytes(gzip.compress(b'{"a": 1}\n\n[2]\n'))
    lines = [(n, line) for n, line, _ in jsonl_lines(tmp_path / "plain.jsonl")]
    assert lines == [(1, b'{"a": 1}\n'), (2, b"\n"), (3, b"[2]\n")]


def test_token_ids_refuse_what_numpy_would_coerce(tmp_path: Path) -> None:
    assert token_ids([1, 2], "f:1").tolist() == [1, 2] and token_ids([], "f:1").size == 0
    for bad, shown in ([True, 1], "bool True"), ([1.0], "float 1.0"), ([None], "NoneType"):
        with pytest.raises(ValueError, match=f"f:1: a document holds {shown}"):
            token_ids(bad, "f:1")
    with pytest.raises(ValueError, match="outside int64"):
        token_ids([2**70], "f:1")


def _garbage_parquet(path: Path) -> None:
    pytest.importorskip("pyarrow", reason='reading Parquet needs pyarrow: "meshfeed[parquet]"')
    path.write_bytes(b"PAR1 garbage")


def _corrupt_page(path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"text": [[i, i + 1] for i in range(5000)]})
    pq.write_table(table, path, compression="snappy", row_group_size=2500)
    data = bytearray(path.read_bytes())
    for at in range(200, 2000, 7):  # inside the first data page
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


CORPUS_ONLY: list[tuple[str, Callable[[Path], None], str]] = [
    (
        "o.npy",
        lambda p: np.save(p, np.array([[1, 2], [3]], dtype=object), allow_pickle=True),
        r"o\.npy is not a readable \.npy integer array",
    ),
    ("h.npy", lambda p: p.write_bytes(b"\x93NUMPY garbage"), r"h\.npy is not a readable \.npy"),
    (
        "s.npy",
        lambda p: (np.save(p, np.ones((64, 64), np.int32)), p.write_bytes(p.read_bytes()[:300])),
        r"s\.npy is not a readable \.npy",
    ),
    ("f.parquet", _garbage_parquet, r"f\.parquet is not a readable"),
    ("p.parquet", _corrupt_page, r"p\.parquet row 0: a corrupt Parquet page"),
]


@pytest.mark.parametrize(("name", "make", "message"), CORPUS_ONLY, ids=[m[0] for m in CORPUS_ONLY])
def test_malformed_npy_and_parquet_name_the_file(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    make: Callable[[Path], None],
    message: str,
) -> None:
    import re

    make(tmp_path / name)
    out = tmp_path / "out" / "o"
    assert main(["convert", str(tmp_path / name), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_parquet_without_pyarrow_is_one_line_naming_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    (tmp_path / "f.parquet").write_bytes(b"PAR1 garbage")
    out = tmp_path / "out" / "o"
    assert main(["convert", str(tmp_path / "f.parquet"), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "meshfeed convert: error: converting Parquet needs pyarrow: pip install meshfeed[parquet]\n"
    )
    assert not out.parent.exists() or not any(out.parent.iterdir())
