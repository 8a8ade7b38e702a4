"""``shutdown()`` while a ``next()`` runs: from another thread, or from the loop's ``on_step``.

The decision (see ``DataLoader.shutdown``): the delivery thread never outlives the ``next()``
in progress, and the dataset is not called once that ``next()`` ended (once ``shutdown()``
returned, when it was called from ``on_step``).

- From another thread, the ``next()`` in progress raises the shutdown error in place of its
  batch, which is not counted: the position stays, and iterating the loader again serves it.
- From ``on_step``, the batch was counted already (``on_step`` sees it counted, a checkpoint
  taken there resumes after it), so that ``next()`` returns it; the delivery thread is joined
  before ``shutdown()`` returns, and the next ``next()`` raises the shutdown error.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from meshfeed import DataLoader
from tests.test_telemetry import Slow

SHUT_DOWN = r"was shut down .* continue from the last batch returned"


def _delivery_threads(before=frozenset()):
    return [t for t in threading.enumerate() if t.name == "meshfeed-delivery" and t not in before]


class _Gated:
    """Items 0..n-1 that record each read; the first read waits until ``release`` is set, so
    a ``next()`` is surely in progress when another thread shuts the loader down."""

    def __init__(self, n: int, seconds: float = 0.0) -> None:
        self.n, self.seconds = n, seconds
        self.calls: list[float] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.calls.append(time.perf_counter())
        self.entered.set()
        assert self.release.wait(10), "never released"
        time.sleep(self.seconds)
        return torch.tensor([i])


def _flat(batches) -> list[int]:
    return sorted(v for b in batches for v in b.view(-1).tolist())


@pytest.mark.parametrize("device", ["cpu", None])
def test_shutdown_from_another_thread_while_next_waits_stops_the_delivery_thread(device):
    before = frozenset(_delivery_threads())
    data = _Gated(24, seconds=0.02)
    loader = DataLoader(data, batch_size=2, seed=0, device=device, warn_wait_share=None)
    it = iter(loader)
    shut: dict[str, float] = {}

    def stop() -> None:
        assert data.entered.wait(10)  # the loop is inside next(), reading its first batch
        loader.shutdown()
        shut["at"] = time.perf_counter()
        data.release.set()

    closer = threading.Thread(target=stop)
    closer.start()
    # The batch in progress is not counted and not returned: the shutdown error instead.
    with pytest.raises(RuntimeError, match=SHUT_DOWN):
        next(it)
    closer.join(10)
    assert "at" in shut and loader.position == 0
    assert not _delivery_threads(before)  # joined before next() raised
    calls = len(data.calls)
    time.sleep(0.3)
    assert len(data.calls) == calls  # nothing reads the dataset any more
    assert loader.stats()["delivery"]["steps"] == 0
    with pytest.raises(RuntimeError, match=SHUT_DOWN):
        next(it)
    loader.shutdown()  # a second shutdown() is fine
    del it
    gc.collect()
    assert not _delivery_threads(before)
    # Iterated again: every sample once, the one in progress at the shutdown included.
    assert _flat(loader) == list(range(24))
    loader.shutdown()
    assert not _delivery_threads(before)


@pytest.mark.parametrize("device", ["cpu", None])
def test_shutdown_from_on_step_joins_the_delivery_thread_before_it_returns(device):
    before = frozenset(_delivery_threads())
    data = _Gated(24)
    data.release.set()
    box: dict[str, object] = {}

    def on_step(timing):
        if timing.steps == 2:  # "stop at step N"
            box["loader"].shutdown()
            box["threads"] = _delivery_threads(before)  # right after shutdown() returned
            box["calls"] = len(data.calls)
            box["position"] = box["loader"].position

    loader = box["loader"] = DataLoader(
        data, batch_size=2, seed=0, device=device, device_prefetch=3, on_step=on_step,
        warn_wait_share=None,
    )  # fmt: skip
    it = iter(loader)
    got = [next(it), next(it)]  # the second was counted when on_step shut the loader down
    assert box["threads"] == [] and box["position"] == 4 == loader.position
    with pytest.raises(RuntimeError, match=SHUT_DOWN):
        next(it)
    time.sleep(0.2)
    assert len(data.calls) == box["calls"]  # no read after shutdown() returned
    assert not _delivery_threads(before)
    loader.shutdown()
    del it
    gc.collect()
    # The two batches returned, then the rest of the epoch: every sample once.
    assert _flat(got + list(loader)) == list(range(24))
    loader.shutdown()
    assert not _delivery_threads(before)


@pytest.mark.parametrize("device", ["cpu", None])
def test_shutdown_from_another_thread_while_a_worker_makes_the_batch(device):
    # With workers the pool's own shutdown ends the wait (PoolClosed, a RuntimeError), or the
    # shutdown error if the batch came first; either way nothing is left running.
    before = frozenset(_delivery_threads())
    loader = DataLoader(
        Slow(16, 0.25), batch_size=2, seed=0, num_workers=1, device=device, timeout=30,
        warn_wait_share=None,
    )  # fmt: skip
    it = iter(loader)
    closer = threading.Timer(0.2, loader.shutdown)
    closer.start()
    with pytest.raises(RuntimeError):
        next(it)
    closer.join(10)
    assert not _delivery_threads(before) and loader.position == 0
    assert loader.service.pids == []  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=SHUT_DOWN):
        next(it)
    first = next(iter(loader))  # iterating again starts fresh workers, from position 0
    assert first.numel() == 2 and loader.position == 2
    loader.shutdown()
    assert not _delivery_threads(before)
