"""Delivered: any resumable iterator (BalancedBatches here) delivered ahead, state exact."""

import threading
import time

import pytest
import torch

from meshfeed import DataLoader, StreamLoader
from meshfeed.balance import BalancedBatches, CostModel
from meshfeed.delivered import Delivered
from meshfeed.sources import ShardedStream
from meshfeed.testing import assert_resume_equivalence, assert_same
from tests.balance.checks import Samples

S2 = CostModel(quadratic=1.0)


def _balanced():
    return BalancedBatches(
        Samples(0, seed=4, batches=4, max_len=250, docs=8), max_tokens=256, cost=S2
    )


def test_balanced_batches_delivered_ahead_are_the_same_micro_steps():
    with _balanced() as plain:
        want = list(plain)
    inner = _balanced()
    with Delivered(inner, device="cpu", device_prefetch=3) as it:
        got = list(it)
        assert it.stats()["steps"] == len(got) == len(want)
    inner.close()
    assert_same(got, want)
    assert not [t for t in threading.enumerate() if t.name == "meshfeed-delivery"]


def test_balanced_batches_resume_exactly_through_delivered():
    def factory():
        return Delivered(_balanced(), device="cpu", device_prefetch=2)

    def cleanup(it):
        it.shutdown()
        it.inner.close()

    assert_resume_equivalence(factory, num_items=4, every=2, cleanup=cleanup)


def _numbers(**kwargs):
    return DataLoader(list(range(12)), batch_size=3, seed=1, collate_fn=list, **kwargs)


def _stream_numbers(**kwargs):
    stream = ShardedStream([lambda: range(0, 5), lambda: range(20, 27)])
    return StreamLoader(stream, batch_size=3, seed=1, collate_fn=list, **kwargs)


_INNERS = {
    "loader": _numbers,
    "loader on the device": lambda: _numbers(device="cpu", device_prefetch=2),
    "stream": _stream_numbers,
    "loader with workers": pytest.param(
        lambda: _numbers(num_workers=2), marks=pytest.mark.slow, id="loader with workers"
    ),
}


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("inner", list(_INNERS.values()), ids=list(_INNERS))
def test_a_state_taken_after_an_epoch_ended_resumes_with_the_whole_next_epoch(inner, device):
    # Checkpointed after `for batch in it` ended, the state once named the epoch's last batch
    # (stored with that batch), not where the loader had moved: the resumed job's next epoch
    # came out empty.
    with inner() as loader, Delivered(loader, device=device) as it:
        first = list(it)
        state = it.state_dict()
        assert state == loader.state_dict()  # the loader's: the start of its next epoch
        want = list(it)
        end = it.state_dict()
    with inner() as loader, Delivered(loader, device=device) as resumed:
        resumed.load_state_dict(state)
        assert list(resumed) == want and len(want) == len(first) == 4
        assert resumed.state_dict() == end


def test_delivered_over_a_loader_resumes_exactly_across_epochs():
    def factory():
        return Delivered(_numbers(), device="cpu", device_prefetch=2)

    ref = assert_resume_equivalence(factory, num_items=10, cleanup=lambda it: it.shutdown())
    assert sorted(x for b in ref[:4] for x in b) == list(range(12))  # an epoch, then on


def test_the_state_is_of_the_item_returned_not_of_items_read_ahead():
    class Counter:
        def __init__(self):
            self.i = 0

        def __iter__(self):
            return self

        def __next__(self):
            if self.i >= 20:
                raise StopIteration
            self.i += 1
            return torch.tensor([self.i - 1])

        def state_dict(self):
            return {"kind": "counter", "version": 1, "i": self.i}

        def load_state_dict(self, state):
            self.i = state["i"]

    inner = Counter()
    it = Delivered(inner, device="cpu", device_prefetch=4)
    assert [next(it).item() for _ in range(3)] == [0, 1, 2]
    deadline = time.monotonic() + 10
    while inner.i < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inner.i >= 7  # read ahead
    assert it.state_dict()["i"] == 3
    it.load_state_dict({"kind": "counter", "version": 1, "i": 10})
    assert next(it).item() == 10
    it.shutdown()


def test_an_iterator_without_state_is_delivered_and_refuses_checkpoints():
    it = Delivered(iter([torch.zeros(1)] * 3), device="cpu")
    assert len(list(it)) == 3
    with pytest.raises(TypeError, match="has no state_dict/load_state_dict"):
        it.state_dict()
    with pytest.raises(ValueError, match="device_prefetch must be an int >= 1"):
        Delivered(iter([]), device="cpu", device_prefetch=0)


def _epoch_batches(epoch: int) -> list[list[int]]:
    import numpy as np

    from meshfeed import DataLoader

    loader = DataLoader(np.arange(40), batch_size=4, seed=3)
    loader.set_epoch(epoch)
    return [b.tolist() for b in loader]


def test_delivered_reads_on_from_where_a_loader_moved_under_it():
    # The loader's set_epoch / load_state_dict called directly while Delivered read ahead:
    # it once served the batches read ahead of the old epoch, then a pass of nothing.
    import numpy as np

    from meshfeed import DataLoader

    loader = DataLoader(np.arange(40), batch_size=4, seed=3)
    d = Delivered(loader, device="cpu")
    with d:
        for epoch in range(3):
            loader.set_epoch(epoch)
            got = [b.tolist() for _, b in zip(range(5), d, strict=False)]
            assert got == _epoch_batches(epoch)[:5]
            assert (d.state_dict()["epoch"], d.state_dict()["position"]) == (epoch, 20)
        state = DataLoader(np.arange(40), batch_size=4, seed=3).state_dict()  # epoch 0, start
        loader.load_state_dict(state)
        assert [b.tolist() for b in d] == _epoch_batches(0)


class _FailsOnce:
    """A loader-like iterable whose third item raises once (a bad sample under "raise")."""

    def __init__(self) -> None:
        import numpy as np

        from meshfeed import DataLoader

        self.loader = DataLoader(np.arange(40), batch_size=4, seed=3)
        self.failed = False

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if self.loader.position == 12 and not self.failed:
                self.failed = True
                raise ValueError("sample 9 cannot be decoded")
            yield batch
            del i

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


def test_delivered_goes_on_after_an_error_of_its_inner_and_loses_no_item():
    # An error ended the stream; the next pass once found it dead (an empty pass), and the
    # items read ahead before the error were lost.
    inner = _FailsOnce()
    d = Delivered(inner, device="cpu", device_prefetch=3)
    got = []
    with d:
        it = iter(d)
        with pytest.raises(ValueError, match="sample 9"):
            while True:
                got.append(next(it).tolist())
        got += [b.tolist() for b in d]
    assert got == _epoch_batches(0)
