import pickle

import numpy as np
import pytest
import torch

from meshfeed.runtime.transport import SMALL, SlotReader, SlotWriter


@pytest.fixture
def pair():
    reader, writer = SlotReader(ring=2), SlotWriter()
    yield reader, writer
    writer.close()
    reader.close()


def test_reserve_makes_slots_before_the_large_result_so_it_never_travels_in_band(pair):
    reader, writer = pair
    big = {"x": torch.arange(300_000, dtype=torch.int64)}  # 2.4 MB
    reader.reserve(big["x"].numel() * 8)
    frees, added = reader.take_updates()
    assert len(added) == 2 and frees == []
    writer.update(frees, added)
    header = writer.encode(big)
    kind, sid, *_ = pickle.loads(header)
    assert kind == "ok" and sid is not None  # through a slot, first time
    out = reader.decode(pickle.loads(header))
    assert torch.equal(out["x"], big["x"])


def test_reserve_is_a_no_op_for_small_results_sizes_already_made_or_a_pipe_only_ring(pair):
    reader, _ = pair
    reader.reserve(SMALL - 1)
    assert reader.take_updates() == ([], [])
    reader.reserve(1 << 20)
    assert len(reader.take_updates()[1]) == 2
    reader.reserve(1 << 20)
    reader.reserve(1000 + (1 << 19))  # fits the slots made
    assert reader.take_updates() == ([], [])
    pipe_only = SlotReader(ring=0)
    pipe_only.reserve(1 << 20)
    assert pipe_only.take_updates() == ([], [])
    assert np.array([s.size for s in reader.slots.values()]).min() >= 1 << 20
