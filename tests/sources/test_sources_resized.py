"""A corpus file that changes size while open is a SourceError naming the file, never SIGBUS.

Truncating a mapped file and then reading past its new end kills the process with SIGBUS, so
each truncation runs in a fresh interpreter: a missing check fails the test with exit code -7
instead of killing pytest.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows
from tests.process_checks import run_python

_SETUP = """
import os, sys, time
import numpy as np
from meshfeed import DataLoader
from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows

def corpus(name):
    return write_indexed(name, [list(range(i, i + 3000)) for i in range(64)], "int32")

def expect(what, fn, path):
    try:
        fn()
    except SourceError as exc:
        assert str(path) in str(exc) and "changed size while open" in str(exc), exc
        print(what, "ok")
        return
    raise SystemExit(f"{what}: no SourceError")
"""


def _run(tmp_path: Path, body: str) -> str:
    script = tmp_path / "resize.py"
    script.write_text(_SETUP + textwrap.dedent(body))
    done = run_python(script, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    return done.stdout


def test_every_reader_raises_source_error_naming_a_truncated_file(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        idx = np.array([0, 5, 9])
        for what, ext, make, read in [
            ("windows.fetch_batch", ".bin", lambda c: TokenWindows(c, seq_len=128),
             lambda r: r.fetch_batch(idx)),
            ("windows[i]", ".bin", lambda c: TokenWindows(c, seq_len=128), lambda r: r[1000]),
            ("windows pinned", ".bin",
             lambda c: TokenWindows(c, seq_len=128, dtype=__import__("torch").int32,
                                    pin_memory=True), lambda r: r.fetch_batch(idx)),
            ("documents.fetch_batch", ".bin", TokenDocuments, lambda r: r.fetch_batch(idx)),
            ("documents[i]", ".bin", TokenDocuments, lambda r: r[60].sum()),
            ("documents getitems", ".bin", TokenDocuments, lambda r: r.__getitems__([1, 60])),
            ("idx truncated", ".idx", TokenDocuments, lambda r: r.fetch_batch(idx)),
            ("validate", ".bin", lambda c: c, lambda r: r.validate()),
        ]:
            name = what.replace(" ", "_").replace("[i]", "_item")
            reader = make(corpus(name))
            os.truncate(name + ext, 64)
            expect(what, lambda: read(reader), name + ext)
        """,
    )
    assert out.count(" ok") == 8, out


@pytest.mark.slow
def test_a_worker_reading_a_truncated_bin_reports_source_error_to_the_main_process(
    tmp_path: Path,
) -> None:
    out = _run(
        tmp_path,
        """
        windows = TokenWindows(corpus("c"), seq_len=128)
        loader = DataLoader(windows, batch_size=4, shuffle=False, num_workers=1, timeout=60)
        it = iter(loader)
        next(it)
        time.sleep(0.5)  # the worker has filled its prefetch and waits: no read in flight
        os.truncate("c.bin", 4096)
        expect("worker", lambda: [b for b in it], "c.bin")
        """,
    )
    assert "worker ok" in out


def test_a_corpus_replaced_by_rename_keeps_serving_the_open_one(tmp_path: Path) -> None:
    old = write_indexed(tmp_path / "c", [list(range(100))], "int32")
    windows = TokenWindows(old, seq_len=10)
    write_indexed(tmp_path / "c", [list(range(50, 90))], "int32")  # rename: a new inode
    assert windows.fetch_batch(np.array([0])).tolist() == [list(range(11))]


def test_a_file_that_grew_in_place_is_refused(tmp_path: Path) -> None:
    corpus = write_indexed(tmp_path / "c", [list(range(100))], "int32")
    documents = TokenDocuments(corpus)
    with open(tmp_path / "c.bin", "ab") as f:
        f.write(b"\0" * 400)
    with pytest.raises(SourceError, match=r"c\.bin changed size while open \(400 bytes .*, 800"):
        documents.fetch_batch(np.array([0]))


@pytest.mark.slow
def test_a_truncated_arrow_file_is_a_source_error_naming_it(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    out = _run(
        tmp_path,
        """
        import pyarrow as pa
        from meshfeed.sources.parquet import ArrowSource

        table = pa.table({"a": list(range(100_000)), "b": [float(i) for i in range(100_000)]})
        with pa.ipc.new_file("t.arrow", table.schema) as w:
            w.write_table(table)
        source = ArrowSource("t.arrow")
        assert source[5] == {"a": 5, "b": 5.0}
        os.truncate("t.arrow", 1024)
        expect("arrow getitems", lambda: source.__getitems__([99_999, 0]), "t.arrow")
        expect("arrow getitem", lambda: source[99_000], "t.arrow")
        """,
    )
    assert out.split() == ["arrow", "getitems", "ok", "arrow", "getitem", "ok"]
