"""What a fetch knows about itself: fetch_info() inside a fetch, on every door that fetches."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from meshfeed import DataLoader, fetch_info
from meshfeed.rng import FetchInfo, fetching


class Infos:
    """Each item is what fetch_info() said while it was read (and a second call's answer)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = fetch_info()
        assert info is not None and fetch_info() is info  # made once per fetch
        return {"i": i, "epoch": info.epoch, "step": info.step, "seed": info.seed,
                "worker": info.worker_id, "workers": info.num_workers}  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_fetch_info_names_the_seed_epoch_step_and_worker(workers: int) -> None:
    loader = DataLoader(Infos(), batch_size=2, seed=5, shuffle=False, num_workers=workers)
    try:
        for epoch in range(2):
            for step, batch in enumerate(loader):
                assert batch["i"].tolist() == [2 * step, 2 * step + 1]
                assert set(batch["epoch"].tolist()) == {epoch}
                assert set(batch["step"].tolist()) == {step}
                assert set(batch["seed"].tolist()) == {5}
                assert set(batch["workers"].tolist()) == {workers}
                assert set(batch["worker"].tolist()) <= set(range(max(workers, 1)))
    finally:
        loader.shutdown()
    assert fetch_info() is None


def test_fetching_takes_an_info_or_its_fields_and_restores_the_outer_one() -> None:
    assert fetch_info() is None
    outer = FetchInfo(seed=1, epoch=2, step=3)
    with fetching(outer):
        assert fetch_info() is outer
        with fetching((7, 8, 9, 1, 4)):
            assert fetch_info() == FetchInfo(seed=7, epoch=8, step=9, worker_id=1, num_workers=4)
        assert fetch_info() is outer
    assert fetch_info() is None
    seen: list[Any] = []
    with fetching((7, 8, 9, 0, 0)):  # another thread is outside any fetch
        t = threading.Thread(target=lambda: seen.append(fetch_info()))
        t.start()
        t.join()
    assert seen == [None]
