"""Every try of a StoreLoader's ``collate_fn`` gets the batch as the store handed it out: an
in-place edit made by a try that then failed never reaches the next try, nor the batch the
loader keeps after a CollateError (collated again by ``next()``, recorded by ``state_dict()``)."""

from __future__ import annotations

import os

import pytest
import torch

from meshfeed.queue import Batch, CollateError, SampleStore, StoreLoader
from meshfeed.queue.loading.fetch import StoreFetcher


def _store() -> SampleStore:
    store = SampleStore()
    store.put(
        "p",
        {"reward": torch.tensor([1.0, 2.0, 3.0, 6.0]), "text": [["a"], ["b"], ["c"], ["d"]]},
        ids=list(range(4)),
    )
    store.close("p")
    return store


class _EditsThenFails:
    """Normalises the rewards and appends to the texts in place, then fails ``fails`` times
    (and while the file ``until`` is missing: a worker process has its own count)."""

    def __init__(self, fails: int, until: str | None = None) -> None:
        self.fails, self.calls, self.until = fails, 0, until

    def __call__(self, batch: Batch) -> tuple[list[float], list[list[str]], list[int]]:
        batch.columns["reward"] -= batch.columns["reward"].mean()
        batch.columns["reward"] *= 2
        for text in batch.columns["text"]:
            text.append("<eos>")
        batch.ids.append(-1)
        self.calls += 1
        if self.calls <= self.fails or (self.until and not os.path.exists(self.until)):
            raise RuntimeError("a transient failure after the edit")
        return batch.columns["reward"].tolist(), batch.columns["text"], batch.ids


ONCE = ([-4.0, -2.0, 0.0, 6.0], [["a", "<eos>"], ["b", "<eos>"], ["c", "<eos>"], ["d", "<eos>"]])


def _loader(store: SampleStore, collate, **kw) -> StoreLoader:
    return StoreLoader(store, task="t", fields=["reward", "text"], partition="p", batch_size=4,
                       timeout=10, collate_fn=collate, prefetch=1, **kw)  # fmt: skip


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_retry_collates_the_batch_as_fetched(num_workers):
    collate = _EditsThenFails(fails=2)  # the third try (collate_retries=2) succeeds
    with _loader(_store(), collate, num_workers=num_workers) as loader:
        rewards, texts, ids = next(iter(loader))
    assert (rewards, texts) == ONCE and ids == [0, 1, 2, 3, -1]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_batch_kept_after_a_collate_error_is_the_batch_as_fetched(num_workers, tmp_path):
    fixed = tmp_path / "fixed"
    collate = _EditsThenFails(fails=0, until=str(fixed))
    loader = _loader(_store(), collate, collate_retries=1, num_workers=num_workers)
    with pytest.raises(CollateError):
        next(loader)  # two tries, each editing the batch, failed
    fixed.touch()
    state = loader.state_dict()
    rewards, texts, _ = next(loader)  # the kept batch, collated again
    loader.shutdown()
    assert (rewards, texts) == ONCE
    again = _loader(_store(), _EditsThenFails(fails=0), num_workers=num_workers)
    again.load_state_dict(state)  # the batch it recorded
    assert next(again)[:2] == ONCE
    again.shutdown()


def test_each_try_gets_its_own_copy_and_the_store_s_batch_is_handed_to_the_first():
    seen: list[Batch] = []

    def collate(batch: Batch):
        seen.append(batch)
        batch.columns["reward"].zero_()
        raise ValueError("no")

    fetched = Batch([0, 1], {"reward": torch.ones(2), "text": [["a"], ["b"]]})
    fetcher = StoreFetcher(None, None, collate, 2, None)  # type: ignore[arg-type]
    item, error, kept = fetcher._collated(fetched)
    assert item is None and isinstance(error, ValueError)
    assert seen[0] is fetched and len({id(b) for b in [*seen, kept]}) == 4
    assert kept.columns["reward"].tolist() == [1.0, 1.0] and kept.ids == [0, 1]
    assert kept.columns["text"] == [["a"], ["b"]]
    assert kept.columns["text"][0] is not fetched.columns["text"][0]
