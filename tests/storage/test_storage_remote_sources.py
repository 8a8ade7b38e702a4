"""Token corpora and Parquet files read from moto's S3 server through the shard cache."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed import DataLoader
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows
from tests.dist_utils import run_distributed
from tests.storage.conftest import S3, use_env_endpoint


def _corpus(tmp: Path, lengths: list[int], seed: int = 0) -> tuple[Path, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 60_000, n).astype(np.uint16) for n in lengths]
    write_indexed(tmp / "local" / "c", docs, "uint16")
    return tmp / "local" / "c", docs


def _upload_corpus(s3: S3, prefix: Path, key: str) -> str:
    for ext in (".idx", ".bin"):
        s3.put(key + ext, Path(str(prefix) + ext).read_bytes())
    return s3.url(key)


def test_a_corpus_opens_from_a_url_prefix_like_its_local_copy(s3: S3, tmp_path: Path) -> None:
    local, docs = _corpus(tmp_path, [30, 17, 52])
    url = _upload_corpus(s3, local, "corpora/c")
    remote = TokenCorpus.open(url, cache_dir=tmp_path / "cache", storage_options=s3.options)
    assert remote.fingerprint == TokenCorpus.open(local).fingerprint
    assert [remote.document(i).tolist() for i in range(3)] == [d.tolist() for d in docs]
    assert s3.proxy.counts["GET"] == 2  # .idx and .bin, whole
    clone = pickle.loads(pickle.dumps(remote))  # a worker re-resolves through its own cache
    assert clone.fingerprint == remote.fingerprint and s3.proxy.counts["GET"] == 2
    docs_view = TokenDocuments(url, cache_dir=tmp_path / "cache", storage_options=s3.options)
    assert docs_view.lengths.tolist() == [30, 17, 52]


def test_a_bin_url_opens_the_pair_and_a_file_url_needs_no_cache(s3: S3, tmp_path: Path) -> None:
    local, _ = _corpus(tmp_path, [40])
    url = _upload_corpus(s3, local, "corpora/d")
    by_bin = TokenCorpus.open(
        url + ".bin", cache_dir=tmp_path / "cache", storage_options=s3.options
    )
    assert by_bin.num_tokens == 40
    by_file_url = TokenCorpus.open(f"file://{local}")
    assert by_file_url.fingerprint == by_bin.fingerprint


def _rank_batches(
    rank: int, world: int, corpus: str, remote: dict[str, Any], num_workers: int
) -> tuple[str, list[list[list[int]]]]:
    windows = TokenWindows(corpus, seq_len=8, **remote)
    loader = DataLoader(
        windows,  # type: ignore[arg-type]
        batch_size=2,
        mesh={"dp": world},
        rank=rank,
        seed=3,
        num_workers=num_workers,
    )
    with loader:
        return loader.fingerprint, [b.tolist() for b in loader]


@pytest.mark.slow
def test_two_gloo_ranks_with_two_workers_read_a_corpus_from_s3_like_the_local_copy(
    s3: S3, tmp_path: Path
) -> None:
    local, _ = _corpus(tmp_path, [120, 77, 203, 64])
    url = _upload_corpus(s3, local, "corpora/train")
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    results = run_distributed(_rank_batches, 2, url, remote, 2)
    expected = [_rank_batches(r, 2, str(local), {}, 0) for r in range(2)]
    assert results == expected  # same fingerprint, same batches, rank by rank
    rows = [tuple(w) for _, batches in results for b in batches for w in b]
    assert len(rows) == len(set(rows)), "no window read twice in the epoch"
    windows = TokenWindows(local, seq_len=8)
    assert len(rows) == len(windows) - len(windows) % 4  # every full global batch, once
    assert set(rows) <= {tuple(windows[i].tolist()) for i in range(len(windows))}
    assert s3.proxy.counts["GET"] == 2  # one download per file for the node: 2 ranks x 2 workers


def test_parquet_files_from_a_url_folder(s3: S3, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    from meshfeed.sources.parquet import ParquetSource

    (tmp_path / "pq").mkdir()
    for i in range(2):
        table = pa.table({"x": list(range(i * 10, i * 10 + 10))})
        pq.write_table(table, tmp_path / "pq" / f"part-{i}.parquet", row_group_size=4)
        s3.put(f"pq/part-{i}.parquet", (tmp_path / "pq" / f"part-{i}.parquet").read_bytes())
    src = ParquetSource(s3.url("pq"), cache_dir=tmp_path / "cache", storage_options=s3.options)
    local = ParquetSource(tmp_path / "pq")
    assert len(src) == 20 and src.fingerprint == local.fingerprint
    assert src.__getitems__([0, 19, 7]) == local.__getitems__([0, 19, 7])
    one = ParquetSource(
        [s3.url("pq/part-1.parquet")], cache_dir=tmp_path / "cache", storage_options=s3.options
    )
    assert [r["x"] for r in one.__getitems__([0, 9])] == [10, 19]
    gets = s3.proxy.object_gets  # each file once (the folder listing aside)
    assert sorted(gets.values()) == [1, 1] and all(p.endswith(".parquet") for p in gets)


def test_convert_writes_a_corpus_to_a_url_and_leaves_it_cached(s3: S3, tmp_path: Path) -> None:
    from meshfeed.sources.converters.convert import convert

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n{"text": "object storage"}\n')
    local = convert(src, tmp_path / "local" / "c", tokenizer="bytes", progress=False)
    url = s3.url("out/corpus")
    cache = tmp_path / "cache"
    written = convert(
        src, url, tokenizer="bytes", progress=False, cache_dir=cache, storage_options=s3.options
    )
    assert written.fingerprint == local.fingerprint
    for ext in (".bin", ".idx"):
        body = s3.client.get_object(Bucket=s3.bucket, Key="out/corpus" + ext)["Body"].read()
        assert body == Path(str(local.prefix) + ext).read_bytes()
    assert not s3.proxy.object_gets  # uploaded and adopted: the node never downloads it
    assert not list(cache.glob(".upload-*"))  # the staging folder is gone
    fresh = TokenCorpus.open(url, cache_dir=tmp_path / "other", storage_options=s3.options)
    assert fresh.fingerprint == local.fingerprint


def test_the_convert_command_takes_a_url_output(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshfeed.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "abc"}\n')
    use_env_endpoint(s3, monkeypatch)
    url = s3.url("cli/corpus")
    argv = ["convert", str(src), "-o", url, "--tokenizer", "bytes", "-q"]
    assert main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 0
    assert s3.proxy.counts["PUT"] == 2
    corpus = TokenCorpus.open(url, cache_dir=tmp_path / "c2", storage_options=s3.options)
    assert corpus.document(0).tolist() == list(b"abc")


@pytest.mark.slow
def test_parquet_files_read_by_ranges_give_the_same_rows(s3: S3, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    from meshfeed.sources.parquet import ParquetSource
    from meshfeed.storage import RangedFile, RangeReads

    rng = np.random.default_rng(0)
    (tmp_path / "pq").mkdir()
    for i in range(2):
        n = 20_000
        table = pa.table({"x": np.arange(i * n, (i + 1) * n), "y": rng.random(n)})
        table = table.append_column("s", pa.array([f"row {k}" for k in range(n)]))
        pq.write_table(table, tmp_path / "pq" / f"part-{i}.parquet", row_group_size=1000)
        s3.put(f"pq/part-{i}.parquet", (tmp_path / "pq" / f"part-{i}.parquet").read_bytes())
    size = (tmp_path / "pq" / "part-0.parquet").stat().st_size
    remote = {"cache_dir": tmp_path / "cache", "storage_options": s3.options}
    reads = RangeReads(block_size=16 << 10, max_blocks=8)
    src = ParquetSource(s3.url("pq"), ranged=reads, cache_row_groups=2, **remote)
    local = ParquetSource(tmp_path / "pq")
    assert all(isinstance(p, RangedFile) for p in src.paths)
    assert len(src) == len(local) and src.fingerprint == local.fingerprint
    cache = src._shard_cache
    assert cache is not None
    before = cache.stats()["bytes"]
    assert src[12_345] == local[12_345]  # one row group of twenty: a fraction of the file
    assert 0 < cache.stats()["bytes"] - before < size // 4
    idx = rng.permutation(len(local))[:60].tolist()
    assert src.__getitems__(idx) == local.__getitems__(idx)
    assert not list((tmp_path / "cache").glob("*/part-*.parquet"))  # nothing cached whole
    clone = pickle.loads(pickle.dumps(src))  # a worker: its own blocks and handles
    assert clone.__getitems__(idx[:20]) == local.__getitems__(idx[:20])
    # by itself where a file exceeds the cache limit; the default otherwise stays whole
    auto = ParquetSource(s3.url("pq/part-1.parquet"), cache_limit=size // 2, **remote)
    assert isinstance(auto.paths[0], RangedFile) and auto[5]["x"] == 20_005
    whole = ParquetSource(s3.url("pq/part-1.parquet"), **remote)
    assert isinstance(whole.paths[0], Path) and whole[5] == auto[5]


def test_a_corpus_rewritten_in_the_bucket_is_not_served_from_the_old_cached_copy(
    s3: S3, tmp_path: Path
) -> None:
    old, _ = _corpus(tmp_path / "old", [30, 17, 52], seed=0)
    url = _upload_corpus(s3, old, "corpora/r")
    cache = tmp_path / "cache"
    TokenCorpus.open(url, cache_dir=cache, storage_options=s3.options).document(0)
    new, docs = _corpus(tmp_path / "new", [30, 17, 52], seed=1)  # same sizes, other tokens
    _upload_corpus(s3, new, "corpora/r")
    again = TokenCorpus.open(url, cache_dir=cache, storage_options=s3.options)  # a new job
    assert [again.document(i).tolist() for i in range(3)] == [d.tolist() for d in docs]
