from __future__ import annotations

import argparse

import numpy as np
import pytest

from meshfeed.balance.cli import add_subcommand


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshfeed")
    add_subcommand(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_cli_prints_balance_for_meshfeed_and_naive_and_writes_a_png(tmp_path, capsys):
    png = tmp_path / "load.png"
    code = _main(
        [
            "plan",
            "--dp",
            "4",
            "--cp",
            "2",
            "--dist",
            "lognormal",
            "--batches",
            "2",
            "--max-tokens",
            "8192",
            "--png",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "8 balanced ranks" in out and "meshfeed" in out and "naive slicing" in out
    assert png.exists() and png.stat().st_size > 1000


def test_plan_cli_reads_document_lengths_from_npy(tmp_path, capsys):
    path = tmp_path / "lengths.npy"
    np.save(path, np.random.default_rng(0).integers(1, 4000, 3000))
    code = _main(
        [
            "plan",
            "--dp",
            "3",
            "--lengths",
            str(path),
            "--max-tokens",
            "4096",
            "--batches",
            "3",
            "--cost",
            "s2",
            "--no-png",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "3 batches" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dp", "0"], "sizes must be integers >= 1"),
        (["--max-tokens", "16", "--dist", "longtail"], "raise max_tokens"),
    ],
)
def test_plan_cli_exits_2_with_a_message_on_bad_input(argv, message, capsys):
    assert _main(["plan", "--no-png", "--batches", "1", *argv]) == 2
    assert message in capsys.readouterr().err
