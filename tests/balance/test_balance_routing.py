from __future__ import annotations

import pytest
import torch

from meshfeed.balance import CostModel
from meshfeed.balance.routing import route_local
from tests.optional import given, settings, st

from .checks import check_routing, make_sample

S2 = CostModel(quadratic=1.0)


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["any", "pow2_aligned"]),
    tp=st.sampled_from([1, 2]),
)
def test_route_local_delivers_every_document_once_zigzag_split_with_correct_cu_seqlens(
    world, seed, policy, tp
):
    samples = [make_sample(r, 0, seed=seed, max_len=700) for r in range(world)]
    try:
        p, outputs = route_local(samples, max_tokens=256, cost=S2, cp_sizes=policy, tp=tp)
    except ValueError as e:
        assert "more than" in str(e)
        return
    check_routing(samples, p, outputs)


def test_route_local_mixes_cp_degrees_in_one_batch():
    samples = [make_sample(r, 0, seed=11, max_len=1500, docs=8) for r in range(6)]
    p, outputs = route_local(samples, max_tokens=256, cost=S2)
    check_routing(samples, p, outputs)
    assert len(set(p.cp_size.tolist())) >= 3


def test_route_local_rejects_a_sample_without_cu_seqlens():
    sample = make_sample(0, 0, seed=1, max_len=10)
    del sample["cu_seqlens"]
    with pytest.raises(ValueError, match=r"lacks keys \['cu_seqlens'\]"):
        route_local([sample], max_tokens=64, cost=S2)


def test_route_local_rejects_cu_seqlens_that_do_not_cover_the_sample():
    sample = make_sample(0, 0, seed=3, max_len=10, docs=3)
    sample["cu_seqlens"] = sample["cu_seqlens"][:-1]
    if sample["tokens"].numel() == 0:
        pytest.skip("empty sample")
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        route_local([sample], max_tokens=64, cost=S2)


def test_route_local_packs_several_split_documents_of_one_group_per_microstep():
    samples = []
    for r in range(8):  # ranks 0..5 each hold one 600-token document (3+ ranks of 256 each)
        n = 600 if r < 6 else 0
        tok = torch.arange(n) + 1_000_000 * r
        samples.append(
            {
                "tokens": tok,
                "labels": tok + 1,
                "loss_mask": torch.ones(n),
                "position_ids": torch.arange(n),
                "cu_seqlens": torch.tensor([0, n] if n else [0], dtype=torch.int32),
            }
        )
    p, outputs = route_local(samples, max_tokens=256, cost=S2)
    check_routing(samples, p, outputs)
    shared = [s for steps in outputs for s in steps if len(s["doc_ids"]) > 1]
    assert shared and all(len(s["cp_group"]) > 1 for s in shared)
    assert p.num_microsteps < 6


@pytest.mark.parametrize("cp_sizes", [[1], [1, 2]])
def test_route_local_continues_absolute_position_ids_into_padding(cp_sizes):
    # Megatron without reset_position_ids: positions run on across documents, so a padded
    # document must continue from its own first position, not from the sample's.
    lengths = [5, 7]
    total = sum(lengths)
    sample = {
        "tokens": torch.arange(total),
        "labels": torch.arange(total),
        "loss_mask": torch.ones(total),
        "position_ids": torch.arange(100, 100 + total),
        "cu_seqlens": torch.tensor([0, 5, 12]),
    }
    force_split = cp_sizes != [1]
    p, outputs = route_local(
        [sample] * (2 if force_split else 1),
        max_tokens=8 if force_split else 16,
        tp=4,
        cost=S2,
        cp_sizes=cp_sizes,
    )
    got: dict[int, list[int]] = {}
    for rank_steps in outputs:
        for step in rank_steps:
            ids, pos = step["doc_ids"].tolist(), step["position_ids"].tolist()
            bounds = step["cu_seqlens"].tolist()
            for j, d in enumerate(ids):
                got.setdefault(d, []).extend(pos[bounds[j] : bounds[j + 1]])
    for d in range(p.lengths.size):
        start = 100 + (0 if d % 2 == 0 else 5)
        assert sorted(got[d]) == list(range(start, start + int(p.padded[d])))
