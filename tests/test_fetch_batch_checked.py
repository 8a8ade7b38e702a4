"""What the fetcher refuses to serve or survives: a ``fetch_batch`` result without one row per
index (or None), and a bad sample's exception whose ``str()`` itself raises."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from meshfeed import DataLoader
from meshfeed.fetch import Fetcher, SampleError
from meshfeed.tasks import FetchTask


class _Rows:
    def __init__(self, make):
        self.make = make

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return i

    def fetch_batch(self, indices: np.ndarray):
        return self.make(indices)


def _task(n: int = 4) -> FetchTask:
    idx = np.arange(n, dtype=np.int64)
    return FetchTask(epoch=0, step=0, indices=idx, positions=idx)


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda idx: torch.as_tensor(idx[:-1]), r"a batch of shape \(3,\) for 4 indices"),
        (lambda idx: None, "None for 4 indices"),
        (lambda idx: torch.tensor(7), r"a batch of shape \(\) for 4 indices"),
        (lambda idx: idx[:2], r"a batch of shape \(2,\) for 4 indices"),
        (
            lambda idx: {"n": torch.tensor(4), "y": torch.zeros(3, 2), "x": idx[:3]},
            r"'y' of shape \(3, 2\) for 4 indices",
        ),
        (
            lambda idx: {"text": ["a"] * 5, "x": torch.as_tensor(idx[:-1])},
            "'text' as a list of 5 items for 4 indices",
        ),
    ],
)
def test_a_fetch_batch_without_one_row_per_index_is_refused_by_name(make, said):
    with pytest.raises(ValueError, match=rf"_Rows\.fetch_batch returned {said}") as info:
        Fetcher(_Rows(make), seed=0)(_task())
    assert "collating [dataset[i] for i in indices]" in str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda idx: torch.as_tensor(idx),
        lambda idx: {"x": torch.as_tensor(idx), "text": [str(i) for i in idx]},
        # collated sequences are a list of fields, one per position; an empty list none
        lambda idx: {"pair": [torch.as_tensor(idx)] * 2, "empty": [], "n": torch.tensor(4)},
        # a varlen layout: one value has a row per index, the others their own shapes
        lambda idx: {
            "tokens": torch.zeros(11),
            "lengths": torch.as_tensor(idx),
            "cu_seqlens": torch.zeros(len(idx) + 1),
        },
    ],
)
def test_a_fetch_batch_with_one_row_per_index_is_served(make):
    batch, _ = Fetcher(_Rows(make), seed=0)(_task())
    assert batch is not None


def test_the_loader_refuses_a_short_fetch_batch_with_workers():
    loader = DataLoader(_Rows(_short), batch_size=4, seed=0, num_workers=1)
    with pytest.raises(ValueError, match=r"fetch_batch returned a batch of shape \(3,\)"):
        next(iter(loader))
    loader.shutdown()


def _short(idx: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(idx[:-1])


class _StrExplodes(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str exploded")


class _BadSample:
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if i == 2:
            raise _StrExplodes()
        return i


def test_a_sample_error_whose_str_raises_is_substituted_and_recorded(caplog):
    loader = DataLoader(_BadSample(), batch_size=4, seed=0, shuffle=False)
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        batch = next(iter(loader))
    assert len(batch) == 4 and 2 not in batch.tolist()
    failure = loader.stats()["failures"][0]
    assert failure["error"] == "_StrExplodes" and "str() raised RuntimeError" in failure["message"]


def test_a_sample_error_whose_str_raises_is_reported_under_raise():
    loader = DataLoader(_BadSample(), batch_size=4, seed=0, shuffle=False, on_error="raise")
    with pytest.raises(SampleError, match=r"sample 2 .*_StrExplodes: <_StrExplodes, whose str"):
        next(iter(loader))


class _Lying:
    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> int:
        return list(range(50))[i]


def test_an_index_error_below_len_hints_that_len_overstates(caplog):
    loader = DataLoader(_Lying(), batch_size=4, seed=0)
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        for _ in zip(range(10), loader, strict=False):
            pass
    assert "does the dataset's __len__ overstate" in caplog.text


def test_a_loader_over_token_documents_serves_their_varlen_batches(tmp_path):
    """TokenDocuments.fetch_batch gives tokens [sum of lengths], lengths [B] and cu_seqlens
    [B + 1]: a batch of one row per index where it counts, served through the loader."""
    from meshfeed.sources.tokens.indexed_write import write_indexed
    from meshfeed.sources.tokens.windows import TokenDocuments

    corpus = write_indexed(tmp_path / "c", [np.arange(n) for n in (3, 0, 7, 1)], "uint16")
    for workers in (0, 1):
        loader = DataLoader(TokenDocuments(corpus), batch_size=2, seed=0, num_workers=workers)
        batches = list(loader)
        loader.shutdown()
        assert sorted(n for b in batches for n in b["lengths"].tolist()) == [0, 1, 3, 7]
        assert sum(b["tokens"].numel() for b in batches) == 11
