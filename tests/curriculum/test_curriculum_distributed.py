"""Four real gloo processes: the analyzer splits work across ranks and every rank agrees."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed import DataLoader, DataMesh
from meshfeed.curriculum import (
    analyze,
    seqlen,
    vocab_rarity,
)
from meshfeed.testing import take
from tests.curriculum.test_curriculum_loader import Docs, make_curriculum
from tests.dist_utils import run_distributed

VOCAB = 30


def _corpus() -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    return [rng.integers(0, VOCAB, size=int(rng.integers(1, 25))) for _ in range(300)]


def _ranks_analyze_then_load(rank, world, out_dir):
    result = analyze(
        _corpus(),
        [seqlen(), vocab_rarity(VOCAB)],
        output_dir=out_dir,
        chunk_size=16,
        progress=False,
    )
    mesh = DataMesh.from_sizes(dp=2, tp=2)
    ds = Docs()
    loader = DataLoader(ds, batch_size=4, mesh=mesh, seed=7, curriculum=make_curriculum(ds))
    batches = [b["input_ids"][:, 0].tolist() for b in take(loader, 15)]
    state = loader.state_dict()
    loader.shutdown()
    return {
        "rarity": np.asarray(result["vocab_rarity"].values).tobytes(),
        "order": np.asarray(result["seqlen"].order).tolist(),
        "batches": batches,
        "state": state["order"],
    }


@pytest.mark.slow
def test_four_ranks_analyze_like_one_process_and_agree_on_every_batch(tmp_path):
    results = run_distributed(_ranks_analyze_then_load, 4, str(tmp_path))
    single = analyze(_corpus(), [seqlen(), vocab_rarity(VOCAB)], chunk_size=16, progress=False)
    for r in results:
        assert r["rarity"] == np.asarray(single["vocab_rarity"].values).tobytes()
        assert r["order"] == single["seqlen"].order.tolist()
        assert r["state"] == results[0]["state"]
    assert (tmp_path / "vocab_rarity" / "meta.json").is_file()
    # tp peers (ranks 0,1 and 2,3) see the same batches; data ranks split each global batch
    assert results[0]["batches"] == results[1]["batches"]
    assert results[2]["batches"] == results[3]["batches"]
    ds = Docs()
    sim = take(DataLoader(ds, batch_size=8, seed=7, curriculum=make_curriculum(ds)), 15)
    for step in range(15):
        merged = results[0]["batches"][step] + results[2]["batches"][step]
        assert merged == sim[step]["input_ids"][:, 0].tolist()
