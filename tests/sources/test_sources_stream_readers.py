"""A forked loader worker must not read through file handles its parent opened: the two
processes would share one file offset, so a seek in one moves the other's reads."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import numpy as np

from meshfeed.sources.stream_readers import DefaultReader


def _take_in_child(reader: DefaultReader, path: str) -> None:
    assert [r["i"] for r in reader.take(path, np.array([350, 7]))] == [350, 7]


def test_default_reader_in_a_forked_worker_opens_its_own_files(tmp_path):
    path = str(tmp_path / "rows.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"i": i, "pad": "x" * (i % 50)}) + "\n" for i in range(400))
    reader = DefaultReader()
    reader.take(path, np.array([0]))  # the parent opens the file
    (f,) = reader._files.values()
    before = os.lseek(f.fileno(), 0, os.SEEK_CUR)
    child = mp.get_context("fork").Process(target=_take_in_child, args=(reader, path))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert os.lseek(f.fileno(), 0, os.SEEK_CUR) == before
