"""``meshfeed demo``: bad arguments refused before any phase runs; a small run verifies itself."""

from __future__ import annotations

import logging

import pytest

from meshfeed.cli import main


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1 (got 0)"),
        (["--dp", "0"], "--dp must be at least 1 (got 0)"),
        (["--tp", "-1"], "--tp must be at least 1 (got -1)"),
        (["--seq-len", "0"], "--seq-len must be at least 1 (got 0)"),
        (["--num-workers", "-2"], "--num-workers must be at least 0 (got -2)"),
        (["--resume-dp", "0"], "--resume-dp must be at least 1 (got 0)"),
        (["--resume-dp", "3"], "--resume-dp 3 must divide the global batch 8"),
        (["--workdir", "s3://b/demo"], "--workdir s3://b/demo is a URL; pick a local folder"),
    ],
)
def test_demo_refuses_bad_arguments_before_any_phase(
    argv, message, caplog, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="meshfeed"):
        code = main(["demo", *argv])
    assert code == 2
    assert message in caplog.text
    # Refused up front: no corpus written, no ranks started, no summary.
    assert "writing a synthetic corpus" not in caplog.text
    assert "starting" not in caplog.text
    assert "summary" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # no folder named after a URL


def test_demo_refuses_a_corpus_with_fewer_than_two_global_batches(caplog):
    with caplog.at_level(logging.INFO, logger="meshfeed"):
        code = main(["demo", "--documents", "2", "--seq-len", "256", "--batch-size", "8"])
    assert code == 2
    assert "needs at least 2" in caplog.text and "--documents" in caplog.text
    assert "starting" not in caplog.text


def test_demo_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for default in (
        "(default: 2)",  # --dp, --tp
        "samples per data rank per step (default: 4)",
        "(default: 256)",
        "(default: 3000)",
    ):
        assert default in out


@pytest.mark.slow
def test_demo_small_run_passes_and_tells_the_two_resumes_apart(caplog, capsys):
    argv = ["demo", "--dp", "1", "--tp", "2", "--resume-dp", "2", "--batch-size", "2"]
    argv += ["--documents", "60", "--seq-len", "64", "--num-workers", "0"]
    with caplog.at_level(logging.INFO, logger="meshfeed"):
        code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("PASS") == 6 and "FAIL" not in out
    assert "resume on the same mesh {'dp': 1, 'tp': 2}" in out
    assert "elastic resume on {'dp': 2}" in out
    # Progress before each phase's ranks start (no silent start-up), one message per phase.
    assert caplog.text.count("starting 2 gloo ranks") == 3
