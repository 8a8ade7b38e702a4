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


def _slots(pair, nbytes):
    """The writer's slots made for results of ``nbytes``, and a first result of that size
    seen (so ``open()`` has a size to choose a slot by)."""
    reader, writer = pair
    writer.need = nbytes
    reader.reserve(nbytes)
    writer.update(*reader.take_updates())


def test_a_batch_stacked_into_the_open_slot_travels_without_a_copy(pair):
    from meshfeed.collate import collate_into_slot, stack_into

    reader, writer = pair
    _slots(pair, 1 << 20)
    items = [torch.arange(i, i + 2048, dtype=torch.int64) for i in range(8)]  # 128 KiB
    stack_into(writer.take)
    try:
        writer.open()
        batch = collate_into_slot(items)
        sid, slot, address, used = writer._open
        assert used == batch.numel() * 8  # the stack is in the slot...
        assert batch.data_ptr() == address
        header = pickle.loads(writer.encode({"tokens": batch, "step": 3}))
    finally:
        stack_into(None)
    assert header[1] == sid and header[3] == [(0, batch.numel() * 8)]  # ...and stayed there
    del batch, slot
    out = reader.decode(header)
    assert torch.equal(out["tokens"], torch.stack(items)) and out["step"] == 3


def test_buffers_outside_the_open_slot_are_copied_after_what_collation_took(pair):
    reader, writer = pair
    _slots(pair, 1 << 20)
    writer.open()
    taken = writer.take(100_000)
    taken[:] = 7
    outside = torch.arange(50_000, dtype=torch.float32)
    header = pickle.loads(writer.encode([torch.from_numpy(taken), outside]))
    (at_in, n_in), (at_out, _) = header[3]
    assert (at_in, n_in) == (0, 100_000) and at_out >= 100_000 and at_out % 64 == 0
    del taken
    got = reader.decode(header)
    assert torch.equal(got[0], torch.full((100_000,), 7, dtype=torch.uint8))
    assert torch.equal(got[1], outside)


def test_without_an_open_slot_or_room_collation_stacks_as_usual(pair):
    from meshfeed.collate import collate_into_slot, default_collate, stack_into

    _, writer = pair
    items = [torch.ones(4096, dtype=torch.float64) * i for i in range(4)]
    stack_into(writer.take)
    try:
        assert writer.take(16) is None  # nothing open: no size known yet
        writer.need = 1 << 30
        writer.open()  # no slot that large: nothing opens
        assert writer._open is None and torch.equal(collate_into_slot(items), torch.stack(items))
        _slots(pair, 1 << 20)
        writer.open()
        assert writer.take((1 << 20) + 1) is None  # more than the slot holds
        # default_collate (and so any user collate_fn calling it) never writes into the slot
        before = writer._open[3]
        default_collate(items)
        assert writer._open[3] == before
    finally:
        stack_into(None)


@pytest.mark.parametrize(
    "items",
    [
        [torch.ones(2048, dtype=torch.float32), torch.ones(2048, dtype=torch.float64)],  # promotes
        [np.ones(2048, np.float32), np.ones(2048, np.float64)],  # promotes
        [torch.ones(2048, requires_grad=True), torch.ones(2048)],  # autograd: no out=
        [torch.ones(2048, dtype=torch.bfloat16)] * 3,
        [np.ones(4096, dtype=np.int16)] * 3,
        [torch.ones(4096, dtype=torch.bool)] * 2,
        [{"x": np.arange(4096), "y": (torch.zeros(4096), 5)}] * 2,
    ],
    ids=["torch-dtypes", "numpy-dtypes", "requires-grad", "bf16", "int16", "bool", "nested"],
)
def test_stacking_into_the_slot_gives_what_default_collate_gives(pair, items):
    from meshfeed.collate import collate_into_slot, default_collate, stack_into
    from meshfeed.testing import assert_same

    _, writer = pair
    _slots(pair, 1 << 20)
    stack_into(writer.take)
    try:
        writer.open()
        got = collate_into_slot(items)
    finally:
        stack_into(None)
    want = default_collate(items)
    assert_same([got], [want])
    assert [t.dtype for t in _tensors(got)] == [t.dtype for t in _tensors(want)]


def _tensors(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def test_a_retired_slot_still_viewed_in_the_worker_is_closed_once_the_view_is_gone(pair):
    _, writer = pair
    _slots(pair, 1 << 19)
    writer.open()
    kept = writer.take(1000)  # e.g. a batch an error's traceback still holds
    writer.encode(None)  # the reply (small: in-band) closes the open slot
    writer.need = 1 << 22  # a larger result seen: the small slots are retired
    writer.update([], [])
    assert len(writer.retired) == 2 and len(writer._closing) == 1  # that one is still viewed
    del kept
    writer.update([], [])
    assert writer._closing == []


def test_a_reply_that_overflows_the_open_slot_goes_through_another_one(pair):
    reader, writer = pair
    _slots(pair, 1 << 20)
    writer.open()
    sid = writer._open[0]
    writer.take(600_000)  # a collation whose batch the reply does not hold
    taken = writer.take(300_000)
    taken[:] = 3
    outside = torch.arange(40_000, dtype=torch.int64)  # 320 KB: no room after what was taken
    header = pickle.loads(writer.encode([torch.from_numpy(taken), outside]))
    assert header[1] is not None and header[1] != sid  # copied into the other slot, whole
    del taken
    got = reader.decode(header)
    assert bool((got[0] == 3).all()) and torch.equal(got[1], outside)


def _slot_take_in_child(out):
    from meshfeed.collate import _SLOT

    out.put(getattr(_SLOT, "take", "unset"))


def test_a_process_forked_by_a_worker_has_no_reply_slot():
    import multiprocessing

    from meshfeed.collate import stack_into

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    stack_into(len)  # as a worker sets it
    try:
        child = ctx.Process(target=_slot_take_in_child, args=(out,))
        child.start()
        assert out.get(timeout=30) is None
        child.join(30)
    finally:
        stack_into(None)
