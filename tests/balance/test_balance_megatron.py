"""HybridCPDataLoader: Megatron's wrapper's input and output, on gloo ranks and in one process."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshfeed.balance.megatron import HybridCPDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import megatron_hybrid_cp as example


@pytest.mark.parametrize("world", [2, 4])
def test_the_megatron_example_runs_every_document_once_on_its_cp_ranks(world):
    steps = 3
    results = example.main(["--world", str(world), "--steps", str(steps)])
    groups = [r["groups"] for r in results]
    assert all(g == groups[0] for g in groups), "every rank holds the same groups"
    dp = world // 2
    for step in range(steps):
        docs = [d for r in range(dp) for d in example.documents(example.packed_samples(r, step))]
        runs = Counter()
        cp_of: dict[int, set[int]] = {}
        for r in results:
            for s, gid, cp in r["docs"]:
                if s == step:
                    runs[gid] += 1
                    cp_of.setdefault(gid, set()).add(cp)
        assert sorted(runs) == list(range(len(docs))), "every document of the global batch runs"
        for gid, n in runs.items():
            assert cp_of[gid] == {n}, f"document {gid} runs on {n} ranks, each with that CP size"
            assert -(-docs[gid]["tokens"].numel() // n) <= example.MAX_SEQLEN_PER_RANK
    total = sum(
        d["tokens"].numel()
        for step in range(steps)
        for r in range(dp)
        for d in example.documents(example.packed_samples(r, step))
    )
    shares = sum(r["tokens"] for r in results)
    assert total <= shares <= total + sum(len(r["docs"]) for r in results)


def test_one_process_gets_every_document_in_one_group():
    batches = [example.packed_samples(0, s) for s in range(2)]
    it = HybridCPDataLoader(iter(batches), SimpleNamespace(max_seqlen_per_dp_cp_rank=4096))
    for batch in batches:
        samples, groups = next(it)
        docs = example.documents(batch)
        assert groups == [[list(range(len(docs)))]]
        for gid, doc in enumerate(docs):
            for key, want in doc.items():
                assert torch.equal(samples[gid][key], want)
    with pytest.raises(StopIteration):
        next(it)


def test_a_document_longer_than_the_budget_on_one_rank_is_refused_by_name():
    batch = example.packed_samples(0, 0)
    it = HybridCPDataLoader(iter([batch]), max_seqlen_per_dp_cp_rank=8)
    with pytest.raises(ValueError, match="raise max_tokens, add ranks, or truncate"):
        next(it)


def test_the_budget_is_required():
    with pytest.raises(ValueError, match="max_seqlen_per_dp_cp_rank"):
        HybridCPDataLoader(iter([]), SimpleNamespace())


def test_a_packed_sample_without_cu_seqlens_is_refused():
    it = HybridCPDataLoader(iter([[{"tokens": torch.arange(4)}]]), max_seqlen_per_dp_cp_rank=64)
    with pytest.raises(ValueError, match="needs 'cu_seqlens'"):
        next(it)


def test_tp_ranks_without_a_data_iterator_get_none_as_in_megatron():
    it = HybridCPDataLoader(None, max_seqlen_per_dp_cp_rank=64)
    assert next(it) == (None, None)
