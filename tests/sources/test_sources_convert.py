"""meshfeed convert: JSONL / Parquet / .npy -> Megatron indexed corpus, streamed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from meshfeed.sources.converters.convert import add_subcommand, convert, load_tokenizer
from meshfeed.sources.tokens.indexed import TokenCorpus


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="meshfeed")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_jsonl_text_with_the_byte_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "hi"}, {"text": "héllo", "other": 1}])
    code = run_cli(
        "convert", str(src), "-o", str(tmp_path / "out" / "c"), "--tokenizer", "bytes", "-q"
    )
    assert code == 0
    assert "2 documents, 8 tokens" in capsys.readouterr().out
    corpus = TokenCorpus.open(tmp_path / "out" / "c")
    assert corpus.document(0).tolist() == list(b"hi")
    assert corpus.document(1).tolist() == list("héllo".encode())


def test_token_id_lists_need_no_tokenizer_and_take_an_eod(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "ids.jsonl", [[1, 2, 3], {"ids": [4]}, []])
    a = write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3], [4]])
    corpus = convert([a], tmp_path / "c", append_eod=0, progress=False)
    assert [corpus.document(i).tolist() for i in range(2)] == [[1, 2, 3, 0], [4, 0]]
    corpus = convert(src, tmp_path / "d", field="ids", dtype="int32", progress=False)
    assert corpus.dtype == np.int32
    assert [corpus.document(i).tolist() for i in range(3)] == [[1, 2, 3], [4], []]


def test_parquet_text_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["ab", "c"]}), tmp_path / "t.parquet", row_group_size=1)
    corpus = convert(
        tmp_path / "t.parquet", tmp_path / "c", field="body", tokenizer="bytes", progress=False
    )
    assert [corpus.document(i).tolist() for i in range(2)] == [[97, 98], [99]]


def test_npy_rows_are_documents(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(12, dtype=np.int32).reshape(3, 4))
    corpus = convert(tmp_path / "ids.npy", tmp_path / "c", progress=False)
    assert corpus.sizes.tolist() == [4, 4, 4]
    assert corpus.tokens.tolist() == list(range(12))
    np.save(tmp_path / "f.npy", np.zeros(3))
    with pytest.raises(ValueError, match="must be a 2-D integer array"):
        convert(tmp_path / "f.npy", tmp_path / "e", progress=False)


@pytest.mark.parametrize("dtype", ["uint64", "int64", "uint32", "int32", "uint8", "int8"])
def test_npy_of_any_integer_dtype_takes_an_eod_in_its_dtype(tmp_path: Path, dtype: str) -> None:
    np.save(tmp_path / "ids.npy", np.arange(6, dtype=dtype).reshape(2, 3))
    for eod in (0, 127, 300):  # 300 fits no 8-bit dtype: widened to an integer one, not float
        out = tmp_path / f"c{eod}"
        corpus = convert(tmp_path / "ids.npy", out, append_eod=eod, progress=False)
        assert corpus.dtype == np.uint16
        assert [corpus.document(i).tolist() for i in range(2)] == [[0, 1, 2, eod], [3, 4, 5, eod]]
    if dtype.startswith("int"):
        corpus = convert(
            tmp_path / "ids.npy",
            tmp_path / "neg",
            dtype="int16",
            eod_id=-1,
            append_eod=True,
            progress=False,
        )
        assert corpus.document(1).tolist() == [3, 4, 5, -1]


def test_a_negative_eod_beside_uint64_ids_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "u64.npy", np.arange(12, dtype=np.uint64).reshape(3, 4))
    argv = ["convert", str(tmp_path / "u64.npy"), "-o", str(tmp_path / "e"), "-q"]
    assert run_cli(*argv, "--eod-id", "0") == 0
    assert TokenCorpus.open(tmp_path / "e").document(2).tolist() == [8, 9, 10, 11, 0]
    capsys.readouterr()
    argv[3] = str(tmp_path / "n")
    assert run_cli(*argv, "--eod-id=-1", "--dtype", "int16") == 2
    err = capsys.readouterr().err
    assert "holds uint64 token ids" in err and "end-of-document id -1" in err
    assert "float" not in err


def test_several_inputs_are_concatenated_in_order(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    np.save(tmp_path / "b.npy", np.array([[7, 8]]))
    corpus = convert([a, tmp_path / "b.npy"], tmp_path / "c", tokenizer="bytes", progress=False)
    assert [corpus.document(i).tolist() for i in range(2)] == [[97], [7, 8]]


def test_module_callable_tokenizer_from_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mytok.py").write_text(
        "def encode(text):\n    return [len(w) for w in text.split()]\n"
    )
    monkeypatch.chdir(tmp_path)  # importable from the current folder, no PYTHONPATH
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "a bb ccc"}])
    assert (
        run_cli("convert", str(src), "-o", str(tmp_path / "c"), "--tokenizer", "mytok:encode", "-q")
        == 0
    )
    assert TokenCorpus.open(tmp_path / "c").document(0).tolist() == [1, 2, 3]
    sys.modules.pop("mytok", None)


def test_a_name_that_may_be_a_tiktoken_encoding_names_the_install_without_tiktoken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as where it is not installed
    with pytest.raises(ValueError, match="if it is a tiktoken encoding name, pip install tiktoken"):
        load_tokenizer("cl100k_base")


def test_bad_tokenizer_specs_are_explained() -> None:
    # The message differs with tiktoken installed (it was asked, and has no such encoding).
    with pytest.raises(ValueError, match="tokenizer 'nocolon' is not 'bytes', a "):
        load_tokenizer("nocolon")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("missing/tokenizer.json")
    with pytest.raises(ValueError, match="cannot import tokenizer module"):
        load_tokenizer("no_such_module_xyz:encode")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_tokenizer("json:nope")
    with pytest.raises(ValueError, match="not callable"):
        load_tokenizer("json.decoder:JSONArray.__doc__")


def test_text_without_tokenizer_fails_naming_the_line_and_leaves_no_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [[1], {"text": "x"}])
    assert run_cli("convert", str(src), "-o", str(tmp_path / "c"), "-q") == 2
    err = capsys.readouterr().err
    assert "d.jsonl:2 is text but no tokenizer was given" in err
    assert "pass --tokenizer" in err
    assert not (tmp_path / "c.bin").exists() and not (tmp_path / "c.bin.tmp").exists()


def test_record_errors_name_file_line_and_fix(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"body": "x"}])
    with pytest.raises(ValueError, match=r"d\.jsonl:1 has no field 'text' .* --field"):
        convert(src, tmp_path / "c", tokenizer="bytes", progress=False)
    big = write_jsonl(tmp_path / "big.jsonl", [[1], [70000]])
    with pytest.raises(ValueError, match=r"big\.jsonl:2: .*outside uint16"):
        convert(big, tmp_path / "c", progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1 is not valid JSON"):
        convert(bad, tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="cannot tell the format"):
        convert(_touch(tmp_path / "x.txt"), tmp_path / "c", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(tmp_path / "missing.jsonl", tmp_path / "c", progress=False)


def _touch(path: Path) -> Path:
    path.write_text("")
    return path


def test_progress_counts_input_bytes_with_a_total_and_eta(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "ids.npy", np.ones((5, 2), dtype=np.int64))
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "x" * 50}] * 3)
    convert([tmp_path / "ids.npy", src], tmp_path / "c", tokenizer="bytes", progress=True)
    size = (tmp_path / "ids.npy").stat().st_size + src.stat().st_size
    err = capsys.readouterr().err
    assert f"100% {size}/{size} [" in err and "<00:00" in err  # done/total [elapsed<eta]


def test_gzipped_jsonl_is_read_as_jsonl(tmp_path: Path) -> None:
    import gzip

    with gzip.open(tmp_path / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "ok"}) + "\n\n")
    corpus = convert(tmp_path / "d.jsonl.gz", tmp_path / "c", tokenizer="bytes", progress=False)
    assert corpus.num_documents == 1 and corpus.document(0).tolist() == list(b"ok")


def test_failed_convert_keeps_an_earlier_corpus_at_the_same_prefix(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [[1, 2]])
    convert(good, tmp_path / "c", progress=False)
    bad = write_jsonl(tmp_path / "bad.jsonl", [[3], "text"])
    with pytest.raises(ValueError, match="no tokenizer"):
        convert(bad, tmp_path / "c", progress=False)
    assert TokenCorpus.open(tmp_path / "c").document(0).tolist() == [1, 2]
