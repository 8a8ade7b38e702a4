"""Checkpoints: atomic save/load mid-stream, versioned metadata, the resume harness."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from meshfeed.queue import (
    GroupSampler,
    PartitionClosed,
    RankAwareSampler,
    SampleStore,
    StoreLoader,
)
from meshfeed.queue.checkpoints import state as ckpt
from meshfeed.testing import assert_resume_equivalence


def _drain(store: SampleStore, task: str, fields: list[str]) -> list:
    out = []
    while True:
        try:
            out.extend(store.get(task, fields, 3, "p", timeout=1).ids)
        except (PartitionClosed, TimeoutError):
            return out


def test_checkpoint_round_trip_mid_stream_loses_and_repeats_nothing(make_store, tmp_path):
    store = make_store(tasks=["actor", "critic"])
    store.put("p", {"x": np.arange(20.0).reshape(10, 2), "y": list(range(10))})
    store.put("p", {"x": np.zeros((2, 2))}, ids=[10, 11])  # partial: y comes after the restore
    first = store.get("actor", ["x", "y"], 4, "p", timeout=1).ids
    critic = store.get("critic", ["x", "y"], 6, "p", timeout=1).ids
    lead = RankAwareSampler(data_rank=0, replica_rank=0, replica_size=2)
    shared = store.get("ref", ["y"], 2, "p", sampler=lead, timeout=1, batch_index=0).ids
    path = tmp_path / "store.ckpt"
    store.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["store.ckpt"]  # no temp file left behind

    restored = SampleStore.load(path)  # a Ray store's checkpoint loads into the embedded one
    assert restored.stats()["held"] == 8  # samples 0-3 were consumed by both tasks: dropped
    fresh = restored.get("fresh", ["x"], 8, "p", timeout=1)
    assert fresh.ids == [4, 5, 6, 7, 8, 9, 10, 11]
    assert np.array_equal(fresh["x"][:6], np.arange(8.0, 20.0).reshape(6, 2))  # values survived
    lag = RankAwareSampler(data_rank=0, replica_rank=1, replica_size=2)
    assert restored.get("ref", ["y"], 2, "p", sampler=lag, timeout=1, batch_index=0).ids == shared
    restored.put("p", {"y": [10, 11]}, ids=[10, 11])
    restored.close("p")
    rest = _drain(restored, "actor", ["x", "y"])
    assert sorted(first + rest) == list(range(12))  # nothing lost, nothing twice
    assert sorted(critic + _drain(restored, "critic", ["x", "y"])) == list(range(12))


def test_load_rejects_another_version_and_foreign_files(tmp_path):
    store = SampleStore()
    store.put("p", {"x": [1]})
    meta, payload = ckpt.dump(store._backend.core)
    meta["version"] = 99
    ckpt.write_checkpoint(tmp_path / "v99", meta, payload)
    with pytest.raises(ValueError, match="version=99, this meshfeed reads version 2"):
        SampleStore.load(tmp_path / "v99")
    torch.save({"weights": 1}, tmp_path / "other")
    with pytest.raises(ValueError, match="not a SampleStore checkpoint"):
        SampleStore.load(tmp_path / "other")
    with pytest.raises(ValueError, match="no SampleStore checkpoint"):
        SampleStore.load(tmp_path / "missing")


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    store = SampleStore()
    store.put("p", {"x": [1, 2]})
    path = tmp_path / "store.ckpt"
    store.save(path)
    store.put("p", {"x": [3]})

    def broken(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        store.save(path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["store.ckpt"]
    assert SampleStore.load(path).stats()["held"] == 2  # the old checkpoint, whole


def test_state_dict_is_plain_versioned_json():
    store = SampleStore()
    store.put("p", {"x": [1, 2]}, ids=["a", "b"], groups=[0, 0])
    store.get("t", ["x"], 1, "p", timeout=1)
    state = store.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert (state["kind"], state["version"]) == ("sample_store", 2)
    other = SampleStore()
    with pytest.raises(ValueError, match="does not hold"):
        other.load_state_dict(state)


class _Members:
    """Two replica members of one data rank reading whole groups, alternating, from one store.

    Item 2k is member 0's batch k, item 2k+1 member 1's; so states are recorded while a shared
    cache entry is half read.
    """

    def __init__(self) -> None:
        self.store = SampleStore()
        for g in range(7):
            self.store.put(
                "p",
                {"x": torch.full((3, 2), g), "len": [g, g + 1, g + 2]},
                ids=[f"{g}/{j}" for j in range(3)],
                groups=g,
            )
        self.store.close("p")
        inner = GroupSampler(group_size=3)
        self.loaders = [
            StoreLoader(
                self.store,
                task="t",
                fields=["x", "len"],
                batch_size=6,
                partition="p",
                mesh={"dp": 1, "tp": 2},
                rank=r,
                sampler=RankAwareSampler(data_rank=0, replica_rank=r, replica_size=2, inner=inner),
                prefetch=1,
                timeout=math.inf,
            )
            for r in range(2)
        ]
        self.turn = 0

    def __next__(self):
        loader = self.loaders[self.turn]
        self.turn ^= 1
        batch = next(loader)
        return (batch.ids, batch["x"], batch["len"])

    def state_dict(self):
        return {
            "version": 1,
            "store": self.store.state_dict(),
            "loaders": [ld.state_dict() for ld in self.loaders],
            "turn": self.turn,
        }

    def load_state_dict(self, state):
        self.store.load_state_dict(state["store"])
        for ld, s in zip(self.loaders, state["loaders"], strict=True):
            ld.load_state_dict(s)
        self.turn = state["turn"]


def test_store_and_loader_state_pass_the_resume_harness():
    ref = assert_resume_equivalence(_Members, num_items=8)
    assert len(ref) == 8  # 7 groups of 3 in batches of 2 groups: 4 batches per member
    assert [r[0] for r in ref[0::2]] == [r[0] for r in ref[1::2]]  # members agree
