"""The ``meshfeed`` front: subcommands registered, convert's dtype checked while parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshfeed.cli import build_parser, main
from meshfeed.sources.indexed import TokenCorpus


def test_cli_registers_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for name in ("demo", "plan", "analyze", "convert"):
        assert name in out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_convert_refuses_a_float_dtype_for_a_token_corpus(dtype, tmp_path, capsys):
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"text": [1, 2, 3]}) + "\n")
    with pytest.raises(SystemExit) as exit_:
        main(["convert", str(data), "-o", str(tmp_path / "out"), "--dtype", dtype])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: '{dtype}'" in err and "uint16" in err
    assert not (tmp_path / "out.bin").exists()
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "float" not in capsys.readouterr().out  # --help offers only what convert takes


def test_convert_accepts_an_integer_dtype(tmp_path):
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"text": [1, 2, 3]}) + "\n" + json.dumps({"text": [4]}) + "\n")
    assert main(["convert", str(data), "-o", str(tmp_path / "out"), "--dtype", "int32", "-q"]) == 0
    corpus = TokenCorpus(tmp_path / "out")
    assert corpus.dtype == np.int32 and corpus.num_documents == 2
