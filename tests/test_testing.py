"""meshfeed.testing: what assert_same accepts and the message it fails with, and what
assert_resume_equivalence refuses (each a part that checkpoints wrongly yet serves right)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed import DataLoader
from meshfeed.testing import assert_resume_equivalence, assert_same


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (torch.arange(3), torch.arange(3)),
        (np.arange(3), np.arange(3)),
        (np.arange(3), [0, 1, 2]),
        ({"x": [1, (2, 3)]}, {"x": [1, (2, 3)]}),
        (math.nan, math.nan),
        ("s", "s"),
        (None, None),
    ],
)
def test_assert_same_accepts_equal_outputs(a: object, b: object) -> None:
    assert_same(a, b)


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (torch.arange(3), [0, 1, 2], "item: tensor vs list"),
        ([0, 1, 2], torch.arange(3), "item: tensor vs list"),
        (torch.arange(3), torch.arange(3).float(), "item: tensors differ"),
        (torch.arange(3), torch.arange(4), "item: tensors differ"),
        (np.arange(3), np.arange(4), "item: arrays differ"),
        ({"a": 1}, {"b": 1}, "item: keys differ ['a'] != ['b']"),
        ({"a": [1, 2]}, {"a": [1, 3]}, "item['a'][1]: 2 != 3"),
        ([1, 2], (1, 2), "item: list[2] != tuple[2]"),
        ([1], [1, 2], "item: list[1] != list[2]"),
        (math.nan, 1.0, "item: nan != 1.0"),
        (1, "1", "item: 1 != '1'"),
    ],
)
def test_assert_same_names_the_first_difference(a: object, b: object, message: str) -> None:
    with pytest.raises(AssertionError) as info:
        assert_same(a, b)
    assert str(info.value).startswith(message)


# ------------------------------------------------------------ assert_resume_equivalence
class _Short:
    """Three items, then the end; its state is the count served."""

    def __init__(self) -> None:
        self.i = 0

    def __next__(self) -> int:
        if self.i >= 3:
            raise StopIteration
        self.i += 1
        return self.i

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]


class _Empty(_Short):
    def __next__(self) -> int:
        raise StopIteration


class _GoesOnAfterLoad(_Short):
    """Restored, it serves up to 10 items where a fresh one ends after 3."""

    limit = 3

    def __next__(self) -> int:
        if self.i >= self.limit:
            raise StopIteration
        self.i += 1
        return self.i

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i, self.limit = state["i"], 10


class _Growing:
    """Endless; its state records every item served (it grows with the run)."""

    def __init__(self) -> None:
        self.hist: list[int] = []

    def __next__(self) -> int:
        self.hist.append(len(self.hist))
        return self.hist[-1]

    def state_dict(self) -> dict[str, Any]:
        return {"hist": list(self.hist)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hist = list(state["hist"])


class _DropsACount:
    """Its state has a count that ``load_state_dict`` drops (nothing served shows it)."""

    def __init__(self) -> None:
        self.i = self.count = 0

    def __next__(self) -> int:
        self.i += 1
        self.count += 1
        return self.i

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]


class _Constant(_DropsACount):
    """Serves 7 forever and ignores a loaded state: every resumed output looks right."""

    def __next__(self) -> int:
        super().__next__()
        return 7

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _StaleAtEpochEnd:
    """Three items an epoch; ``iter()`` serves the rest of the epoch, then moves to the next one.
    Its state after an epoch ended still names the last item's position (stale), so a run
    restored from it serves an empty epoch first; ``fixed`` reports where it is then."""

    def __init__(self, fixed: bool = False) -> None:
        self.fixed = fixed
        self.epoch = self.pos = 0
        self.last: tuple[int, int] | None = None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        while self.pos < 3:
            self.pos += 1
            self.last = (self.epoch, self.pos)
            yield self.epoch, self.pos - 1
        self.epoch, self.pos = self.epoch + 1, 0
        if self.fixed:
            self.last = None

    def state_dict(self) -> dict[str, Any]:
        epoch, pos = self.last if self.last is not None else (self.epoch, self.pos)
        return {"epoch": epoch, "pos": pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos, self.last = state["epoch"], state["pos"], None


def _loader() -> DataLoader:
    return DataLoader(np.arange(10), batch_size=2, seed=0)


def test_the_harness_passes_honest_objects() -> None:
    assert assert_resume_equivalence(_Short, num_items=3) == [1, 2, 3]
    assert len(assert_resume_equivalence(_loader, num_items=12)) == 12
    assert len(assert_resume_equivalence(_loader, num_items=10, max_epochs=2)) == 10
    assert len(assert_resume_equivalence(_Growing, num_items=20, max_state_bytes=512)) == 20
    assert len(assert_resume_equivalence(partial(_StaleAtEpochEnd, fixed=True), num_items=8)) == 8


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (_Empty, {"num_items": 100}, "served 0 of num_items=100 items: it ended after 0 epoch"),
        (_Short, {"num_items": 50}, "served 3 of num_items=50 items: it ended after 1 epoch"),
        (_loader, {"num_items": 50, "max_epochs": 0}, "served 0 of num_items=50 items in max_e"),
        (_loader, {"num_items": 12, "max_epochs": 2}, "served 10 of num_items=12 items in max_e"),
    ],
)
def test_the_harness_fails_when_the_reference_serves_fewer_than_num_items(
    factory: Callable[[], Any], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(AssertionError, match=re.escape(message)) as info:
        assert_resume_equivalence(factory, **kwargs)
    assert "lower num_items to" in str(info.value)


def test_the_harness_fails_when_a_resumed_run_goes_on_past_the_reference_end() -> None:
    with pytest.raises(AssertionError, match="went on past where the reference ended"):
        assert_resume_equivalence(_GoesOnAfterLoad, num_items=3)


def test_the_harness_fails_on_a_state_over_max_state_bytes() -> None:
    with pytest.raises(AssertionError, match="over max_state_bytes=512"):
        assert_resume_equivalence(_Growing, num_items=200, max_state_bytes=512)


@pytest.mark.parametrize("factory", [_DropsACount, _Constant])
def test_the_harness_fails_when_a_loaded_state_does_not_read_back(
    factory: Callable[[], Any],
) -> None:
    with pytest.raises(AssertionError, match=r"state_dict\(\) right after load_state_dict"):
        assert_resume_equivalence(factory, num_items=10)
    if factory is _DropsACount:  # the opt-out, for a part that normalises a loaded state
        assert len(assert_resume_equivalence(factory, num_items=10, check_loaded_state=False))


def test_the_harness_refuses_a_factory_that_returns_one_shared_object() -> None:
    shared = _loader()
    with pytest.raises(AssertionError, match="factory\\(\\) returned the same DataLoader"):
        assert_resume_equivalence(lambda: shared, num_items=12)


def test_the_harness_fails_when_a_state_taken_between_epochs_loses_the_next_epoch() -> None:
    with pytest.raises(AssertionError, match="the next epoch served 0 items") as info:
        assert_resume_equivalence(_StaleAtEpochEnd, num_items=8)
    assert "next epoch served 3" in str(info.value)
    # The states taken after items alone do not show it: the empty epoch is skipped.
    assert len(assert_resume_equivalence(_StaleAtEpochEnd, num_items=8, epoch_ends=False)) == 8
