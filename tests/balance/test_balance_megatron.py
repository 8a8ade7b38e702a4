"""HybridCPDataLoader: Megatron's wrapper's input and output, on gloo ranks and in one process."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshfeed.balance.megatron import HybridCPDataLoader
from tests.dist_utils import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import megatron_hybrid_cp as example


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
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


def _idle_rank(rank: int, world: int) -> str:
    one_doc = {
        "tokens": torch.arange(4),
        "labels": torch.arange(4),
        "cu_seqlens": torch.tensor([0, 4 if rank == 0 else 0], dtype=torch.int32),
    }
    it = HybridCPDataLoader(iter([[one_doc]]), max_seqlen_per_dp_cp_rank=64)
    try:
        next(it)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.slow
def test_a_rank_left_without_a_document_is_an_error_on_every_rank_not_a_crash_in_the_loop():
    # 3 ranks: aligned power-of-two CP blocks are {0, 1} (and single ranks), so the one
    # document goes to ranks 0-1 and rank 2 has nothing to run.
    messages = run_distributed(_idle_rank, 3, timeout=120.0)
    for m in messages:
        assert m.startswith("ranks [2] get no document in the last group"), m


def _empty_rank(rank: int, world: int) -> list[int]:
    """Rank 1's documents are all empty; it still receives its share of rank 0's document."""
    doc = {
        "tokens": torch.arange(64),
        "loss_mask": torch.ones(64, dtype=torch.float32),
        "cu_seqlens": torch.tensor([0, 64 if rank == 0 else 0], dtype=torch.int32),
    }
    it = HybridCPDataLoader(iter([[doc]]), max_seqlen_per_dp_cp_rank=64)
    samples, groups = next(it)
    assert groups == [[[0], [0]]], groups
    assert torch.equal(samples[0]["loss_mask"], torch.ones(64))
    return samples[0]["tokens"].tolist()


@pytest.mark.slow
def test_a_rank_with_only_empty_documents_receives_its_share():
    for tokens in run_distributed(_empty_rank, 2, timeout=120.0):
        assert tokens == list(range(64))


def test_the_megatron_migration_guide_example_runs():
    guide = Path(__file__).resolve().parents[2] / "docs" / "migrating" / "megatron.md"
    blocks = guide.read_text().split("```python\n")[1:]
    runnable = [b.split("```")[0] for b in blocks if "assert " in b]
    assert runnable, "the guide must keep a runnable example"
    for code in runnable:
        exec(compile(code, str(guide), "exec"), {})


def test_megatron_groups_come_from_an_initialised_parallel_state_without_importing_megatron(
    monkeypatch,
):
    from meshfeed.balance.megatron import _groups

    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    assert _groups(None) == (None, None)  # no Megatron in this program: the default group
    assert "megatron.core.parallel_state" not in sys.modules  # and Megatron was not imported

    def data_parallel_group(with_context_parallel: bool = False) -> str:
        return "dp_cp" if with_context_parallel else "dp"

    fake = SimpleNamespace(
        model_parallel_is_initialized=lambda: True,
        get_data_parallel_group=data_parallel_group,
    )
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake)
    assert _groups(None) == ("dp_cp", "dp")
    assert _groups(SimpleNamespace(dp_cp="mine", dp="mine_dp")) == ("mine", "mine_dp")


def test_off_its_thread_the_documents_move_on_meshfeeds_gloo_group(monkeypatch):
    # On another thread (Delivered's), an all_to_all on Megatron's dp_cp group would interleave
    # with the loop's gradient reduction on it in another order on each rank.
    from meshfeed.balance import _group

    monkeypatch.setattr(_group, "own_group", lambda group, timeout, owner: ("own", group))
    it = HybridCPDataLoader(iter([]), max_seqlen_per_dp_cp_rank=64)
    assert it._data_group() is it.dp_cp_group
    got: list = []
    thread = threading.Thread(target=lambda: got.append(it._data_group()))
    thread.start()
    thread.join()
    assert got == [("own", it.dp_cp_group)]
