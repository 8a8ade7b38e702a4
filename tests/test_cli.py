"""The ``meshfeed`` front: subcommands, one-line user errors with exit code 2, help, version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshfeed.cli import build_parser, main, version
from meshfeed.sources.tokens.indexed import TokenCorpus


def test_cli_registers_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for name in ("demo", "plan", "analyze", "convert", "index"):
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


ROOT = Path(__file__).resolve().parents[1]


def run_meshfeed(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed entry point's code, in a fresh interpreter (what a user runs)."""
    return subprocess.run(
        [sys.executable, "-m", "meshfeed.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


# Errors reported through the logger (demo, analyze) are checked in a fresh interpreter, where
# the command configures its own stderr; the rest in this one.
ONE_LINE_ERRORS = [
    (["plan", "--plot", "nodir/x.png"], "meshfeed plan: error: --plot nodir/x.png: folder"),
    (["plan", "--plot", "x.txt"], "meshfeed plan: error: --plot x.txt: cannot tell"),
    (["plan", "--lengths", "l.txt"], "meshfeed plan: error: --lengths l.txt: 'a' is not"),
    (["convert", "x.jsonl", "-o", "o", "--dtype", "float32"], "invalid choice: 'float32'"),
    (["convert", "missing.jsonl", "-o", "o"], "meshfeed convert: error: input missing"),
    (["convert", "x.jsonl", "-o", "o", "--tokenizer", "nope.json"], "does not exist"),
    (["plan", "--dp", "x"], "argument --dp: invalid int value: 'x'"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    # a URL where only a local file works is refused by name, never made a folder "s3:" (#28)
    (["plan", "--plot", "s3://b/load.png"], "s3://b/load.png is a URL; --plot takes a local"),
    (["plan", "--lengths", "s3://b/l.npy"], "s3://b/l.npy is a URL; --lengths takes a local"),
    (["convert", "x.jsonl", "-o", "o", "--rows-per-shard", "0"], "'0' is not a positive number"),
    (["convert", "s3://b/x.jsonl", "-o", "o"], "convert takes a local path (got 's3://b/x.jsonl'"),
    (["convert", "s3://b/x.jsonl", "--to", "shards", "-o", "o"], "got 's3://b/x.jsonl', a URL"),
    (["convert", "x.jsonl", "-o", "s3://b/c", "--cache-dir", "s3://b/cache"], "cache_dir takes"),
    (
        ["convert", "x.jsonl", "-o", "o", "--tokenizer", "s3://b/t.json"],
        "a tokenizer takes a local",
    ),
    # an option the chosen --to would ignore is refused, not dropped without a word
    (["convert", "x.jsonl", "-o", "o", "--rows-per-shard", "9"], "--rows-per-shard applies to"),
    (
        ["convert", "x.jsonl", "--to", "shards", "-o", "o", "--tokenizer", "b"],
        "--tokenizer applies",
    ),
    (["convert", "x.jsonl", "--to", "shards", "-o", "o", "--dtype", "int32"], "--dtype applies"),
]


def _inputs(folder: Path) -> None:
    (folder / "l.txt").write_text("12\na\n")
    (folder / "x.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")


@pytest.mark.parametrize(("argv", "message"), ONE_LINE_ERRORS)
def test_every_user_error_is_one_line_and_exit_code_2(argv, message, tmp_path, monkeypatch, capsys):
    _inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert out == ""
    assert not (tmp_path / "s3:").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--workdir", "/proc/nope"], "meshfeed demo: error: cannot use --workdir"),
        (["analyze", "absent", "-o", "m"], "meshfeed analyze: error:"),
        (["plan", "--plot", "x.txt"], "meshfeed plan: error: --plot x.txt: cannot tell"),
    ],
)
def test_user_errors_from_the_command_line(argv, message, tmp_path):
    _inputs(tmp_path)
    proc = run_meshfeed(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshfeed {version()}"


@pytest.mark.parametrize("command", ["demo", "plan", "analyze", "convert"])
def test_help_is_plain_words_with_true_defaults(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out  # no reStructuredText markup
    assert "(default: None)" not in out
    assert "default" in out


def test_plan_help_shows_the_max_tokens_default(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "(default: 32768)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_convert_stopped_by_sigterm_deletes_its_partial_output(tmp_path):
    """SIGTERM (what a scheduler sends) took the default action: the partial .bin stayed
    behind as a hidden temp file, one more per retry. Now it unwinds as an interrupt does."""
    import signal
    import time

    data = tmp_path / "big.jsonl"
    with data.open("w") as f:
        for i in range(600_000):
            f.write('{"text": "%s"}\n' % ("x" * (10 + i % 190)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshfeed.cli", "convert", "-q", str(data), "-o",
         str(tmp_path / "out"), "--tokenizer", "bytes"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.bin.*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the conversion never started writing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the conversion finished before the signal arrived")
    assert proc.returncode == 128 + signal.SIGTERM and "terminated" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


@pytest.mark.parametrize("command", ["corpora", "index"])
def test_every_command_takes_quiet(command, capsys):
    # The README says -q silences progress "on every command"; corpora and index refused it.
    args = build_parser().parse_args([command, "somewhere", "-q"])
    assert args.quiet is True
