"""Malformed inputs to pack_documents and BalancedBatches are refused by name, not wrapped or
reported in numpy's words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshfeed.balance import BalancedBatches, CostModel, pack_documents
from tests.dist_utils import run_distributed

S2 = CostModel(quadratic=1.0)
A, B = np.array([5, 6, 7]), np.array([8, 9])


# ------------------------------------------------------------------ pack_documents: mixed lists
@pytest.mark.parametrize(
    "docs",
    [
        [(0, A), B],  # a 2-token array unpacks as a "pair"
        [(0, A), A],
        [(0, A), torch.tensor([8, 9])],
        [(0, A), [8, 9]],
        [(0, A), 8],
    ],
    ids=["pair-then-2-array", "pair-then-3-array", "pair-then-tensor", "pair-then-list", "int"],
)
def test_pack_documents_refuses_a_plain_document_among_pairs_naming_it(docs):
    with pytest.raises(TypeError, match=r"item 1 of the documents is .*item 0 is a \(corpus_id"):
        pack_documents(docs)


@pytest.mark.parametrize("first", [A, torch.tensor([5, 6, 7]), [5, 6, 7]], ids=repr)
@pytest.mark.parametrize("pair", [(1, B), (1, [8]), (1, torch.tensor([8, 9]))], ids=repr)
def test_pack_documents_refuses_a_pair_among_plain_documents_naming_it(first, pair):
    with pytest.raises(TypeError, match=r"item 1 of the documents is a tuple of 2 .* pair, but"):
        pack_documents([first, pair])


@pytest.mark.parametrize(
    ("cid", "what"),
    [
        ("7", "a str"),
        (7.0, "a float"),
        (True, "a bool"),
        (None, "a NoneType"),
        (np.float32(7), "a float32"),
        (torch.tensor(7.0), "a 0-D tensor"),
    ],
)
def test_pack_documents_refuses_a_corpus_id_that_is_not_an_int(cid, what):
    with pytest.raises(TypeError, match=f"the corpus id of item 1 is {what}"):
        pack_documents([(0, A), (cid, B)])


@pytest.mark.parametrize("cid", [2**63, np.uint64(2**64 - 1), -(2**63) - 1])
def test_pack_documents_refuses_a_corpus_id_past_int64(cid):
    with pytest.raises(ValueError, match=f"the corpus id of item 1 is {int(cid)}, outside int64"):
        pack_documents([(0, A), (cid, B)])


def test_pack_documents_names_a_2d_document_and_its_index():
    grid = np.zeros((2, 3), np.int64)
    with pytest.raises(ValueError, match=r"\(got shape \(2, 3\)\): item 1 of the documents is a"):
        pack_documents([A, grid])
    with pytest.raises(ValueError, match=r"\(got shape \(2, 3\)\): the tokens of item 1 are a"):
        pack_documents([(0, A), (1, grid)])


@pytest.mark.parametrize("docs", [[A, "hello"], ["hi", A], [(0, A), "hi"]], ids=repr)
def test_pack_documents_refuses_text_naming_it(docs):
    k = next(i for i, d in enumerate(docs) if isinstance(d, str))
    with pytest.raises(TypeError, match=f"item {k} of the documents is a str .*tokenize"):
        pack_documents(docs)


def test_pack_documents_refuses_a_tuple_that_is_not_a_pair():
    with pytest.raises(TypeError, match=r"item 1 of the documents is a tuple of 3 element"):
        pack_documents([(0, A), (1, B, 2)])


def test_pack_documents_keeps_accepting_every_int_kind_of_corpus_id():
    ids = [0, np.int32(-4), np.uint64(2**63 - 1), torch.tensor(9), np.array(-(2**63))]
    docs = [(i, np.arange(k + 2)) for k, i in enumerate(ids)]
    out = pack_documents(docs)
    assert out["document_ids"].dtype == torch.int64
    assert out["document_ids"].tolist() == [0, -4, 2**63 - 1, 9, -(2**63)]
    plain = pack_documents([d for _, d in docs])
    assert all(torch.equal(out[k], plain[k]) for k in plain)


# ------------------------------------------------------------------ BalancedBatches: uint64 ids
WIDE = 2**63 + 5  # a uint64 corpus id (e.g. a hash) that int64 would wrap to -(2**63) + 5


def _sample(ids) -> dict:
    docs = [10_000 * (d + 1) + np.arange(3 + 9 * d) for d in range(len(ids))]
    sample = pack_documents(docs)
    sample["document_ids"] = ids
    return sample


@pytest.mark.parametrize(
    "ids",
    [
        np.array([1, WIDE, 3], np.uint64),
        torch.tensor(np.array([1, WIDE, 3], np.uint64)),
    ],
    ids=["numpy", "torch"],
)
@pytest.mark.parametrize(
    ("policy", "max_tokens"),
    [("refuse", 64), ("refuse", 8), ("split", 8)],  # wrapped silently / named wrapped / failed
)
def test_balanced_batches_refuse_a_uint64_id_past_int64_instead_of_wrapping_it(
    ids, policy, max_tokens
):
    it = BalancedBatches([_sample(ids)], max_tokens=max_tokens, cost=S2, long_documents=policy)
    with it, pytest.raises(ValueError, match=f"document 1 of rank 0's sample has corpus id {WIDE}"):
        list(it)


def test_balanced_batches_carry_uint64_ids_within_int64_as_before():
    ids = [7, 2**63 - 1, 0]
    with BalancedBatches([_sample(np.array(ids, np.uint64))], max_tokens=64, cost=S2) as it:
        wide = list(it)
    with BalancedBatches([_sample(torch.tensor(ids))], max_tokens=64, cost=S2) as it:
        narrow = list(it)
    assert [s["document_ids"].tolist() for s in wide] == [
        s["document_ids"].tolist() for s in narrow
    ]
    assert {i for s in wide for i in s["document_ids"].tolist()} == set(ids)
    assert all(s["document_ids"].dtype == torch.int64 for s in wide)


def test_balanced_batches_still_carry_negative_int64_ids():
    ids = [-(2**63), -3, 2**63 - 1]
    with BalancedBatches([_sample(torch.tensor(ids))], max_tokens=64, cost=S2) as it:
        got = {i for s in it for i in s["document_ids"].tolist()}
    assert got == set(ids)


def _wide_on_rank_1(rank: int, world: int) -> str:
    import torch.distributed as dist

    ids = np.array([1, WIDE if rank == 1 else 2, 3], np.uint64)
    inner = [_sample(ids)]
    try:
        with BalancedBatches(inner, max_tokens=32, cost=S2, group=dist.group.WORLD) as it:
            list(it)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_every_rank_refuses_a_wide_id_of_one_rank_alike_without_hanging():
    messages = run_distributed(_wide_on_rank_1, 2, timeout=300.0)
    assert messages[0] == messages[1]
    assert f"document 1 of rank 1's sample has corpus id {WIDE}" in messages[0]


def _bad_on_rank_1(rank: int, world: int) -> tuple[list[str], list[int]]:
    """Two samples per rank; rank 1's first one names 2 corpus ids for its 3 documents. Every
    rank catches the error and goes on, as a loop that logs and continues would."""
    import torch.distributed as dist

    first = _sample(np.array([1, 2, 3], np.int64))
    if rank == 1:
        first["document_ids"] = first["document_ids"][:2]
    second = _sample(np.array([4, 5, 6], np.int64))
    errors: list[str] = []
    with BalancedBatches([first, second], max_tokens=32, cost=S2, group=dist.group.WORLD) as it:
        try:
            next(it)
        except ValueError as e:
            errors.append(str(e))
        ids = [i for s in it for i in s["document_ids"].tolist()]
    return errors, ids


@pytest.mark.slow
def test_a_sample_refused_on_one_rank_stops_every_rank_at_that_batch_without_waiting():
    # Before, rank 1 raised before the all-gather and rank 0 waited in it (300 s by default);
    # rank 1's next all-gather then paired its second sample with rank 0's first.
    got = run_distributed(_bad_on_rank_1, 2, timeout=120.0)
    (errors0, ids0), (errors1, ids1) = got
    assert len(errors1) == 1 and "holds 2 ids for 3 documents" in errors1[0]
    assert len(errors0) == 1 and "rank(s) [1] failed its checks there" in errors0[0]
    assert sorted(ids0 + ids1) == [4, 4, 5, 5, 6, 6]  # both ranks' second samples, together
