"""MDS shards written by MosaicML Streaming's own MDSWriter, read by meshfeed's MDSReader.

The shards and the reference samples come from ``mds_peer.py``, run under a Python that has
``streaming`` (this interpreter, else the peers virtualenv /tmp/shards-peers); the tests skip,
saying why, when neither has it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed.errors import SourceError
from meshfeed.sources.streams.files import open_local
from meshfeed.sources.streams.mds import MDSReader, mds_stream
from meshfeed.stream_loader import StreamLoader
from meshfeed.testing import assert_resume_equivalence
from tests.optional import NEEDS_HTTP, NEEDS_ZSTD, ZSTD
from tests.sources.range_server import serve

PEER = Path(__file__).with_name("mds_peer.py")
PEERS_PYTHON = Path("/tmp/shards-peers/bin/python")
NAMES = ("plain", ZSTD, "gz")


def _peer_python() -> str | None:
    if importlib.util.find_spec("streaming") is not None:
        return sys.executable
    return str(PEERS_PYTHON) if PEERS_PYTHON.exists() else None


def _run_peer(python: str, *args: str) -> None:
    proc = subprocess.run(
        [python, str(PEER), *args], capture_output=True, text=True, timeout=240, cwd="/"
    )
    if proc.returncode != 0:
        pytest.skip(f"MosaicML Streaming could not run under {python}: {proc.stderr[-800:]}")


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``{"root": dir, "expected": {name: samples}, "dataset": {name: samples}}``: datasets
    written by MDSWriter, read back by streaming's MDSReader and by its StreamingDataset (on a
    copy, since StreamingDataset decompresses shards next to the originals)."""
    python = _peer_python()
    if python is None:
        pytest.skip("MosaicML Streaming is not importable here and /tmp/shards-peers is absent")
    root = tmp_path_factory.mktemp("mds")
    _run_peer(python, str(root), "write")
    with open(root / "expected.pkl", "rb") as f:
        expected = pickle.load(f)
    copy = tmp_path_factory.mktemp("mds-dataset")
    dataset = {}
    for name in ("plain", "zstd"):
        shutil.copytree(root / name, copy / name)
    _run_peer(python, str(copy), "dataset", "plain", "zstd")
    for name in ("plain", "zstd"):
        with open(copy / f"dataset-{name}.pkl", "rb") as f:
            dataset[name] = pickle.load(f)
    return {"root": root, "expected": expected, "dataset": dataset}


def _same(a: Any, b: Any, where: str) -> None:
    """Strict equality: the same types, dtypes, shapes and values."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a!r} != {b!r}"
        assert np.array_equal(a, b), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _index(sample: dict[str, Any]) -> int:
    return (sample["id"] + 100) // 7  # the peer writes id = 7 i - 100


# ---------------------------------------------------------------------- the same samples
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_the_loader_yields_exactly_the_samples_mosaicml_reads(peer, name):
    expected = peer["expected"][name]
    stream = mds_stream(peer["root"] / name, shuffle_buffer=16, seed=3)
    assert len(stream) == len(expected) == 90 and len(stream.shards) > 4
    seen = []
    for batch in StreamLoader(stream, batch_size=8, collate_fn=list, drop_last=False):
        for s in batch:
            i = _index(s)
            _same(s, expected[i], f"{name} sample {i}")
            seen.append(i)
    assert sorted(seen) == list(range(90)) and seen != sorted(seen)  # shuffled, each once


@pytest.mark.parametrize("name", ["plain", ZSTD])
def test_samples_by_index_match_streaming_dataset(peer, name):
    stream = mds_stream(peer["root"] / name)
    reference = peer["dataset"][name]
    order = np.random.default_rng(0).permutation(len(reference))
    for i, s in zip(order.tolist(), stream.__getitems__(order.tolist()), strict=True):
        _same(s, reference[i], f"{name} index {i}")


def test_image_columns_are_the_stored_bytes(peer):
    stream = mds_stream(peer["root"] / "images")
    got = stream.__getitems__(list(range(len(stream))))
    for i, (a, b) in enumerate(zip(got, peer["expected"]["images"], strict=True)):
        _same(a, b, f"image sample {i}")
    assert got[2]["png"].startswith(b"\x89PNG")


@pytest.mark.parametrize("name", ["plain", ZSTD])
def test_decoded_values_have_the_documented_types(peer, name):
    s = mds_stream(peer["root"] / name)[5]
    assert isinstance(s["id"], int) and isinstance(s["text"], str) and isinstance(s["blob"], bytes)
    assert (
        s["tokens"].dtype == np.int32 and s["tokens"].shape == (6,) and s["tokens"].flags.writeable
    )
    assert s["grid"].shape == (2, 3) and isinstance(s["small"], np.int8)
    assert s["big"] == 10**30 + 5 and s["meta"] == {
        "i": 5,
        "tags": ["a", "a"],
        "nested": {"x": 5 / 3},
    }
    assert isinstance(s["half"], np.float16) and not isinstance(s["big"], Decimal)


# ---------------------------------------------------------------------- ranks and resume
@pytest.mark.parametrize("name", ["plain", ZSTD])
def test_every_row_once_over_two_data_ranks(peer, name):
    stream = mds_stream(peer["root"] / name, shuffle_buffer=20)
    per_rank, padded = [], 0
    for rank in range(2):
        lo = StreamLoader(
            stream, batch_size=4, mesh={"dp": 2}, rank=rank, collate_fn=list, drop_last=False
        )
        per_rank.append([[_index(s) for s in b] for b in lo])
        padded += lo.stats()["padded"]
    assert len(per_rank[0]) == len(per_rank[1])  # the ranks stop together
    served = [x for batches in per_rank for b in batches for x in b]
    assert set(served) == set(range(90)) and len(served) == 90 + padded and padded < 2


@pytest.mark.parametrize(
    ("name", "workers"),
    [("plain", 0), pytest.param("zstd", 0, marks=NEEDS_ZSTD), ("gz", 2), ("plain", 2)],
)
@pytest.mark.slow
def test_exact_resume_from_every_batch(peer, name, workers):
    stream = mds_stream(peer["root"] / name, shuffle_buffer=24, seed=1)
    stream.__getitems__([0, 40, 89])  # files opened here, then workers forked: own handles

    def make() -> StreamLoader:
        return StreamLoader(stream, batch_size=7, collate_fn=list, num_workers=workers, seed=2)

    ref = assert_resume_equivalence(make, num_items=16, cleanup=lambda lo: lo.shutdown())
    first_epoch = [_index(s) for b in ref[:12] for s in b]  # 12 x 7 of the 90 rows
    assert len(set(first_epoch)) == 84 and set(first_epoch) <= set(range(90))


# ---------------------------------------------------------------------- the reader
@NEEDS_ZSTD
def test_reader_pickles_without_its_caches_and_reads_the_same(peer):
    reader = MDSReader(peer["root"] / "zstd")
    shard = reader.shards[2]
    first = reader.take(shard, np.array([3, 0, 3]))
    assert reader._unzipped and reader._offsets
    clone = pickle.loads(pickle.dumps(reader))
    assert not clone._unzipped and not clone._offsets
    for a, b in zip(first, clone.take(shard, np.array([3, 0, 3])), strict=True):
        _same(a, b, "clone")
    _same(first[0], first[2], "repeat")
    ranged = list(reader(shard, 1, None))
    assert len(ranged) == reader.count(shard) - 1
    for a, b in zip(ranged, reader.take(shard, np.arange(1, reader.count(shard))), strict=True):
        _same(a, b, "range form")


def test_count_rows_and_version_come_from_the_index(peer):
    reader = MDSReader(peer["root"] / "plain" / "index.json")
    with open(peer["root"] / "plain" / "index.json") as f:
        index = json.load(f)
    assert reader.rows == [s["samples"] for s in index["shards"]]
    assert [reader.count(s) for s in reader.shards] == reader.rows
    sha1 = index["shards"][0]["raw_data"]["hashes"]["sha1"]
    assert (
        reader.version(reader.shards[0]) == f"{index['shards'][0]['raw_data']['bytes']}:sha1={sha1}"
    )
    # without recorded hashes: the file's own identity (size, mtime, edge hash)
    zreader = MDSReader(peer["root"] / "zstd")
    assert zreader.version(zreader.shards[0]).startswith(str(os.path.getsize(zreader.shards[0])))


def test_all_io_goes_through_open_file(peer):
    opened: list[str] = []

    def tracking_open(name: str) -> Any:
        opened.append(name)
        return open_local(name)

    stream = mds_stream(peer["root"] / "gz", open_file=tracking_open)
    stream.__getitems__([0, 50, 89])
    assert opened[0].endswith("index.json") and all(n.endswith(".mds.gz") for n in opened[1:])
    assert len(opened) >= 3


# ---------------------------------------------------------------------- refusals and damage
def _copy(peer: dict[str, Any], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(peer["root"] / name, tmp_path / name))


def test_pkl_columns_are_refused_by_name(peer, tmp_path):
    root = _copy(peer, "plain", tmp_path)
    index = json.loads((root / "index.json").read_text())
    for s in index["shards"]:
        s["column_encodings"][s["column_names"].index("meta")] = "pkl"
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"column 'meta' is encoded 'pkl'.*arbitrary code"):
        mds_stream(root)


def test_a_truncated_shard_is_a_source_error_naming_it(peer, tmp_path):
    root = _copy(peer, "plain", tmp_path)
    shard = root / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-10])
    stream = mds_stream(root)
    first = stream.rows[0]
    stream.__getitems__([0])  # other shards still read
    with pytest.raises(SourceError, match="shard.00001.mds"):
        stream.__getitems__([first])


@NEEDS_ZSTD
def test_a_damaged_compressed_shard_is_a_source_error_naming_it(peer, tmp_path):
    root = _copy(peer, "zstd", tmp_path)
    shard = root / "shard.00000.mds.zstd"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 :] = b"\0" * (len(data) - len(data) // 2)
    shard.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"shard\.00000\.mds\.zstd"):
        mds_stream(root)[0]


def test_zstd_without_zstandard_names_the_install(peer, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"pip install \"meshfeed\[zstd\]\""):
        mds_stream(peer["root"] / "zstd")[0]


def test_an_unknown_shard_or_index_version_is_refused(peer, tmp_path):
    reader = MDSReader(peer["root"] / "plain")
    with pytest.raises(KeyError, match="not a shard of the MDS dataset"):
        reader.take("elsewhere.mds", np.array([0]))
    with pytest.raises(IndexError, match="out of range"):
        reader.take(reader.shards[0], np.array([reader.rows[0]]))
    root = _copy(peer, "plain", tmp_path)
    (root / "index.json").write_text(json.dumps({"version": 1, "shards": []}))
    with pytest.raises(ValueError, match="not an MDS index.json of version 2"):
        MDSReader(root)
    with pytest.raises(SourceError, match="cannot read MDS index"):
        MDSReader(tmp_path / "missing")


@NEEDS_HTTP
@pytest.mark.parametrize("name", ["plain", ZSTD])
def test_a_dataset_read_over_http_byte_ranges_is_the_same(peer, name):
    expected = peer["expected"][name]
    with serve(str(peer["root"])) as (base, log):
        stream = mds_stream(f"{base}/{name}", shuffle_buffer=30)
        got = [s for b in StreamLoader(stream, batch_size=9, collate_fn=list) for s in b]
        assert len(got) == 90
        for s in got:
            _same(s, expected[_index(s)], f"{name} over HTTP")
        assert all("bytes=" in r or r.startswith("HEAD") for r in log[1:])  # log[0]: the index


def test_a_damaged_sample_is_a_source_error_naming_shard_row_and_column(peer, tmp_path):
    root = _copy(peer, "plain", tmp_path)
    reader = MDSReader(root)
    shard = reader.shards[0]
    offsets = reader._layout(reader._info(shard))
    data = bytearray(Path(shard).read_bytes())
    # sample 1: the 'any' column (ndarray, dynamic dtype) comes first after the size header;
    # an unknown dtype code there cannot be decoded
    nvar = sum(s is None for s in reader._info(shard).sizes)
    data[int(offsets[1]) + 4 * nvar] = 250
    # sample 2: a variable size that overruns the sample
    data[int(offsets[2]) : int(offsets[2]) + 4] = np.uint32(10**6).tobytes()
    Path(shard).write_bytes(bytes(data))
    fresh = MDSReader(root)
    assert _index(fresh.take(shard, np.array([0]))[0]) == 0
    with pytest.raises(SourceError, match=r"column 'any' \(ndarray\) of sample 1 .*shard\.00000"):
        fresh.take(shard, np.array([1]))
    with pytest.raises(SourceError, match=r"sample 2 of MDS shard .*shard\.00000.* do not add up"):
        fresh.take(shard, np.array([2]))


def _index_entry() -> dict[str, Any]:
    """One well-formed shard entry of an MDS index.json (two columns)."""
    return {
        "version": 2, "format": "mds", "samples": 5, "compression": None, "hashes": [],
        "column_names": ["id", "text"], "column_encodings": ["int64", "str"],
        "column_sizes": [8, None], "size_limit": 1 << 26,
        "raw_data": {"basename": "shard.00000.mds", "bytes": 100, "hashes": {}},
        "zip_data": None,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda index: index.__setitem__("shards", None), r"'shards': None, not a list"),
        (lambda index: index["shards"][0].pop("column_sizes"), r"must be lists"),
        (
            lambda index: index["shards"][0]["column_encodings"].pop(),
            r"2 column_names, 1 column_enc",
        ),
        (lambda index: index["shards"][0].__setitem__("samples", "ten"), r"invalid literal"),
        (lambda index: index["shards"].__setitem__(0, 3), r"shard entry 0 is malformed \(3 is not"),
    ],
)
def test_a_malformed_shard_entry_of_an_mds_index_is_a_source_error_naming_it(tmp_path, edit, why):
    # These were a bare KeyError, TypeError or a zip() ValueError naming neither the file nor
    # the entry. (No MosaicML needed: the index is parsed when the reader is made.)
    index = {"version": 2, "shards": [_index_entry()]}
    edit(index)
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=why):
        MDSReader(tmp_path)
