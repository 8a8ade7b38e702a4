"""A mixture's checkpoint is refused where resuming it would serve other data: its streams
walked otherwise, or a reweight of a step the checkpointed run already returned."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import meshfeed
from meshfeed.sources import ShardedStream


def _ids(rows):
    return [int(r) if not isinstance(r, dict) else int(r["id"]) for r in rows]


def _array_loader():
    mix = meshfeed.Mixture(
        {"code": np.arange(1000, 1100), "web": np.arange(5000, 5400)}, {"code": 1, "web": 3}, seed=0
    )
    return mix, meshfeed.DataLoader(mix, batch_size=8, seed=1, collate_fn=_ids)


def test_a_resumed_loader_refuses_a_reweight_of_a_step_the_run_returned_as_the_run_does():
    mix, loader = _array_loader()
    it = iter(loader)
    head = [next(it) for _ in range(10)]
    with pytest.raises(ValueError, match=r"reweight\(step=5\) would change stream positions"):
        mix.reweight(5, {"code": 1, "web": 1})
    state = json.loads(json.dumps(loader.state_dict()))
    mix2, resumed = _array_loader()
    resumed.load_state_dict(state)
    # Before, it was accepted: the counts were recomputed as if the new weights held from
    # step 5, and samples served before the checkpoint were served again
    with pytest.raises(ValueError, match=r"reweight\(step=5\) would change stream positions"):
        mix2.reweight(5, {"code": 1, "web": 1})
    mix2.reweight(10, {"code": 1, "web": 1})  # the next step is still the loop's to change
    got = [b for _, b in zip(range(15), resumed, strict=False)]
    assert len(got) == 15
    assert not set(i for b in got for i in b) & set(i for b in head for i in b)


def _shards(folder: Path) -> tuple[list[Path], Path]:
    shards = []
    for s in range(4):
        p = folder / f"part-{s}.jsonl"
        p.write_text("".join(json.dumps({"id": s * 100 + r}) + "\n" for r in range(50)))
        shards.append(p)
    other = folder / "other.jsonl"
    other.write_text("".join(json.dumps({"id": 10_000 + r}) + "\n" for r in range(200)))
    return shards, other


@pytest.mark.parametrize(
    ("saved", "loading", "named"),
    [
        ({"shuffle_buffer": 16}, {"shuffle_buffer": 64}, "'window': 16"),
        ({"shuffle_buffer": 16, "seed": 0}, {"shuffle_buffer": 16, "seed": 1}, "'stream_seed': 0"),
    ],
    ids=["shuffle_buffer", "seed"],
)
def test_a_mixture_of_streams_refuses_a_checkpoint_of_streams_walked_otherwise(
    tmp_path, saved, loading, named
):
    shards, other = _shards(tmp_path)

    def loader(**kw):
        streams = {"a": ShardedStream(shards, **kw), "b": ShardedStream([other])}
        mix = meshfeed.Mixture(streams, {"a": 1, "b": 1}, seed=0)
        return meshfeed.StreamLoader(mix, batch_size=20, seed=0, collate_fn=_ids)

    run = loader(**saved)
    it = iter(run)
    head = [i for _ in range(10) for i in next(it)]
    state = json.loads(json.dumps(run.state_dict()))
    # Before, it loaded, and rows of stream 'a' repeated within its first pass
    with pytest.raises(ValueError, match=f"source 'a' of the mixture: checkpoint's .*{named}"):
        loader(**loading).load_state_dict(state)
    same = loader(**saved)
    same.load_state_dict(state)
    rows = Counter(i for i in head + [i for b in same for i in b] if i < 10_000)
    assert len(rows) == 200 and set(rows.values()) == {1}  # every row of 'a' once


def test_a_refused_checkpoint_leaves_the_mixtures_schedule_as_it_was():
    # The checkpoint's weight changes were adopted before its counts were checked: a refused
    # state left them in the mixture, and the right state was then refused too.
    mix, loader = _array_loader()
    mix.reweight(4, {"code": 1, "web": 1})
    take = iter(loader)
    [next(take) for _ in range(6)]
    state = json.loads(json.dumps(loader.state_dict()))
    bad = json.loads(json.dumps(state))
    bad["order"]["consumed"] = {"code": 0, "web": 48}  # not what the interleave gives
    mix2, resumed = _array_loader()
    with pytest.raises(ValueError, match="does not fit this mixture"):
        resumed.load_state_dict(bad)
    assert mix2.schedule == [(0, {"code": 1, "web": 3})]  # the change was not kept
    resumed.load_state_dict(state)
    assert mix2.schedule == mix.schedule
    assert next(iter(resumed)) == next(take)
