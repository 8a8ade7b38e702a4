"""Node protocol and ListNode / Batcher: explicit state, nested under "source"."""

from __future__ import annotations

import pytest

from meshfeed.nodes import Batcher, ListNode, Node
from meshfeed.testing import assert_resume_equivalence


def test_list_node_state_is_the_position():
    node = ListNode("abc")
    assert next(node) == "a" and node.get_state() == {"position": 1}
    node.restore({"position": 3})
    assert list(node) == []
    with pytest.raises(ValueError, match="position=9"):
        node.restore({"position": 9})


def test_base_node_requires_the_three_methods():
    with pytest.raises(NotImplementedError):
        next(Node())


@pytest.mark.parametrize("drop_last", [True, False])
def test_batcher_groups_and_drops_or_keeps_the_short_tail(drop_last):
    out = list(Batcher(ListNode(list(range(7))), batch_size=3, drop_last=drop_last))
    expected = [[0, 1, 2], [3, 4, 5]] + ([] if drop_last else [[6]])
    assert out == expected


def test_batcher_nests_its_source_state_and_resumes_exactly():
    node = Batcher(ListNode(list(range(10))), batch_size=2)
    next(node)
    assert node.get_state() == {"source": {"position": 2}}
    assert_resume_equivalence(lambda: Batcher(ListNode(list(range(11))), batch_size=2), num_items=5)


def test_batcher_refuses_a_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        Batcher(ListNode([1]), batch_size=0)
