"""``meshfeed convert --to corpus`` refuses to replace a corpus unless ``--overwrite``, an empty
``-o``, and inputs that hold no record (as ``--to shards`` and ``write_shards`` do)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshfeed.cli import main
from meshfeed.sources import TokenCorpus, write_indexed
from meshfeed.sources.converters.convert import convert


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def test_an_existing_corpus_is_replaced_only_with_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = tmp_path / "corpus"
    write_indexed(prefix, [[1, 2, 3]] * 5)
    src = _jsonl(tmp_path / "d.jsonl", ["hello", "world"])
    argv = ["convert", str(src), "-o", str(prefix), "--tokenizer", "bytes", "-q"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{prefix}.bin exists" in err and "pass --overwrite" in err
    assert "overwrite=True" not in err and err.count("\n") == 1
    assert TokenCorpus(prefix).num_documents == 5  # untouched
    (tmp_path / "corpus.bin").unlink()  # a lone .idx is refused too
    assert main(argv) == 2 and f"{prefix}.idx exists" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert TokenCorpus(prefix).num_documents == 2
    with pytest.raises(FileExistsError, match=r"corpus\.bin exists.*overwrite=True"):
        convert(src, prefix, tokenizer="bytes", progress=False, overwrite=False)


def test_an_empty_output_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _jsonl(tmp_path / "d.jsonl", ["hello"])
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for to in ("corpus", "shards"):
        extra = ["--tokenizer", "bytes"] if to == "corpus" else []
        assert main(["convert", str(src), "-o", "", "--to", to, *extra, "-q"]) == 2
        assert "-o is empty" in capsys.readouterr().err
    for prefix in ("", ".", "out/.bin"):
        with pytest.raises(ValueError, match="names no file"):
            write_indexed(prefix, [[1]])
    assert not list((tmp_path / "cwd").iterdir())


def test_inputs_with_no_records_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["convert", str(empty), "-o", str(tmp_path / "c"), "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err
    assert f"{empty} holds no records" in err and "nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_quiet_before_the_command_and_j0_in_this_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _jsonl(tmp_path / "d.jsonl", ["hello", "world"])
    base = ["convert", str(src), "--tokenizer", "bytes"]
    assert main(["-q", *base, "-o", str(tmp_path / "a")]) == 0  # as `convert ... -q`
    assert main(["--quiet", *base, "-o", str(tmp_path / "b"), "-j", "0"]) == 0  # as analyze -j 0
    assert capsys.readouterr().err == ""  # no progress bar
    assert TokenCorpus(tmp_path / "b").num_documents == 2
    assert main([*base, "-o", str(tmp_path / "c"), "-j", "-1", "-q"]) == 2
    assert "-j must be 0 or more (got -1)" in capsys.readouterr().err
