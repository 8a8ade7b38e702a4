"""Node protocol and ListNode: explicit state in the one envelope of meshfeed.state."""

from __future__ import annotations

import json

import pytest

from meshfeed.nodes import ListNode, Node
from meshfeed.protocols import Stateful
from meshfeed.testing import assert_resume_equivalence


def test_list_node_state_is_the_position_in_an_envelope():
    node = ListNode("abc")
    assert next(node) == "a"
    assert node.state_dict() == {"kind": "node.list", "version": 1, "position": 1}
    node.load_state_dict({"kind": "node.list", "version": 1, "position": 3})
    assert list(node) == []
    with pytest.raises(ValueError, match="'position' is 9, outside"):
        node.load_state_dict({"kind": "node.list", "version": 1, "position": 9})


def test_nodes_speak_the_stateful_protocol():
    assert isinstance(ListNode([1]), Stateful)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"position": 1}, "kind=None"),
        ({"kind": "node.list", "version": 0, "position": 1}, "version=0"),
        ({"kind": "node.list", "version": 1, "position": -1}, "negative"),
        ({"kind": "node.list", "version": 1, "position": True}, "'position'"),
        ({"kind": "node.shuffle", "version": 1, "position": 1}, "kind='node.shuffle'"),
    ],
)
def test_list_node_refuses_states_of_another_kind_version_or_type(state, match):
    with pytest.raises(ValueError, match=match):
        ListNode("abc").load_state_dict(state)


def test_next_many_matches_next_and_resumes_exactly():
    a, b = ListNode(list(range(10))), ListNode(list(range(10)))
    assert a.next_many(4) + a.next_many(0) + a.next_many(100) == list(b)
    assert a.next_many(3) == []
    assert_resume_equivalence(lambda: ListNode(list(range(7))), num_items=7)


def test_base_node_requires_next_and_the_state_methods():
    with pytest.raises(NotImplementedError):
        next(Node())
    with pytest.raises(NotImplementedError):
        Node().state_dict()


def test_the_harness_speaks_only_state_dict_and_load_state_dict():
    class Counter:
        """An iterator with no state protocol."""

        def __init__(self) -> None:
            self.i = 0

        def __next__(self) -> int:
            self.i += 1
            return self.i

    with pytest.raises(TypeError, match=r"Counter is not Stateful.*load_state_dict\(state\)"):
        assert_resume_equivalence(Counter, num_items=3)


def test_states_are_json():
    node = ListNode([1, 2])
    next(node)
    assert json.loads(json.dumps(node.state_dict())) == node.state_dict()


def test_materialize_writes_deferred_fields_in_nested_states_and_pickles():
    import pickle

    from meshfeed.nodes import Deferred, materialize

    snap = {"kind": "k", "source": {"buffer": Deferred(sorted, [3, 1, 2]), "row": 4}}
    want = {"kind": "k", "source": {"buffer": [1, 2, 3], "row": 4}}
    assert materialize(snap) == want
    assert materialize(pickle.loads(pickle.dumps(snap))) == want


def test_a_nodes_default_snapshot_is_its_state():
    node = ListNode([1, 2, 3])
    next(node)
    assert node.snapshot() == node.state_dict()
