from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest

from meshfeed.balance.cli import add_subcommand


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshfeed")
    add_subcommand(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_cli_prints_balance_for_meshfeed_and_naive_and_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason='the plot needs matplotlib: "meshfeed[plot]"')
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
        (["--dp", "0"], "--dp must be a positive integer (got 0)"),
        (["--max-tokens", "16", "--long-documents", "refuse"], "--long-documents split"),
        (["--plot", "nodir/x.png"], "folder nodir does not exist"),
        (["--plot", "x.txt"], "end the name in .png, .svg, .pdf"),
        (["--lengths", "absent.txt"], "--lengths absent.txt: no such file"),
    ],
)
def test_plan_cli_exits_2_with_a_message_on_bad_input(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _main(["plan", "--batches", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dp", range(1, 9))
def test_plan_cli_defaults_work_on_every_dp(dp, capsys):
    # the default longtail lengths reach 131072 tokens: longer than 1..3 ranks x 32768 hold
    assert _main(["plan", "--dp", str(dp), "--batches", "1"]) == 0
    assert f"-> {dp} balanced ranks" in capsys.readouterr().out


def test_plan_cli_reads_lengths_from_a_text_file(tmp_path, capsys):
    (tmp_path / "l.txt").write_text("100\n200\n300\n")
    assert _main(["plan", "--dp", "2", "--lengths", str(tmp_path / "l.txt")]) == 0
    assert "3 documents, ~600 tokens each" in capsys.readouterr().out
    (tmp_path / "bad.txt").write_text("100\nabc\n")
    assert _main(["plan", "--dp", "2", "--lengths", str(tmp_path / "bad.txt")]) == 2
    assert "'abc' is not an integer" in capsys.readouterr().err


def test_plan_cli_writes_no_png_unless_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _main(["plan", "--dp", "2", "--batches", "1", "--max-tokens", "8192"]) == 0
    assert "wrote" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_plan_cli_reports_the_tokens_actually_planned_for_a_short_corpus(tmp_path, capsys):
    path = tmp_path / "lens.npy"
    np.save(path, np.array([100, 200, 300]))
    assert _main(["plan", "--dp", "2", "--lengths", str(path), "--max-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "3 documents, ~600 tokens each" in out
    assert "1048576" not in out


def test_plan_cli_does_not_call_a_split_the_mesh_cp_degree(capsys):
    assert _main(["plan", "--dp", "8", "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "CP degrees" not in out
    assert "not only --cp 1" in out and "all 8 DP x CP ranks" in out


def test_plan_cli_without_matplotlib_refuses_a_plot_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises
    monkeypatch.chdir(tmp_path)
    assert _main(["plan", "--dp", "2", "--batches", "1", "--plot", "load.png"]) == 2
    assert '--plot needs matplotlib: pip install "meshfeed[plot]"' in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_plan_cli_plot_title_counts_the_documents_of_the_table(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason='the plot needs matplotlib: "meshfeed[plot]"')
    import matplotlib.axes

    titles: list[str] = []
    original = matplotlib.axes.Axes.set_title

    def spy(self, label, *args, **kwargs):
        titles.append(label)
        return original(self, label, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", spy)
    ticks: list[list[float]] = []
    set_xticks = matplotlib.axes.Axes.set_xticks

    def spy_ticks(self, values, *args, **kwargs):
        ticks.append([float(v) for v in values])
        return set_xticks(self, values, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", spy_ticks)
    png = tmp_path / "load.png"
    argv = ["plan", "--dp", "4", "--batches", "3", "--plot", str(png)]
    assert _main(argv) == 0
    out = capsys.readouterr().out
    docs = int(out.split(" documents,")[0].rsplit(" ", 1)[1])
    assert png.exists()
    assert len(titles) == 1 and f"{docs} documents" in titles[0] and "3 batches" in titles[0]
    assert ticks == [[0.0, 1.0, 2.0, 3.0]]  # one tick per rank, at whole numbers


def test_plan_takes_q_as_every_command_does(capsys):
    assert _main(["plan", "--dp", "2", "--batches", "1", "-q"]) == 0
    out, err = capsys.readouterr()
    assert "-> 2 balanced ranks" in out and err == ""


def test_plan_cli_refuses_lengths_that_are_not_one_array_of_lengths(tmp_path, capsys):
    path = tmp_path / "lengths.npy"
    np.save(path, np.full((4, 3), 100))  # flattened, it read as 12 documents
    assert _main(["plan", "--batches", "1", "--lengths", str(path)]) == 2
    err = capsys.readouterr().err
    assert "holds an array of shape (4, 3); give a 1-D array" in err
    assert "Traceback" not in err
