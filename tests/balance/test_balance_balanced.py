from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from meshfeed.balance import BalancedBatches, CostModel, pack_documents
from meshfeed.balance.routing import route_local
from meshfeed.testing import assert_resume_equivalence, assert_same, take
from tests.dist_utils import run_distributed

from .checks import Samples, check_routing, make_sample

S2 = CostModel(quadratic=1.0)
BATCHES = 3


def _balanced(rank: int, seed: int, max_len: int, **kwargs) -> BalancedBatches:
    inner = Samples(rank, seed=seed, batches=BATCHES, max_len=max_len, docs=8)
    return BalancedBatches(inner, max_tokens=256, cost=S2, **kwargs)


def _run(rank: int, seed: int, max_len: int, policy: str, group) -> dict:
    """Reroute all batches, then check resume from a mid-batch state."""
    with _balanced(rank, seed, max_len, cp_sizes=policy, group=group) as it:
        items = list(it)
    with _balanced(rank, seed, max_len, cp_sizes=policy, group=group) as it:
        head = take(it, 4)
        state = it.state_dict()
    with _balanced(rank, seed, max_len, cp_sizes=policy, group=group) as it:
        it.load_state_dict(state)
        tail = list(it)
    return {"items": items, "head": head, "tail": tail, "state": state}


def _run_ranks(rank: int, world: int) -> dict:
    """4 ranks twice over (even and odd global ranks: no contiguous layout), then all 8."""
    import torch.distributed as dist

    groups = [dist.new_group(list(range(parity, world, 2))) for parity in (0, 1)]
    mine = groups[rank % 2]
    four = _run(dist.get_rank(mine), 10 + rank % 2, 900, "pow2_aligned", mine)
    eight = _run(rank, 5, 1200, "any", None)
    return {"four": four, "eight": eight}


def _expected(world: int, seed: int, max_len: int, policy: str) -> tuple[list[list[dict]], set]:
    """Single-process simulation of all ranks: the micro-steps of every batch, per rank."""
    per_rank: list[list[dict]] = [[] for _ in range(world)]
    sizes: set[int] = set()
    for b in range(BATCHES):
        samples = [make_sample(r, b, seed=seed, max_len=max_len, docs=8) for r in range(world)]
        p, outputs = route_local(samples, max_tokens=256, cost=S2, cp_sizes=policy)
        check_routing(samples, p, outputs)
        sizes |= set(p.cp_size.tolist())
        for r in range(world):
            per_rank[r] += outputs[r]
    return per_rank, sizes


def _check(results: list[dict], expected: list[list[dict]], to_global) -> None:
    for r, res in enumerate(results):
        want = [dict(s, cp_group=tuple(to_global(g) for g in s["cp_group"])) for s in expected[r]]
        # Real collectives give exactly what the one-process simulation gives (which is
        # checked to be the original multiset, zigzag-split with correct cu_seqlens).
        assert_same(res["items"], want, f"rank {r}")
        assert_same(res["head"] + res["tail"], res["items"], f"rank {r} resumed")
    assert len({len(res["items"]) for res in results}) == 1, "ranks ran different step counts"


@pytest.mark.slow
def test_balanced_batches_on_4_and_8_gloo_ranks_match_the_simulation_and_resume():
    results = run_distributed(_run_ranks, 8, timeout=300.0)
    for parity in (0, 1):
        expected, _ = _expected(4, 10 + parity, 900, "pow2_aligned")
        four = [results[r]["four"] for r in range(parity, 8, 2)]
        _check(four, expected, lambda g, parity=parity: 2 * g + parity)
    expected, sizes = _expected(8, 5, 1200, "any")
    _check([res["eight"] for res in results], expected, lambda g: g)
    assert len(sizes) >= 3, f"the test batches should mix CP degrees, got {sizes}"


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_balanced_batches_resume_exactly_from_every_microstep(plan_ahead):
    def factory() -> BalancedBatches:
        inner = Samples(0, seed=2, batches=4, max_len=250, docs=8)
        return BalancedBatches(inner, max_tokens=256, cost=S2, plan_ahead=plan_ahead)

    ref = assert_resume_equivalence(factory, num_items=6)  # 4 batches: one pass, 6 micro-steps
    assert len(ref) > 4  # more than one micro-step per batch on average


def test_balanced_batches_single_rank_splits_nothing_and_keeps_all_tokens():
    it = BalancedBatches(Samples(0, seed=1, batches=2, max_len=100), max_tokens=128, cost=S2)
    items = list(it)
    it.close()
    got = torch.cat([i["tokens"] for i in items])
    want = torch.cat([make_sample(0, b, seed=1, max_len=100)["tokens"] for b in range(2)])
    assert sorted(got.tolist()) == sorted(want.tolist())
    assert all(i["cp_group"] == (0,) for i in items)


def test_balanced_batches_state_needs_a_stateful_inner_iterator():
    it = BalancedBatches(iter([make_sample(0, 0, seed=1, max_len=10)]), max_tokens=64, cost=S2)
    with pytest.raises(TypeError, match="has no state_dict"):
        it.state_dict()
    it.close()


def test_balanced_batches_load_needs_a_stateful_inner_iterator():
    it = BalancedBatches(iter([make_sample(0, 0, seed=1, max_len=10)]), max_tokens=64, cost=S2)
    with pytest.raises(TypeError, match=r"list_iterator has no state_dict.*protocols\.Stateful"):
        it.load_state_dict({"kind": "balanced_batches", "version": 2, "inner": {}, "skip": 0})
    it.close()


@pytest.mark.parametrize("method", ["state_dict", "load_state_dict"])
def test_balanced_batches_refuses_an_inner_iterator_with_half_the_protocol(method):
    class Half:
        def __init__(self) -> None:
            self.items = iter([make_sample(0, 0, seed=1, max_len=10)])

        def __iter__(self) -> Half:
            return self

        def __next__(self) -> dict:
            return next(self.items)

    setattr(Half, method, lambda self, *args: {})
    with pytest.raises(TypeError, match=f"Half has {method}\\(\\) but is not .*Stateful"):
        BalancedBatches(Half(), max_tokens=64, cost=S2)


def test_balanced_batches_rejects_a_state_of_another_version():
    it = _balanced(0, 1, 100)
    with pytest.raises(ValueError, match="version=7, this meshfeed reads version 2"):
        it.load_state_dict({"kind": "balanced_batches", "version": 7, "inner": {}, "skip": 0})
    it.close()


def test_balanced_batches_refuses_a_state_written_by_meshfeed_0_1_by_name():
    it = _balanced(0, 1, 100)
    with pytest.raises(
        ValueError,
        match="BalancedBatches state has version=1, this meshfeed reads version 2; it was written by meshfeed 0.1",
    ):
        it.load_state_dict({"version": 1, "inner": {}, "skip": 0})
    it.close()


def test_balanced_batches_refuses_a_negative_skip():
    it = _balanced(0, 1, 100)
    state = dict(it.state_dict(), skip=-1)
    with pytest.raises(ValueError, match="'skip' is negative"):
        it.load_state_dict(state)
    it.close()


def test_balanced_batches_rejects_too_many_documents_for_the_gather_buffer():
    sample = make_sample(0, 0, seed=4, max_len=5, docs=40)
    n = len(sample["cu_seqlens"]) - 1
    it = BalancedBatches(iter([sample]), max_tokens=64, cost=S2, max_docs_per_rank=max(1, n - 1))
    with pytest.raises(ValueError, match="raise max_docs_per_rank"):
        next(it)
    it.close()


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, 4096.0, "8"])
def test_balanced_batches_rejects_a_max_docs_per_rank_that_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"max_docs_per_rank must be a positive int \(got"):
        BalancedBatches(iter([]), max_tokens=64, cost=S2, max_docs_per_rank=bad)


def test_balanced_batches_refuses_a_gather_buffer_beyond_what_it_plans():
    with pytest.raises(ValueError, match=r"max_docs_per_rank=1000000000000 .*MAX_DOCS_PER_RANK"):
        BalancedBatches(iter([]), max_tokens=64, cost=S2, max_docs_per_rank=10**12)
    BalancedBatches(iter([]), max_tokens=64, cost=S2, max_docs_per_rank=2**20).close()


@pytest.mark.parametrize("keys", [(), "tokens", [1, 2], None])
def test_balanced_batches_refuse_keys_that_are_not_key_names(keys):
    with pytest.raises(ValueError, match=r"keys must be a non-empty sequence .* \(got keys="):
        BalancedBatches(iter([]), max_tokens=64, cost=S2, keys=keys)


@pytest.mark.parametrize("pad", [None, 0, [("tokens", 0)]])
def test_balanced_batches_refuse_a_pad_that_is_not_a_mapping(pad):
    with pytest.raises(TypeError, match=r"pad must be a mapping of key -> pad value .*\(got pad="):
        BalancedBatches(iter([]), max_tokens=64, cost=S2, pad=pad)


@pytest.mark.parametrize("bad", [float("nan"), 0, -1.0, True, "10"])
def test_balanced_batches_refuses_a_timeout_that_is_not_positive_seconds(bad):
    with pytest.raises(ValueError, match="timeout must be positive seconds"):
        BalancedBatches(iter([]), max_tokens=64, cost=S2, timeout=bad)


# Corpus ids as int64 hashes: any sign, the extremes too.
HASH_IDS = [-(2**63), -3, 7, 2**63 - 1, -1, 0]


def _hashed_sample(rank: int, with_ids: bool = True) -> dict:
    """Documents whose tokens name them (10_000 * index + position), carrying HASH_IDS."""
    docs = [10_000 * (d + 1) + np.arange(3 + 9 * d + rank) for d in range(len(HASH_IDS))]
    sample = pack_documents(docs)
    if with_ids:
        sample["document_ids"] = torch.tensor(HASH_IDS, dtype=torch.int64)
    return sample


def _check_hashed_ids(steps: list[dict]) -> None:
    """Every piece of every micro-step carries the id of the document its tokens come from."""
    seen = set()
    for step in steps:
        cu = step["cu_seqlens"].tolist()
        assert len(step["document_ids"]) == len(cu) - 1
        for k, doc_id in enumerate(step["document_ids"].tolist()):
            real = step["loss_mask"][cu[k] : cu[k + 1]] > 0  # not the CP padding
            tokens = step["tokens"][cu[k] : cu[k + 1]][real]
            assert tokens.numel() > 0
            d = HASH_IDS.index(doc_id)
            assert bool(((tokens // 10_000) == d + 1).all()), (doc_id, tokens)
            seen.add(doc_id)
    assert seen == set(HASH_IDS)


def test_balanced_batches_keep_negative_document_ids():
    with BalancedBatches([_hashed_sample(0)], max_tokens=64, cost=S2) as it:
        steps = list(it)
    assert all(s["document_ids"].dtype == torch.int64 for s in steps)
    _check_hashed_ids(steps)
    with BalancedBatches([_hashed_sample(0, with_ids=False)], max_tokens=64, cost=S2) as it:
        assert all("document_ids" not in s for s in it)


def _hashed_rank(rank: int, world: int, with_ids: tuple[bool, ...]) -> list[dict]:
    import torch.distributed as dist

    inner = [_hashed_sample(rank, with_ids[rank])]
    with BalancedBatches(inner, max_tokens=32, cost=S2, group=dist.group.WORLD) as it:
        return list(it)


@pytest.mark.slow
def test_balanced_batches_on_2_gloo_ranks_exchange_negative_document_ids():
    results = run_distributed(_hashed_rank, 2, (True, True), timeout=300.0)
    assert any(len(s["cp_group"]) > 1 for steps in results for s in steps)  # split documents
    for steps in results:
        _check_hashed_ids(steps)
    _, want = route_local([_hashed_sample(r) for r in range(2)], max_tokens=32, cost=S2)
    for r, steps in enumerate(results):
        assert [s["document_ids"].tolist() for s in steps] == [
            s["document_ids"].tolist() for s in want[r]
        ]
    # a rank without ids: no rank carries them (the ids of the other ranks would be partial)
    results = run_distributed(_hashed_rank, 2, (True, False), timeout=300.0)
    assert all("document_ids" not in s for steps in results for s in steps)


def test_balanced_batches_refuse_fields_they_would_drop_naming_them():
    """Multimodal rows (an image's pixel_values concatenated, with offsets) went through and
    came out without their images, silently: every field it cannot route is refused."""
    sample = pack_documents([np.arange(5), np.arange(7)])
    sample["pixel_values"] = torch.zeros(3, 4)
    sample["pixel_values_offsets"] = torch.tensor([0, 1, 3])
    with BalancedBatches([sample], max_tokens=64) as it, pytest.raises(
        ValueError, match=r"holds \['pixel_values', 'pixel_values_offsets'\], which "
        r"BalancedBatches would drop"
    ):  # fmt: skip
        next(it)
    del sample["pixel_values"], sample["pixel_values_offsets"]
    with BalancedBatches([sample], max_tokens=64) as it:  # cu_seqlens and document_ids pass
        assert sum(int(s["loss_mask"].sum()) for s in it) == int(sample["loss_mask"].sum())


def test_off_its_thread_a_gpu_group_leaves_the_tokens_exchange_to_meshfeeds_gloo_group(
    monkeypatch,
):
    # Run on a delivery thread (Delivered), BalancedBatches' all_to_all must not share the
    # caller's NCCL group with the loop's own collectives (issued from two threads, they would
    # interleave in another order on each rank), and making an NCCL group there would be a
    # collective on the default communicator: the tokens move on meshfeed's gloo group. On a
    # CPU-only build the GPU group is faked; tests/test_gpu.py runs it on two NCCL ranks.
    from meshfeed.balance import _group, balanced

    monkeypatch.setattr(balanced, "own_group", lambda group, timeout: "own gloo")
    monkeypatch.setattr(_group, "own_group", lambda group, timeout, owner: "own gloo")
    monkeypatch.setattr(balanced.dist, "is_distributed", lambda group: True)
    monkeypatch.setattr(balanced._Comm, "device", lambda self: torch.device("cuda", 0))
    looped = balanced._Comm(None, 5.0)
    assert looped._made() == ("own gloo", None)  # the caller's NCCL group, kept
    comm, got = balanced._Comm(None, 5.0), []

    def on_delivery_thread() -> None:
        got.append(comm._made())  # another thread than the one that built it
        balanced.dist.mark_delivery_thread()
        got.append(looped._made())  # a delivery thread: not the groups kept on the loop's

    thread = threading.Thread(target=on_delivery_thread)
    thread.start()
    thread.join()
    assert got == [("own gloo", "own gloo"), ("own gloo", "own gloo")]
