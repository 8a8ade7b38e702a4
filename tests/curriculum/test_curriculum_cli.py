"""``meshfeed analyze``: registered through add_subcommand, writes loadable indexes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshfeed.curriculum import MetricIndex, SampleMetric
from meshfeed.curriculum.cli import add_subcommand
from meshfeed.curriculum.index import load_accumulated
from meshfeed.runtime import available_cores
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_write import write_indexed

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshfeed")
    add_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def _docs() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 50, size=int(rng.integers(1, 20))) for _ in range(120)]


def first_token() -> SampleMetric:
    return SampleMetric(name="first", fn=lambda d: int(d[0]))


def test_analyze_a_token_corpus_writes_indexes_that_match_the_corpus(tmp_path, capsys):
    docs = _docs()
    write_indexed(tmp_path / "corpus", docs, "uint16")
    code = _run(
        [
            "analyze",
            str(tmp_path / "corpus"),
            "-o",
            str(tmp_path / "metrics"),
            "-m",
            "seqlen",
            "-m",
            "vocab_rarity",
            "-m",
            f"{__name__}:first_token",
            "-j",
            "2",
            "--chunk-size",
            "16",
            "-q",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    written = out.splitlines()[-1]
    assert "vocab_rarity" in out and written.startswith(
        "wrote 3 metric index(es) (seqlen, vocab_rarity, first) and 1 accumulated array(s) ("
    )
    assert written.endswith(f") for 120 samples to {tmp_path / 'metrics'}")
    corpus = TokenCorpus(tmp_path / "corpus")
    lengths = MetricIndex.load(tmp_path / "metrics" / "seqlen", dataset=corpus)
    assert lengths.values.tolist() == [len(d) for d in docs]
    first = MetricIndex.load(tmp_path / "metrics" / "first", dataset=corpus)
    assert first.values.tolist() == [int(d[0]) for d in docs]


def test_analyze_reports_bad_input_with_an_exit_code(tmp_path, caplog):
    assert _run(["analyze", str(tmp_path / "missing"), "-o", str(tmp_path / "m")]) == 2
    write_indexed(tmp_path / "corpus", _docs(), "uint16")
    assert (
        _run(["analyze", str(tmp_path / "corpus"), "-o", str(tmp_path / "m"), "-m", "bogus"]) == 2
    )
    assert "unknown metric 'bogus'" in caplog.text


def test_analyze_refuses_a_float_corpus_by_name(tmp_path, caplog):
    write_indexed(tmp_path / "floats", [np.array([0.5, 1.5]), np.array([2.0])], "float32")
    code = _run(
        ["analyze", str(tmp_path / "floats"), "-o", str(tmp_path / "m"), "-m", "vocab_rarity"]
    )
    assert code == 2
    assert "holds float32 values, not token ids" in caplog.text and "--dtype uint16" in caplog.text


def test_analyze_workers_default_to_the_available_cores(capsys):
    parser = argparse.ArgumentParser(prog="meshfeed")
    add_subcommand(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["analyze", "c", "-o", "m"]).num_workers == available_cores()
    assert available_cores() == len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit):
        parser.parse_args(["analyze", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default: the {available_cores()} core(s) available)" in help_text


def windows_dataset() -> object:
    """A dataset whose samples are tensors (what TokenWindows gives), for module:callable."""
    import torch

    return [torch.tensor([3, 1, 4]), torch.tensor([1, 5, 9, 2])]


def test_vocab_rarity_without_vocab_size_on_tensor_samples(tmp_path, capsys):
    spec = f"{__name__}:windows_dataset"
    assert _run(["analyze", spec, "-o", str(tmp_path / "m"), "-m", "vocab_rarity", "-j", "0"]) == 0
    hist = load_accumulated(tmp_path / "m" / "token_histogram")
    assert hist.size == 10 and hist.tolist() == [0, 2, 1, 1, 1, 1, 0, 0, 0, 1]


def test_a_small_vocab_size_is_refused_in_cli_terms_without_a_traceback(tmp_path, capsys):
    write_indexed(tmp_path / "c", _docs(), np.uint16)
    argv = ["analyze", str(tmp_path / "c"), "-o", str(tmp_path / "m"), "-q", "-j", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "meshfeed.cli", *argv, "-m", "vocab_rarity", "--vocab-size", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 2
    top = max(int(d.max()) for d in _docs())
    assert f"pass --vocab-size {top + 1} or more" in proc.stderr
    assert "Traceback" not in proc.stderr and "token_histogram()" not in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_negative_token_ids_are_refused_as_negative_whatever_the_vocab_size(tmp_path, caplog):
    write_indexed(tmp_path / "c", [np.array([-3, 5, 7])] * 5, np.int16)
    argv = ["analyze", str(tmp_path / "c"), "-o", str(tmp_path / "m"), "-q", "-j", "0"]
    for more in ([], ["--vocab-size", "8"], ["--vocab-size", "100000"]):
        caplog.clear()
        assert _run([*argv, "-m", "vocab_rarity", *more]) == 2
        err = caplog.text
        assert "token id -3 (the smallest, at token 0 of sample 0 " in err
        assert "token ids must be >= 0" in err and "--vocab-size" not in err


def test_windows_index_one_value_per_token_window_in_its_order(tmp_path, capsys):
    from meshfeed.sources.tokens.windows import TokenWindows

    write_indexed(tmp_path / "c", _docs(), np.uint16)
    out = tmp_path / "m"
    argv = ["analyze", str(tmp_path / "c"), "--windows", "8", "-o", str(out), "-q", "-j", "0"]
    assert _run([*argv, "-m", "vocab_rarity", "-m", f"{__name__}:first_token"]) == 0
    windows = TokenWindows(str(tmp_path / "c"), seq_len=8)
    first = MetricIndex.load(out / "first")
    assert len(first.values) == len(windows) > 1
    assert first.values.tolist() == [int(windows[i][0]) for i in range(len(windows))]
    assert len(MetricIndex.load(out / "vocab_rarity").values) == len(windows)
    assert _run(["analyze", f"{__name__}:windows_dataset", "--windows", "8", "-o", str(out)]) == 2


def test_seqlen_over_windows_is_refused_and_windows_default_to_vocab_rarity(
    tmp_path, capsys, caplog
):
    write_indexed(tmp_path / "c", _docs(), np.uint16)
    out = tmp_path / "m"
    argv = ["analyze", str(tmp_path / "c"), "--windows", "8", "-o", str(out), "-q", "-j", "0"]
    assert _run([*argv, "-m", "seqlen"]) == 2  # every window has 9 tokens: a constant metric
    assert "-m seqlen with --windows 8 gives every window the same value" in caplog.text
    assert not out.exists()
    assert _run(argv) == 0
    assert "wrote 1 metric index(es) (vocab_rarity)" in capsys.readouterr().out


def test_a_url_cache_dir_is_refused_by_name(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_indexed(tmp_path / "c", _docs(), np.uint16)
    argv = ["analyze", str(tmp_path / "c"), "-o", str(tmp_path / "m"), "-q", "-j", "0"]
    assert _run([*argv, "--cache-dir", "s3://b/cache"]) == 2
    assert "--cache-dir takes a local path (got 's3://b/cache', a URL)" in caplog.text
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "m").exists()


def test_vocab_rarity_refuses_a_token_id_too_large_for_a_vocabulary_by_default(tmp_path, caplog):
    # The histogram was sized from the largest id: one id of 2**31 asked for 16 GiB per
    # worker and ended in a MemoryError traceback (or a lazily touched 16 GiB).
    write_indexed(tmp_path / "c", [np.array([3, 2**31, 7])] * 3, np.int64)
    argv = ["analyze", str(tmp_path / "c"), "-o", str(tmp_path / "m"), "-q", "-j", "0"]
    assert _run([*argv, "-m", "vocab_rarity"]) == 2
    assert f"the largest token id is {2**31}" in caplog.text and "--vocab-size" in caplog.text
