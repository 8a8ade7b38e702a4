from __future__ import annotations

import numpy as np
import pytest
import torch

import meshfeed.cli
from meshfeed import DataLoader
from meshfeed.balance import BalancedBatches, CostModel, pack_documents, packed_document_loader
from meshfeed.balance.routing import route_local
from meshfeed.mesh import DataMesh
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments
from meshfeed.testing import assert_resume_equivalence, assert_same, take
from tests.dist_utils import run_distributed
from tests.optional import given, settings, st

from .checks import check_routing

S2 = CostModel(quadratic=1.0)
MESH = {"dp": 2, "cp": 2}  # 4 balanced ranks, each reading its own documents
PER_RANK = 3  # documents per rank per step: a global batch of 12, 4 steps per epoch


def _write_corpus(prefix: str, num_docs: int = 48, seed: int = 0) -> None:
    """Documents whose tokens are unique and consecutive: a label is its token plus one."""
    rng = np.random.default_rng(seed)
    long = rng.random(num_docs) < 0.25
    lengths = np.where(long, rng.integers(130, 300, num_docs), rng.integers(2, 60, num_docs))
    lengths[[5, 17]] = [0, 1]  # documents without a prediction
    docs = [(d + 1) * 1000 + np.arange(n) for d, n in enumerate(lengths.tolist())]
    write_indexed(prefix, docs, np.int32)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("documents") / "corpus")
    _write_corpus(path)
    return path


def _global_batches(prefix: str, world: int = 4) -> list[dict]:
    """The packed global batches, read by one rank (the order does not depend on the DP size)."""
    return list(packed_document_loader(prefix, batch_size=PER_RANK * world, mesh={"dp": 1}))


def _real(step: dict) -> tuple[torch.Tensor, torch.Tensor]:
    keep = step["loss_mask"] > 0
    return step["tokens"][keep], step["labels"][keep]


# ------------------------------------------------------------------------ pack_documents
def test_pack_documents_shifts_labels_and_restarts_positions_per_document():
    out = pack_documents([np.array([5, 6, 7], np.uint16), np.array([8, 9]), np.array([4])])
    assert out["tokens"].tolist() == [5, 6, 8]
    assert out["labels"].tolist() == [6, 7, 9]
    assert out["position_ids"].tolist() == [0, 1, 0]
    assert out["loss_mask"].tolist() == [1.0, 1.0, 1.0]
    assert out["cu_seqlens"].tolist() == [0, 2, 3] and out["cu_seqlens"].dtype == torch.int32
    assert out["tokens"].dtype == out["labels"].dtype == torch.int64


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 65535), max_size=12), max_size=8))
def test_pack_documents_equals_packing_each_document_separately(docs):
    out = pack_documents([np.array(d, np.uint16) for d in docs])
    kept = [d for d in docs if len(d) >= 2]
    assert out["tokens"].tolist() == [t for d in kept for t in d[:-1]]
    assert out["labels"].tolist() == [t for d in kept for t in d[1:]]
    assert out["position_ids"].tolist() == [i for d in kept for i in range(len(d) - 1)]
    assert out["cu_seqlens"].tolist() == np.cumsum([0] + [len(d) - 1 for d in kept]).tolist()
    assert out["loss_mask"].shape == out["tokens"].shape and bool((out["loss_mask"] == 1).all())


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.bool_])
def test_pack_documents_refuses_token_ids_that_are_not_integers(dtype):
    with pytest.raises(TypeError, match=f"document 1 has dtype {np.dtype(dtype)}"):
        pack_documents([np.array([5, 6, 7]), np.array([1.5, 2.7, 0.0]).astype(dtype)])
    empty = pack_documents([np.array([5, 6, 7]), np.array([], dtype)])  # no token to truncate
    assert empty["tokens"].tolist() == [5, 6]


def test_pack_documents_rejects_a_document_that_is_not_1d():
    with pytest.raises(ValueError, match=r"1-D token arrays \(got shape \(2, 2\)\)"):
        pack_documents([np.zeros((2, 2))])


# ------------------------------------------------------------------------ the loader
def test_packed_document_loader_resumes_exactly_across_epochs(prefix):
    def factory() -> DataLoader:
        return packed_document_loader(prefix, batch_size=PER_RANK, mesh=MESH, rank=2, seed=3)

    ref = assert_resume_equivalence(factory, num_items=10)  # 4 steps per epoch
    assert len(ref) == 10
    docs = TokenDocuments(prefix)
    keys = {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "document_ids"}
    assert set(ref[0]) == keys
    assert int(ref[0]["cu_seqlens"][-1]) <= int(docs.lengths.sum())
    for step in ref:  # each packed document is the corpus document its id names
        cu = step["cu_seqlens"].tolist()
        assert len(step["document_ids"]) == len(cu) - 1
        for k, doc_id in enumerate(step["document_ids"].tolist()):
            want = docs[doc_id].astype(np.int64)
            assert step["tokens"][cu[k] : cu[k + 1]].tolist() == want[:-1].tolist()


def test_packed_document_loader_gives_cp_peers_distinct_documents(prefix):
    steps = [
        next(iter(packed_document_loader(prefix, batch_size=PER_RANK, mesh=MESH, rank=r)))
        for r in range(4)
    ]
    got = torch.cat([s["tokens"] for s in steps]).sort().values
    want = _global_batches(prefix)[0]["tokens"].sort().values
    assert torch.equal(got, want)


def test_packed_document_loader_rejects_a_mesh_that_replicates_cp(prefix):
    mesh = DataMesh.from_sizes(dp=2, cp=2)
    with pytest.raises(ValueError, match="data_axes including 'cp'"):
        packed_document_loader(prefix, batch_size=PER_RANK, mesh=mesh, rank=0)


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_balanced_batches_over_packed_document_loader_resume_from_every_microstep(
    prefix, plan_ahead
):
    def factory() -> BalancedBatches:
        loader = packed_document_loader(prefix, batch_size=8, mesh={"dp": 1}, seed=1)
        return BalancedBatches(loader, max_tokens=320, cost=S2, plan_ahead=plan_ahead)

    ref = assert_resume_equivalence(factory, num_items=12, cleanup=lambda it: it.close())
    assert sum(s["microstep"] == 0 for s in ref) == 6  # one epoch: 48 documents, 8 per step
    assert len(ref) > 6
    for step in ref:
        tokens, labels = _real(step)
        assert torch.equal(labels, tokens + 1)


# ------------------------------------------------------------------------ all ranks
def _simulate(prefix: str) -> tuple[list[list[dict]], set[int]]:
    """Every rank's micro-steps, simulated in one process with route_local."""
    loaders = [
        packed_document_loader(prefix, batch_size=PER_RANK, mesh=MESH, rank=r) for r in range(4)
    ]
    per_rank: list[list[dict]] = [[] for _ in range(4)]
    cp_sizes: set[int] = set()
    for samples in zip(*loaders, strict=True):
        p, outputs = route_local(list(samples), max_tokens=128, cost=S2)
        check_routing(list(samples), p, outputs)  # the original documents, zigzag-split
        cp_sizes |= set(p.cp_size.tolist())
        for r in range(4):
            per_rank[r] += outputs[r]
    return per_rank, cp_sizes


def _by_global_batch(per_rank: list[list[dict]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The real (tokens, labels) of every global batch, sorted by token, over all ranks."""
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for steps in per_rank:
        b = -1
        for step in steps:
            b += step["microstep"] == 0
            while len(out) <= b:
                out.append([])
            out[b].append(_real(step))
    merged = []
    for parts in out:
        tokens, labels = torch.cat([t for t, _ in parts]), torch.cat([lb for _, lb in parts])
        order = tokens.argsort()
        merged.append((tokens[order], labels[order]))
    return merged


def _check_global_batches(prefix: str, per_rank: list[list[dict]]) -> None:
    want = _global_batches(prefix)
    got = _by_global_batch(per_rank)
    assert len(got) == len(want) == 4
    for (tokens, labels), batch in zip(got, want, strict=True):
        assert torch.equal(tokens, batch["tokens"].sort().values), "tokens lost or duplicated"
        assert torch.equal(labels, tokens + 1), "a label left its token"


def test_balanced_simulation_over_packed_documents_keeps_each_global_batch(prefix):
    per_rank, cp_sizes = _simulate(prefix)
    assert len(cp_sizes) >= 2, f"the corpus should make some documents split, got {cp_sizes}"
    assert len({len(steps) for steps in per_rank}) == 1
    _check_global_batches(prefix, per_rank)


def _balanced_rank(rank: int, world: int, prefix: str) -> dict:
    def make() -> BalancedBatches:
        loader = packed_document_loader(prefix, batch_size=PER_RANK, mesh=MESH, rank=rank)
        return BalancedBatches(loader, max_tokens=128, cost=S2)

    with make() as it:
        items = list(it)
    with make() as it:
        head = take(it, 3)
        state = it.state_dict()
    with make() as it:
        it.load_state_dict(state)
        tail = list(it)
    return {"items": items, "resumed": head + tail}


@pytest.mark.slow
def test_balanced_batches_on_4_gloo_ranks_reroute_each_global_batch_of_documents(prefix):
    results = run_distributed(_balanced_rank, 4, prefix, timeout=300.0)
    per_rank = [res["items"] for res in results]
    _check_global_batches(prefix, per_rank)
    expected, _ = _simulate(prefix)
    for r, res in enumerate(results):
        assert_same(res["items"], expected[r], f"rank {r}")
        assert_same(res["resumed"], res["items"], f"rank {r} resumed")


# ------------------------------------------------------------------------ CLI
def _plan(*argv: str) -> int:
    return meshfeed.cli.main(["plan", "--dp", "2", "--cp", "2", "--max-tokens", "256", *argv])


def test_plan_cli_corpus_plans_the_corpus_document_lengths_like_lengths_npy(
    prefix, tmp_path, capsys
):
    common = ("--batches", "3", "--batch-tokens", "1500", "--cost", "s2", "--no-png")
    assert _plan("--corpus", prefix, *common) == 0
    from_corpus = capsys.readouterr().out
    npy = tmp_path / "lengths.npy"
    np.save(npy, TokenDocuments(prefix).lengths.astype(np.int64))
    assert _plan("--lengths", str(npy), *common) == 0
    assert from_corpus == capsys.readouterr().out
    assert "4 balanced ranks" in from_corpus and "3 batches" in from_corpus


def test_plan_cli_corpus_reports_a_missing_corpus(tmp_path, capsys):
    assert _plan("--corpus", str(tmp_path / "absent"), "--no-png") == 2
    assert "meshfeed plan:" in capsys.readouterr().err


def test_plan_cli_corpus_excludes_lengths(prefix, tmp_path):
    with pytest.raises(SystemExit):
        _plan("--corpus", prefix, "--lengths", str(tmp_path / "x.npy"))
