"""docs/migrating/torchdata.md runs as written; DataLoader2's sharding assertions, ported.

torchdata 0.11 no longer ships DataLoader2, so its distributed reading-service tests are ported
as assertions: with the truncating last batch (``pad_last=False``) every sample is read at most
once across ranks, all of them when the count divides, and every rank reads the same number.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshfeed import DataLoader
from meshfeed.testing import assert_resume_equivalence
from tests.dist_utils import run_distributed

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migrating" / "torchdata.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


def test_the_guide_has_a_before_and_an_after_example():
    before, after = _blocks()
    assert "SequentialReadingService" in before and "dl.seed(epoch)" in before
    assert "pad_last=pad_last" in after and "loader.epochs(2)" in after


def test_the_after_example_runs_and_shows_padding_against_truncation():
    scope: dict[str, object] = {}
    exec(compile(_blocks()[1], str(GUIDE), "exec"), scope)  # its own asserts are the check
    assert scope["per_rank"] == [20, 20]


def _read(n: int, world: int, rank: int, *, pad_last: bool, seed: int = 0) -> list[int]:
    loader = DataLoader(
        list(range(n)),
        batch_size=3,
        mesh={"dp": world},
        rank=rank,
        seed=seed,
        drop_last=False,
        pad_last=pad_last,
        collate_fn=list,
    )
    return [x for batch in loader for x in batch]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 12, 41, 100])
def test_truncation_reads_each_sample_once_with_equal_lengths_per_rank(n, world):
    if n < world:
        with pytest.raises(ValueError, match=r"fewer samples than data ranks.*pad_last=True"):
            _read(n, world, 0, pad_last=False)
        return
    ranks = [_read(n, world, r, pad_last=False, seed=n) for r in range(world)]
    assert {len(r) for r in ranks} == {n // world}  # DataLoader2: equal length on every rank
    flat = [x for r in ranks for x in r]
    assert len(set(flat)) == len(flat) == n - n % world  # exclusive, and exhaustive up to n % D
    padded = [_read(n, world, r, pad_last=True, seed=n) for r in range(world)]
    assert set(x for r in padded for x in r) == set(range(n))  # the default serves every sample


def _on_rank(rank: int, world: int, pad_last: bool) -> list[int]:
    # The mesh comes from the process group: one data rank per process.
    loader = DataLoader(
        list(range(41)), batch_size=4, seed=3, drop_last=False, pad_last=pad_last, collate_fn=list
    )
    with loader:
        return [x for batch in loader for x in batch]


@pytest.mark.slow
def test_two_gloo_ranks_match_dataloader2s_distributed_lengths_and_the_simulation():
    truncated = run_distributed(_on_rank, 2, False, timeout=240)
    assert [len(r) for r in truncated] == [20, 20]
    assert len(set(truncated[0]) | set(truncated[1])) == 40
    assert truncated == [[x for b in _sim(r, pad_last=False) for x in b] for r in range(2)]
    padded = run_distributed(_on_rank, 2, True, timeout=240)
    assert [len(r) for r in padded] == [21, 21]
    assert set(padded[0]) | set(padded[1]) == set(range(41))


def _sim(rank: int, *, pad_last: bool) -> DataLoader:
    return DataLoader(
        list(range(41)),
        batch_size=4,
        mesh={"dp": 2},
        rank=rank,
        seed=3,
        drop_last=False,
        pad_last=pad_last,
        collate_fn=list,
    )


def test_truncating_loader_resumes_exactly_across_epochs():
    assert_resume_equivalence(lambda: _sim(1, pad_last=False), num_items=13)


def test_pad_last_is_part_of_the_checkpoint_identity():
    state = _sim(0, pad_last=False).state_dict()
    assert state["pad_last"] is False
    with pytest.raises(ValueError, match=r"pad_last=False but this loader has pad_last=True"):
        _sim(0, pad_last=True).load_state_dict(state)


def test_bad_pad_last_is_refused_by_name():
    with pytest.raises(TypeError, match=r"pad_last must be True or False.*pad_last='no'"):
        DataLoader(list(range(8)), batch_size=2, drop_last=False, pad_last="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pad_last=False would be ignored with drop_last=True"):
        DataLoader(list(range(8)), batch_size=2, pad_last=False)


def test_the_dataloader_docstring_explains_padding_next_to_drop_last():
    doc = " ".join((DataLoader.__doc__ or "").split())
    assert "drop_last=False" in doc and "pad_last=False" in doc and "wrapping" in doc


def test_the_guides_filter_with_skip_drops_items_as_torchdata_does():
    # The guide mapped .filter(p) to LazyDataset(...).filter(p) alone: under the default
    # on_error="substitute" half the epoch came back twice. It now says on_error="skip".
    import logging

    import meshfeed

    items = list(range(40))
    ds = meshfeed.LazyDataset(items).map(lambda x: x * 10).filter(lambda x: x % 20 == 0)
    logger = logging.getLogger("meshfeed")
    level, logger.level = logger.level, logging.ERROR  # the skips are warned about
    try:
        loader = meshfeed.DataLoader(
            ds, batch_size=4, shuffle=False, collate_fn=list, on_error="skip"
        )
        kept = [x for batch in loader for x in batch]
    finally:
        logger.setLevel(level)
    assert kept == [x * 10 for x in items if x * 10 % 20 == 0]
    assert 'with `on_error="skip"` to drop filtered items' in GUIDE.read_text()
