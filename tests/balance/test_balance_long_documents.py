"""Documents longer than the ranks can hold: refuse (naming the corpus id), truncate, split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshfeed.balance import BalancedBatches, pack_documents, packed_document_loader
from meshfeed.balance.long_documents import fit_lengths, fit_sample, max_document_tokens
from meshfeed.balance.schedule import schedule_documents
from meshfeed.keys import DEFAULT_KEYS
from meshfeed.sources import write_indexed

LONG = 5  # corpus id of the long document


@pytest.fixture
def prefix(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.arange(n, dtype=np.int64) + 1000 * i for i, n in enumerate(rng.integers(5, 40, 12))]
    docs[LONG] = np.arange(500, dtype=np.int64) + 1000 * LONG  # 499 predictions > 128
    write_indexed(tmp_path / "c", docs, np.int32)
    return str(tmp_path / "c")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ranks": 0}, r"num_ranks must be a positive int \(got num_ranks=0\)"),
        ({"num_ranks": 2.0}, r"num_ranks must be a positive int \(got num_ranks=2.0\)"),
        ({"max_tokens": 0}, r"max_tokens must be a positive int \(got max_tokens=0\)"),
        ({"tp": 0}, r"tp must be a positive int \(got tp=0\)"),
    ],
)
def test_max_document_tokens_refuses_a_group_that_is_not_positive_ints(kwargs, message):
    with pytest.raises(ValueError, match=message):
        max_document_tokens(**{"num_ranks": 2, "max_tokens": 100, **kwargs})


def test_max_document_tokens_is_what_the_scheduler_places():
    for ranks, tp, cp_sizes in [
        (1, 1, "any"),
        (3, 1, "any"),
        (6, 2, "any"),
        (8, 1, "pow2_aligned"),
    ]:
        limit = max_document_tokens(num_ranks=ranks, max_tokens=100, cp_sizes=cp_sizes, tp=tp)
        schedule_documents([limit], num_ranks=ranks, max_tokens=100, cp_sizes=cp_sizes, tp=tp)
        with pytest.raises(ValueError, match="more than"):
            schedule_documents(
                [limit + 1], num_ranks=ranks, max_tokens=100, cp_sizes=cp_sizes, tp=tp
            )


def test_fit_lengths_policies():
    assert fit_lengths([3, 10], 4, "refuse").tolist() == [3, 10]
    assert fit_lengths([3, 10], 4, "truncate").tolist() == [3, 4]
    assert fit_lengths([3, 10, 8], 4, "split").tolist() == [3, 4, 4, 2, 4, 4]
    with pytest.raises(ValueError, match="'refuse', 'truncate', 'split'"):
        fit_lengths([1], 4, "drop")


def test_fit_sample_split_keeps_order_and_truncate_keeps_the_head():
    docs = [(7, np.arange(3)), (9, np.arange(100, 111))]
    sample = pack_documents(docs)  # 2 + 10 predictions
    split = fit_sample(sample, DEFAULT_KEYS, 4, "split")
    assert split["cu_seqlens"].tolist() == [0, 2, 6, 10, 12]
    assert torch.equal(split["tokens"], sample["tokens"])  # same tokens, in order
    assert split["document_ids"].tolist() == [7, 9, 9, 9]
    cut = fit_sample(sample, DEFAULT_KEYS, 4, "truncate")
    assert cut["cu_seqlens"].tolist() == [0, 2, 6]
    assert cut["tokens"].tolist() == [0, 1, 100, 101, 102, 103]
    assert cut["labels"].tolist() == [1, 2, 101, 102, 103, 104]
    assert cut["document_ids"].tolist() == [7, 9]


def _run(prefix, policy):
    loader = packed_document_loader(prefix, batch_size=12, mesh={"dp": 1}, seed=0)
    with BalancedBatches(loader, max_tokens=128, long_documents=policy) as it:
        return list(it)


def test_refuse_names_the_corpus_id(prefix):
    with pytest.raises(ValueError, match=rf"corpus document {LONG} has 499 tokens.*'split'"):
        _run(prefix, "refuse")


def test_split_trains_every_token_of_the_long_document_in_order(prefix):
    steps = _run(prefix, "split")
    pieces = []
    for step in steps:
        cu = step["cu_seqlens"].tolist()
        assert len(step["document_ids"]) == len(cu) - 1 and cu[-1] <= 128
        for k, doc in enumerate(step["document_ids"].tolist()):
            if doc == LONG:
                pieces.append(step["tokens"][cu[k] : cu[k + 1]])
    got = torch.cat(sorted(pieces, key=lambda t: int(t[0])))
    assert got.tolist() == list(range(1000 * LONG, 1000 * LONG + 499))
    all_ids = torch.cat([s["document_ids"] for s in steps]).unique().tolist()
    assert all_ids == list(range(12))


def test_truncate_keeps_the_first_tokens(prefix):
    steps = _run(prefix, "truncate")
    long = [
        s["tokens"][s["cu_seqlens"][k] : s["cu_seqlens"][k + 1]]
        for s in steps
        for k, d in enumerate(s["document_ids"].tolist())
        if d == LONG
    ]
    assert len(long) == 1 and long[0].tolist() == list(range(1000 * LONG, 1000 * LONG + 128))


def _two_ranks(rank: int, world: int, prefix: str, policy: str) -> dict:
    import torch.distributed as tdist

    loader = packed_document_loader(prefix, batch_size=6, mesh={"dp": 2}, rank=rank, seed=0)
    try:
        with BalancedBatches(
            loader, max_tokens=64, group=tdist.group.WORLD, long_documents=policy
        ) as it:
            return {
                "steps": [
                    (s["document_ids"], s["tokens"], s["labels"], s["cu_seqlens"]) for s in it
                ]
            }
    except ValueError as e:  # every rank must reach the same verdict: none waits for the other
        return {"error": str(e)}


@pytest.mark.slow
def test_two_gloo_ranks_split_a_long_document_and_refuse_it_alike(prefix):
    from tests.dist_utils import run_distributed

    # 2 ranks x 64 tokens hold 128; corpus document 5 has 499 predictions
    refused = run_distributed(_two_ranks, 2, prefix, "refuse", timeout=240.0)
    assert all(r["error"].startswith(f"corpus document {LONG} has 499 tokens") for r in refused)
    split = run_distributed(_two_ranks, 2, prefix, "split", timeout=240.0)
    pieces, seen = [], set()
    for r in split:
        for ids, tokens, labels, cu in r["steps"]:
            seen |= set(ids.tolist())
            for k, doc in enumerate(ids.tolist()):
                if doc == LONG:
                    span = slice(int(cu[k]), int(cu[k + 1]))
                    pieces.append(tokens[span][labels[span] != -100])  # padding left out
    assert seen == set(range(12))
    # every token of the long document, once (a piece may be zigzag-split over both ranks)
    got = sorted(torch.cat(pieces).tolist())
    assert got == list(range(1000 * LONG, 1000 * LONG + 499))
