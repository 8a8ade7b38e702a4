"""Text and JSON-lines shards with CRLF line endings read the same rows by every path.

A row of a text shard is its line less the terminator, ``"\\n"`` or ``"\\r\\n"``; a lone
``"\\r"`` ends no line and stays in the row. Reading by index (``take``, what a
:class:`~meshfeed.sources.ShardedStream` does) once kept the ``"\\r"`` of every CRLF line,
while the range form (``default_reader(path, start, stop)``) dropped it and, reading with
universal newlines, also ended a line at a lone ``"\\r"``, so its rows no longer lined up with
the row count.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from meshfeed.sources import ShardedStream
from meshfeed.sources.streams import readers
from meshfeed.sources.streams.readers import DefaultReader, default_reader

SPANS = pytest.mark.parametrize("span_bytes", [1 << 20, 8], ids=["one span", "runs"])


def _line_starts(data: bytes) -> list[int]:
    """Where each "\\n"-ended line of ``data`` starts, then its size."""
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    return [s for s in starts if s < len(data)] + [len(data)]


def _every_path(path, expected: list) -> None:
    """Every way to read ``path`` gives ``expected``: count, offsets, take (in order, shuffled,
    repeated), the range form (whole and in slices) and a stream over it."""
    n = len(expected)
    reader = DefaultReader()
    assert reader.count(path) == n
    assert reader.take(path, np.arange(n)) == expected
    order = np.array([*random.Random(0).sample(range(n), n), n - 1, 0, n - 1])
    assert reader.take(path, order) == [expected[i] for i in order.tolist()]
    assert list(default_reader(path, 0, None)) == expected
    for a in range(n):
        assert list(default_reader(path, a, a + 2)) == expected[a : a + 2]
        assert DefaultReader().take(path, np.array([a])) == [expected[a]]
    stream = ShardedStream([path])
    assert len(stream) == n and stream.rows == [n]
    assert [stream[i] for i in range(n)] == expected
    assert stream.__getitems__(order.tolist()) == [expected[i] for i in order.tolist()]


@SPANS
@pytest.mark.parametrize("final", ["\r\n", "", "\n"], ids=["crlf end", "no end", "lf end"])
def test_a_crlf_text_shard_reads_the_same_rows_by_index_and_by_range(
    tmp_path, monkeypatch, span_bytes, final
):
    monkeypatch.setattr(readers, "_SPAN_BYTES", span_bytes)  # "runs": a read per run of rows
    path = tmp_path / "rows.txt"
    path.write_bytes(f"alpha\r\nbeta\r\n\r\ngam\rma\r\nlf only\ndelta{final}".encode())
    expected = ["alpha", "beta", "", "gam\rma", "lf only", "delta"]
    _every_path(path, expected)
    starts = _line_starts(path.read_bytes())
    assert DefaultReader()._line_offsets(str(path))[1].tolist() == starts


@SPANS
def test_a_lone_cr_ends_no_row_and_stays_in_it(tmp_path, monkeypatch, span_bytes):
    monkeypatch.setattr(readers, "_SPAN_BYTES", span_bytes)
    path = tmp_path / "cr.txt"
    # a lone "\r" inside a line, "\r\r\n" (a "\r" before the terminator), "\r" at the end
    path.write_bytes(b"a\rb\r\nc\r\r\n\rd\nlast\r")
    _every_path(path, ["a\rb", "c\r", "\rd", "last\r"])


@SPANS
def test_mixed_endings_agree_by_every_path_whatever_the_lines(tmp_path, monkeypatch, span_bytes):
    monkeypatch.setattr(readers, "_SPAN_BYTES", span_bytes)
    rng = random.Random(7)
    pieces = ["x", "\r", "é", " ", "\t", "yz"]
    for case in range(20):
        rows = [
            "".join(rng.choices(pieces, k=rng.randrange(6))) for _ in range(rng.randrange(1, 9))
        ]
        ends = [rng.choice(["\n", "\r\n"]) for _ in rows]
        ends[-1] = rng.choice(["\n", "\r\n", ""])
        # a row's own last "\r" before a bare "\n" would read as a CRLF terminator
        ends = [
            "\r\n" if r.endswith("\r") and e == "\n" else e for r, e in zip(rows, ends, strict=True)
        ]
        if ends[-1] == "" and rows[-1] == "":
            rows[-1] = "z"  # an empty last line without a terminator is no line
        path = tmp_path / f"mixed{case}.txt"
        path.write_bytes("".join(r + e for r, e in zip(rows, ends, strict=True)).encode())
        _every_path(path, rows)


@SPANS
@pytest.mark.parametrize("final", ["\r\n", ""], ids=["crlf end", "no end"])
def test_a_crlf_jsonl_shard_parses_the_same_by_every_path(tmp_path, monkeypatch, span_bytes, final):
    monkeypatch.setattr(readers, "_SPAN_BYTES", span_bytes)
    records = [{"id": 0, "s": "a\rb"}, {"id": 1, "s": "c\r\n"}, {"id": 2}, {"id": 3, "s": ""}]
    lines = [json.dumps(r) for r in records]
    path = tmp_path / "rows.jsonl"
    # blank CRLF lines (no rows) before, between and after the records
    text = f"\r\n{lines[0]}\r\n\r\n  \r\n{lines[1]}\r\n{lines[2]}\n{lines[3]}"
    path.write_bytes((text + final).encode())
    _every_path(path, records)


BOM = b"\xef\xbb\xbf"


@SPANS
@pytest.mark.parametrize(
    ("name", "data", "expected"),
    [
        ("rows.txt", BOM + b"alpha\r\nbeta\n", ["alpha", "beta"]),
        ("rows.jsonl", BOM + b'{"t": "hi"}\n{"t": "yo"}\n', [{"t": "hi"}, {"t": "yo"}]),
        ("blank.jsonl", BOM + b'\n{"t": 1}\n', [{"t": 1}]),  # a BOM alone is a blank line
        ("blank.txt", BOM + b"\nx", ["", "x"]),
        ("only.txt", BOM, []),
    ],
)
def test_a_byte_order_mark_is_no_part_of_the_first_row(
    tmp_path, monkeypatch, span_bytes, name, data, expected
):
    """A file saved with a UTF-8 BOM: the text path kept "\\ufeff" in row 0 (a silent stray
    token), and reading a JSON-lines row by index failed where the range form parsed it."""
    monkeypatch.setattr(readers, "_SPAN_BYTES", span_bytes)
    path = tmp_path / name
    path.write_bytes(data)
    if expected:
        _every_path(path, expected)
    else:
        assert DefaultReader().count(path) == 0 and list(default_reader(path, 0, None)) == []
