"""WebDataset tar shards, written with ``tarfile`` in the webdataset layout, read by TarReader."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed.errors import SourceError
from meshfeed.sources.streams.files import open_local
from meshfeed.sources.streams.readers import shard_identity
from meshfeed.sources.streams.webdataset import TarReader, expand_shards, wds_stream
from meshfeed.stream_loader import StreamLoader
from meshfeed.testing import assert_resume_equivalence
from tests.dist_utils import run_distributed
from tests.optional import NEEDS_HTTP
from tests.sources.range_server import serve

SIZES = (7, 12, 1, 9)  # samples per shard


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def _sample(s: int, i: int) -> dict[str, bytes]:
    rng = np.random.default_rng(s * 1000 + i)
    return {
        "jpg": rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes(),
        "cls": str(i % 10).encode(),
        "txt": f"caption {s}/{i} ü".encode(),
        "meta.json": json.dumps({"shard": s, "i": i}).encode(),
    }


def _write(root: Path, sizes: tuple[int, ...] = SIZES) -> list[str]:
    """Shards ``root/train-00000s.tar`` in the webdataset layout (plus members a reader must
    skip: a directory, a ``__meta__`` file, a file without an extension)."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, n in enumerate(sizes):
        path = root / f"train-{s:06d}.tar"
        with tarfile.open(path, "w") as tf:
            d = tarfile.TarInfo("images")
            d.type = tarfile.DIRTYPE
            tf.addfile(d)
            _add(tf, "__meta__", b"written by the test")
            _add(tf, "README", b"no extension: skipped")
            for i in range(n):
                key = f"images/{s:02d}{i:04d}"
                for ext, data in _sample(s, i).items():
                    _add(tf, f"{key}.{ext.upper() if ext == 'jpg' else ext}", data)
        paths.append(str(path))
    return paths


def _expected(s: int, i: int) -> dict[str, Any]:
    return {"__key__": f"images/{s:02d}{i:04d}", **_sample(s, i)}


def _all(sizes: tuple[int, ...] = SIZES) -> list[dict[str, Any]]:
    return [_expected(s, i) for s, n in enumerate(sizes) for i in range(n)]


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    return _write(tmp_path / "wds")


# ---------------------------------------------------------------------- reading
def test_rows_are_the_samples_in_tar_order(shards):
    stream = wds_stream(shards)
    assert stream.rows == list(SIZES) and len(stream) == sum(SIZES)
    assert stream.__getitems__(list(range(len(stream)))) == _all()


def test_take_in_random_order_with_repeats(shards):
    reader = TarReader()
    for s, n in enumerate(SIZES):
        rows = np.random.default_rng(s).integers(0, n, 3 * n)
        assert reader.take(shards[s], rows) == [_expected(s, int(i)) for i in rows]
        assert reader.count(shards[s]) == n
        assert list(reader(shards[s], 1, None)) == [_expected(s, i) for i in range(1, n)]


def test_the_same_samples_as_webdataset_itself(shards):
    wds = pytest.importorskip("webdataset")
    ref = [
        {k: v for k, v in s.items() if k not in ("__url__", "__local_path__")}
        for s in wds.WebDataset(shards, shardshuffle=False)
    ]
    assert len(ref) == sum(SIZES)
    assert wds_stream(shards).__getitems__(list(range(sum(SIZES)))) == ref


class TrackingOpen:
    """An ``open_file`` that records what it opens (picklable)."""

    def __init__(self) -> None:
        self.opened: list[str] = []

    def __call__(self, name: str) -> Any:
        self.opened.append(name)
        return open_local(name)


def test_each_tar_is_indexed_once_per_process(shards):
    tracking_open = TrackingOpen()
    opened = tracking_open.opened
    reader = TarReader(open_file=tracking_open)
    for _ in range(3):
        reader.take(shards[1], np.array([5, 0, 11]))
    assert reader.count(shards[1]) == 12 and opened == [shards[1]]  # one handle, one scan
    clone = pickle.loads(pickle.dumps(reader))
    assert not clone._indexes and clone.take(shards[1], np.array([3])) == [_expected(1, 3)]


def test_decode_gives_text_json_and_class_conveniences(shards):
    s = wds_stream(shards, decode=True)[8]
    assert s["txt"] == "caption 1/1 ü" and s["cls"] == 1 and s["meta.json"] == {"shard": 1, "i": 1}
    assert isinstance(s["jpg"], bytes)


def test_shard_notation_expands_like_webdataset(shards, tmp_path):
    pattern = str(tmp_path / "wds" / "train-{000000..000003}.tar")
    assert expand_shards(pattern) == shards
    assert expand_shards("a-{08..10}-{x,y}.tar") == [
        "a-08-x.tar", "a-08-y.tar", "a-09-x.tar", "a-09-y.tar", "a-10-x.tar", "a-10-y.tar"
    ]  # fmt: skip
    assert wds_stream(pattern).rows == list(SIZES)


def test_version_is_meshfeeds_file_identity(shards):
    reader = TarReader()
    before = reader.version(shards[0])
    assert before == shard_identity(shards[0], None)
    _write(Path(shards[0]).parent, (8, *SIZES[1:]))
    assert reader.version(shards[0]) != before


# ---------------------------------------------------------------------- the loader
def test_every_row_once_over_two_data_ranks(shards):
    stream = wds_stream(shards, shuffle_buffer=10)
    per_rank, padded = [], 0
    for rank in range(2):
        lo = StreamLoader(
            stream, batch_size=3, mesh={"dp": 2}, rank=rank, collate_fn=list, drop_last=False
        )
        per_rank.append([[s["__key__"] for s in b] for b in lo])
        padded += lo.stats()["padded"]
    assert len(per_rank[0]) == len(per_rank[1])  # the ranks stop together
    served = [x for batches in per_rank for b in batches for x in b]
    assert set(served) == {s["__key__"] for s in _all()}
    assert len(served) == sum(SIZES) + padded and padded < 2


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_from_every_batch(shards, workers):
    stream = wds_stream(shards, shuffle_buffer=8, seed=5)

    def make() -> StreamLoader:
        return StreamLoader(stream, batch_size=4, collate_fn=list, num_workers=workers, seed=1)

    ref = assert_resume_equivalence(make, num_items=10, cleanup=lambda lo: lo.shutdown())
    keys = [s["__key__"] for b in ref[:7] for s in b]  # one epoch: 7 x 4 of the 29 samples
    assert len(set(keys)) == 28 and set(keys) <= {s["__key__"] for s in _all()}


# ---------------------------------------------------------------------- damage
def _members_end(path: str) -> int:
    with tarfile.open(path) as tf:
        tf.getmembers()
        return tf.offset  # where the end-of-archive block starts


@pytest.mark.parametrize("where", ["mid-member", "at-a-header", "before-the-end-block"])
def test_a_truncated_tar_is_a_source_error_naming_it(shards, where):
    end = _members_end(shards[1])
    cut = {"mid-member": end // 2 + 7, "at-a-header": end // 2 // 512 * 512}.get(where, end)
    data = Path(shards[1]).read_bytes()
    Path(shards[1]).write_bytes(data[:cut])
    stream = wds_stream(shards, rows=list(SIZES))
    assert stream.__getitems__([0]) == [_expected(0, 0)]  # the other shards still read
    lo = StreamLoader(stream, batch_size=len(stream), collate_fn=list, shuffle=False)
    with pytest.raises(SourceError, match="train-000001.tar"):
        next(iter(lo))
    with pytest.raises(SourceError, match="train-000001.tar"):
        wds_stream(shards).rows  # counting indexes it


def test_a_compressed_tar_is_refused_naming_it(shards):
    path = Path(shards[2])
    path.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(SourceError, match=r"train-000002\.tar.*plain, uncompressed tar"):
        TarReader().count(shards[2])


def test_a_repeated_extension_in_one_sample_is_refused(tmp_path):
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tf:
        _add(tf, "a.txt", b"1")
        _add(tf, "a.txt", b"2")
    with pytest.raises(SourceError, match=r"dup\.tar.*two 'txt' members"):
        TarReader().count(str(path))


def test_rows_out_of_range_are_an_index_error(shards):
    with pytest.raises(IndexError, match="out of range.*12 samples"):
        TarReader().take(shards[1], np.array([12]))


def _take_in_child(reader: TarReader, shard: str) -> None:
    assert reader.take(shard, np.array([11, 3])) == [_expected(1, 11), _expected(1, 3)]


def test_a_forked_worker_reads_through_its_own_file_handles(shards):
    """A handle inherited through fork shares its file offset with the parent: a child that
    seeks it would move the parent's reads (wrong bytes under a loader's workers)."""
    mp = pytest.importorskip("multiprocessing")
    reader = TarReader()
    reader.take(shards[1], np.array([0]))  # the parent opens the shard
    fd = reader._handles.get(shards[1]).fileno()
    before = os.lseek(fd, 0, os.SEEK_CUR)
    child = mp.get_context("fork").Process(target=_take_in_child, args=(reader, shards[1]))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert os.lseek(fd, 0, os.SEEK_CUR) == before


@NEEDS_HTTP
def test_shards_read_over_http_byte_ranges_are_the_same(shards):
    root = str(Path(shards[0]).parent)
    with serve(root) as (base, log):
        stream = wds_stream(base + "/train-{000000..000003}.tar", shuffle_buffer=6)
        assert stream.rows == list(SIZES)
        rows = np.random.default_rng(1).permutation(len(stream)).tolist()
        assert stream.__getitems__(rows) == [_all()[i] for i in rows]
        assert stream.reader.version(stream.shards[0]).split(":")[0] == str(
            os.path.getsize(shards[0])
        )
        assert any("Range" not in r and r.startswith("HEAD") for r in log)
        assert all(r.startswith("HEAD") or "bytes=" in r for r in log)  # never a whole file
    with serve(root) as (base, _):  # a server that lost a shard: the error names it
        os.remove(shards[3])
        with pytest.raises(SourceError, match="train-000003.tar"):
            TarReader().count(base + "/train-000003.tar")


def _gloo_rank(rank: int, world: int, shards: list[str]) -> dict[str, Any]:
    stream = wds_stream(shards, shuffle_buffer=8, seed=2)
    lo = StreamLoader(
        stream, batch_size=3, mesh={"dp": world}, collate_fn=list, drop_last=False, num_workers=1
    )
    try:
        batches = [[s["__key__"] for s in b] for b in lo]
    finally:
        lo.shutdown()
    return {"batches": batches, "padded": lo.stats()["padded"]}


@pytest.mark.slow
def test_gloo_ranks_read_every_sample_once(shards):
    results = run_distributed(_gloo_rank, 2, shards, timeout=180)
    assert len({len(r["batches"]) for r in results}) == 1  # the ranks stop together
    served = [k for r in results for b in r["batches"] for k in b]
    assert set(served) == {s["__key__"] for s in _all()}
    assert len(served) == sum(SIZES) + sum(r["padded"] for r in results)
