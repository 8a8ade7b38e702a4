"""HybridCPDataLoader refuses inputs Megatron's wrapper would garble: on the rank that has them,
with every rank of the DP group raising at the same batch (real gloo ranks)."""

from __future__ import annotations

import math

import pytest
import torch

from meshfeed.balance.megatron import HybridCPDataLoader
from tests.dist_utils import run_distributed


def _sample(tokens: torch.Tensor, cu: list[int], **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"tokens": tokens, "labels": tokens + 1000, **extra, "cu_seqlens": torch.tensor(cu)}


def _next(batch: list[dict[str, torch.Tensor]], **kw: object) -> object:
    return next(HybridCPDataLoader(iter([batch]), max_seqlen_per_dp_cp_rank=64, **kw))


# -- every DP replica must send the same key layout -------------------------------------------


def _replica_sample(rank: int, mode: str) -> dict[str, torch.Tensor]:
    """DP 2 x CP 1: replica 0 holds four 10-token documents, replica 1 one empty sample, so
    two documents move from rank 0 to rank 1."""
    tokens = torch.arange(40) if rank == 0 else torch.arange(0)
    cu = [0, 10, 20, 30, 40] if rank == 0 else [0, 0]
    if mode == "order" and rank == 1:
        return {"labels": tokens + 1000, "tokens": tokens, "cu_seqlens": torch.tensor(cu)}
    sample = _sample(tokens, cu)
    if mode == "extra" and rank == 1:
        sample["loss_mask"] = torch.ones(0)
    if mode == "dtype" and rank == 1:
        sample["tokens"] = sample["tokens"].to(torch.int32)
    return sample


def _layouts(rank: int, world: int, mode: str) -> object:
    it = HybridCPDataLoader(
        iter([[_replica_sample(rank, mode)]]), max_seqlen_per_dp_cp_rank=64, timeout=60
    )
    try:
        samples, _ = next(it)
    except ValueError as e:
        return str(e)
    return {g: {k: v.tolist() for k, v in doc.items()} for g, doc in samples.items()}


@pytest.mark.slow
def test_replicas_with_keys_in_another_order_get_each_document_unchanged():
    got = run_distributed(_layouts, 2, "order", timeout=120.0)
    for out in got:
        assert isinstance(out, dict), out
        for g, doc in out.items():
            assert doc["tokens"] == list(range(10 * g, 10 * g + 10)), (g, doc)
            assert doc["labels"] == [t + 1000 for t in doc["tokens"]], (g, doc)
    assert list(got[1][1]) == ["labels", "tokens"], "a rank's documents keep its own key order"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "rank1"),
    [
        ("extra", "labels:torch.int64, loss_mask:torch.float32, tokens:torch.int64"),
        ("dtype", "labels:torch.int64, tokens:torch.int32"),
    ],
)
def test_replicas_with_different_keys_or_dtypes_are_refused_on_every_rank(mode, rank1):
    for out in run_distributed(_layouts, 2, mode, timeout=120.0):
        assert isinstance(out, str), out
        assert "different keys or dtypes" in out, out
        assert "DP rank 0 (rank 0): labels:torch.int64, tokens:torch.int64" in out, out
        assert f"DP rank 1 (rank 1): {rank1}" in out, out


# -- cu_seqlens must describe the whole sample --------------------------------------------------


@pytest.mark.parametrize("cu", [[0, 6, 4, 10], [2, 5, 10], [0, 5, 14], []])
def test_cu_seqlens_that_repeat_or_lose_tokens_are_refused(cu):
    with pytest.raises(
        ValueError, match=r"cu_seqlens must rise from 0 to at most the sample length 10"
    ):
        _next([_sample(torch.arange(10), cu)])


def _bad_cu_on_rank_1(rank: int, world: int) -> list[str]:
    """Rank 1's first batch has a cu_seqlens whose documents overlap; the second batch is fine
    on both. Each rank records what every next() gave, catching the errors."""
    good = _sample(torch.arange(8) + 100 * rank, [0, 4, 8])
    first = _sample(torch.arange(10), [0, 6, 4, 10]) if rank == 1 else good
    it = HybridCPDataLoader(iter([[first], [good]]), max_seqlen_per_dp_cp_rank=64, timeout=60)
    out = []
    for _ in range(2):
        try:
            samples, _ = next(it)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append(f"ok {sorted(samples)}")
    return out


@pytest.mark.slow
def test_a_bad_cu_seqlens_on_one_rank_stops_every_rank_at_that_batch():
    first, second = zip(*run_distributed(_bad_cu_on_rank_1, 2, timeout=120.0), strict=True)
    assert "failed its checks there" in first[0], first[0]
    assert first[1].startswith("cu_seqlens must rise from 0 to at most the sample length 10")
    assert "[0, 6, 4, 10]" in first[1]
    # Every rank skipped the same batch: the next one is exchanged as usual.
    assert all(s.startswith("ok ") for s in second), second


# -- clear errors for values Megatron's wrapper cannot take ------------------------------------


def test_samples_of_one_batch_with_different_dtypes_are_refused_by_name():
    t = torch.arange(10)
    with pytest.raises(ValueError, match=r"sample 0: .*tokens:torch.int64; sample 1: .*int32"):
        _next([_sample(t, [0, 10]), _sample(t.to(torch.int32), [0, 10])])


def test_samples_of_one_batch_with_different_keys_are_refused_by_name():
    t = torch.arange(10)
    with pytest.raises(ValueError, match=r"sample 1: .*loss_mask:torch.float32"):
        _next([_sample(t, [0, 10]), _sample(t, [0, 10], loss_mask=torch.ones(10))])


def test_a_list_value_is_refused_by_name():
    with pytest.raises(TypeError, match=r"sample\['tokens'\] of packed sample 0 is a list"):
        _next([{"tokens": list(range(10)), "cu_seqlens": torch.tensor([0, 10])}])


def test_a_value_that_is_not_1d_is_refused_by_name():
    sample = {"tokens": torch.arange(10).reshape(1, 10), "cu_seqlens": torch.tensor([0, 10])}
    with pytest.raises(ValueError, match=r"sample\['tokens'\] .* has shape \(1, 10\)"):
        _next([sample])


@pytest.mark.parametrize("timeout", [0, -5, math.nan])
def test_a_timeout_that_is_not_positive_is_refused_at_construction(timeout):
    with pytest.raises(ValueError, match="timeout must be positive seconds"):
        HybridCPDataLoader(iter([]), max_seqlen_per_dp_cp_rank=64, timeout=timeout)


@pytest.mark.parametrize("timeout", ["x", None, True])
def test_a_timeout_that_is_not_a_number_is_refused_at_construction(timeout):
    with pytest.raises(TypeError, match="timeout must be positive seconds as a number"):
        HybridCPDataLoader(iter([]), max_seqlen_per_dp_cp_rank=64, timeout=timeout)
