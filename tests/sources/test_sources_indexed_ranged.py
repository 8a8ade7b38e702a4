"""Token corpora whose ``.bin`` is read by ranged GETs from moto's S3 server, against the local copy."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed import DataLoader
from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_ranged import RangedTokens
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows
from meshfeed.storage import RangeReads, TooLargeForCache
from tests.storage.conftest import S3, moto_endpoint, s3  # noqa: F401  (fixtures)


def _corpus(tmp: Path, dtype: str, n_docs: int = 40, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    high = 60_000 if dtype == "uint16" else 2**31 - 1
    docs = [rng.integers(0, high, int(rng.integers(1, 400))).astype(dtype) for _ in range(n_docs)]
    write_indexed(tmp / "local" / "c", docs, dtype)
    return tmp / "local" / "c"


def _upload(s3: S3, prefix: Path, key: str = "corpora/c") -> str:  # noqa: F811
    for ext in (".idx", ".bin"):
        s3.put(key + ext, Path(str(prefix) + ext).read_bytes())
    return s3.url(key)


def _remote(s3: S3, tmp: Path, **more: Any) -> dict[str, Any]:  # noqa: F811
    return {"cache_dir": tmp / "cache", "storage_options": s3.options, **more}


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
@pytest.mark.parametrize("block_size", [999, 4096])
def test_ranged_windows_are_the_local_windows(
    s3: S3,  # noqa: F811
    tmp_path: Path,
    dtype: str,
    block_size: int,
) -> None:
    local = _corpus(tmp_path, dtype)
    url = _upload(s3, local)
    reads = RangeReads(block_size=block_size, max_blocks=3)
    rng = np.random.default_rng(1)
    for seq_len in (5, 64, 700):  # windows inside one block, across two, across many
        for out in (torch.int64, getattr(torch, dtype)):
            mine = TokenWindows(
                url, seq_len=seq_len, dtype=out, **_remote(s3, tmp_path, ranged=reads)
            )
            theirs = TokenWindows(local, seq_len=seq_len, dtype=out)
            assert mine.corpus.ranged and len(mine) == len(theirs)
            idx = rng.permutation(len(theirs))[:32]
            got, want = mine.fetch_batch(idx), theirs.fetch_batch(idx)
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert torch.equal(mine[int(idx[0])], theirs[int(idx[0])])
            assert torch.equal(mine[-1], theirs[-1])
            assert all(
                torch.equal(a, b)
                for a, b in zip(
                    mine.__getitems__(idx[:4]), theirs.__getitems__(idx[:4]), strict=True
                )
            )
    assert not Path(mine.corpus.prefix + ".bin").exists()  # never downloaded whole


def test_a_ranged_read_with_a_narrower_dtype_refuses_ids_it_cannot_hold(
    s3: S3,  # noqa: F811
    tmp_path: Path,
) -> None:
    local = tmp_path / "local" / "c"
    write_indexed(local, [np.arange(100), np.array([70000, 1, 2])], np.int32)
    url = _upload(s3, local)
    windows = TokenWindows(url, seq_len=4, dtype=torch.uint16, **_remote(s3, tmp_path, ranged=True))
    assert windows.fetch_batch(np.array([0, 1])).tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]
    where = r"window 24 \(token 4 of it, 100 of the corpus\) holds token id 70000"
    with pytest.raises(ValueError, match=where):
        windows.fetch_batch(np.array([0, 24]))
    with pytest.raises(ValueError, match=where):
        windows[24]


def test_a_ranged_corpus_reads_documents_and_fingerprints_like_the_local_one(
    s3: S3,  # noqa: F811
    tmp_path: Path,
) -> None:
    local = TokenCorpus.open(_corpus(tmp_path, "uint16"))
    url = _upload(s3, Path(local.prefix))
    remote = TokenCorpus.open(url, **_remote(s3, tmp_path, ranged=RangeReads(block_size=512)))
    assert isinstance(remote.tokens, RangedTokens) and remote.version is not None
    assert remote.fingerprint == local.fingerprint
    for i in (0, 7, len(local) - 1, -1):
        assert np.array_equal(remote.document(i), local.document(i))
    assert np.array_equal(remote.tokens[100:900], local.tokens[100:900])
    assert remote.tokens[5] == local.tokens[5] and len(remote.tokens) == local.num_tokens
    remote.validate()
    mine = TokenDocuments(remote)
    theirs = TokenDocuments(local)
    idx = np.array([3, 0, 39, 12, 12])
    got, want = mine.fetch_batch(idx), theirs.fetch_batch(idx)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(mine.__getitems__(idx), theirs.__getitems__(idx), strict=True)
    )
    assert np.array_equal(mine[5], theirs[5])


def test_windows_within_one_block_cost_one_get(s3: S3, tmp_path: Path) -> None:  # noqa: F811
    local = _corpus(tmp_path, "uint16")
    url = _upload(s3, local)
    windows = TokenWindows(
        url, seq_len=8, **_remote(s3, tmp_path, ranged=RangeReads(block_size=1 << 16))
    )
    cache = windows.corpus._cache
    assert cache is not None
    before, gets = cache.stats()["range_reads"], s3.proxy.counts["GET"]
    for i in range(20):  # twenty windows, all inside the first 64 KiB block
        windows[i]
    windows.fetch_batch(np.arange(20, 40))
    assert cache.stats()["range_reads"] - before == 1 and s3.proxy.counts["GET"] - gets == 1


def test_a_bin_larger_than_the_cache_limit_is_read_by_ranges(
    s3: S3,  # noqa: F811
    tmp_path: Path,
) -> None:
    local = _corpus(tmp_path, "int32")
    url = _upload(s3, local)
    size = Path(str(local) + ".bin").stat().st_size
    limit = size // 2  # room for the .idx, not for the .bin
    auto = TokenWindows(url, seq_len=16, **_remote(s3, tmp_path, cache_limit=limit))
    assert auto.corpus.ranged
    idx = np.arange(len(auto))[::-3]
    assert torch.equal(auto.fetch_batch(idx), TokenWindows(local, seq_len=16).fetch_batch(idx))
    with pytest.raises(TooLargeForCache, match=rf"c.bin is {size} bytes, more than cache_limit"):
        TokenCorpus.open(url, **_remote(s3, tmp_path, cache_limit=limit, ranged=False))
    whole = TokenCorpus.open(url, **_remote(s3, tmp_path, cache_dir=tmp_path / "c2"))
    assert not whole.ranged and isinstance(whole.tokens, np.ndarray)  # the default: whole
    with pytest.raises(TypeError, match="ranged must be"):
        TokenCorpus.open(url, **_remote(s3, tmp_path, ranged="yes"))


def test_a_pickled_ranged_corpus_reopens_by_ranges_and_refuses_a_rewritten_bin(
    s3: S3,  # noqa: F811
    tmp_path: Path,
) -> None:
    local = _corpus(tmp_path, "uint16")
    url = _upload(s3, local)
    windows = TokenWindows(url, seq_len=32, **_remote(s3, tmp_path, ranged=True))
    clone = pickle.loads(pickle.dumps(windows))  # what a spawned worker receives
    assert clone.corpus.ranged and clone.corpus.version == windows.corpus.version
    assert clone.corpus.fingerprint == windows.corpus.fingerprint
    assert torch.equal(clone.fetch_batch(np.array([4, 1])), windows.fetch_batch(np.array([4, 1])))
    other = _corpus(tmp_path / "o", "uint16", seed=5)
    s3.put("corpora/c.bin", Path(str(other) + ".bin").read_bytes())
    with pytest.raises(SourceError, match=r"corpora/c.bin changed: the bucket holds version"):
        pickle.loads(pickle.dumps(windows))


def _batches(windows: TokenWindows, num_workers: int) -> list[list[list[int]]]:
    loader = DataLoader(windows, batch_size=4, seed=3, num_workers=num_workers)  # type: ignore[arg-type]
    with loader:
        return [b.tolist() for b in loader]


@pytest.mark.slow
def test_loader_workers_read_by_ranges_like_the_local_copy(s3: S3, tmp_path: Path) -> None:  # noqa: F811
    local = _corpus(tmp_path, "uint16", n_docs=20)
    url = _upload(s3, local)
    windows = TokenWindows(
        url, seq_len=16, **_remote(s3, tmp_path, ranged=RangeReads(block_size=2048))
    )
    s3.proxy.reset()
    assert _batches(windows, 2) == _batches(TokenWindows(local, seq_len=16), 0)
    # each worker process asked the version once, then read blocks; nothing came whole
    assert s3.proxy.counts["HEAD"] >= 2 and s3.proxy.counts["GET"] >= 2
    assert not Path(windows.corpus.prefix + ".bin").exists()
