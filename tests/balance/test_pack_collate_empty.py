"""PackCollate of an empty step: no loader hands a rank one, so it is a caller's mistake."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed.balance import PackCollate
from meshfeed.queue.store import Batch


@pytest.mark.parametrize("empty", [[], (), Batch(ids=[], columns={"input_ids": []})])
def test_an_empty_step_is_refused_naming_what_was_passed(empty: object) -> None:
    with pytest.raises(
        ValueError,
        match=rf"PackCollate got no samples \(an empty {type(empty).__name__}\).*at least one",
    ):
        PackCollate()(empty)  # type: ignore[arg-type]


def test_one_sample_still_packs() -> None:
    packed = PackCollate()([{"input_ids": np.arange(3), "labels": np.arange(3)}])
    assert packed["input_ids"].tolist() == [0, 1, 2]
    assert packed["cu_seqlens"].tolist() == [0, 3]
