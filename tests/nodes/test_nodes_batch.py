"""Batcher: lists of batch_size items, the source's state nested under "source"."""

from __future__ import annotations

import pytest

from meshfeed.nodes import Batcher, ListNode
from meshfeed.testing import assert_resume_equivalence


@pytest.mark.parametrize("drop_last", [True, False])
def test_batcher_groups_and_drops_or_keeps_the_short_tail(drop_last):
    out = list(Batcher(ListNode(list(range(7))), batch_size=3, drop_last=drop_last))
    expected = [[0, 1, 2], [3, 4, 5]] + ([] if drop_last else [[6]])
    assert out == expected


def test_batcher_nests_its_source_state_and_resumes_exactly():
    node = Batcher(ListNode(list(range(10))), batch_size=2)
    next(node)
    assert node.state_dict() == {
        "kind": "node.batcher",
        "version": 1,
        "source": {"kind": "node.list", "version": 1, "position": 2},
    }
    assert_resume_equivalence(lambda: Batcher(ListNode(list(range(11))), batch_size=2), num_items=5)


def test_batcher_refuses_a_bad_batch_size_and_a_bad_state():
    with pytest.raises(ValueError, match="batch_size"):
        Batcher(ListNode([1]), batch_size=0)
    with pytest.raises(TypeError, match="drop_last"):
        Batcher(ListNode([1]), batch_size=1, drop_last="False")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing 'source'"):
        Batcher(ListNode([1]), batch_size=1).load_state_dict({"kind": "node.batcher", "version": 1})
    nested_bad = {"kind": "node.batcher", "version": 1, "source": {"position": 1}}
    with pytest.raises(ValueError, match="kind=None"):
        Batcher(ListNode([1]), batch_size=1).load_state_dict(nested_bad)
