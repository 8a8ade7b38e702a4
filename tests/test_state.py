"""The one state envelope: write with envelope(), read with open_envelope()."""

from __future__ import annotations

import pytest

from meshfeed.state import envelope, open_envelope


def test_envelope_round_trips_with_its_fields_checked():
    state = envelope("part", 3, count=2, name="a", flags=[1, 2])
    assert state == {"kind": "part", "version": 3, "count": 2, "name": "a", "flags": [1, 2]}
    read = open_envelope(state, kind="part", version=3, fields={"count": int, "name": str})
    assert read == state and read is not state


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ([1], "must be a dict"),
        ({"model": {}, "data": {"kind": "part"}}, "whole training checkpoint"),
        ({"kind": "other", "version": 3}, "kind='other', expected kind='part'"),
        ({"kind": "part", "version": 4}, "written by a newer meshfeed"),
        ({"kind": "part", "version": 1}, "written by meshfeed 0.1"),
        ({"version": 1}, "version=1, this meshfeed reads version 3"),
        ({"kind": "old-name", "version": 2}, "version=2, this meshfeed reads version 3"),
        ({"kind": "old-name", "version": 3}, "kind='old-name'"),
        ({"kind": "part", "version": True}, "malformed: it has no int 'version'.*version=True"),
        ({"kind": "part", "count": 1}, "part state is malformed: it has no int 'version'"),
        ({"kind": "part", "version": "3"}, "malformed: .*version='3'"),
        ({"kind": "part", "version": 3}, "missing 'count'"),
        ({"kind": "part", "version": 3, "count": True}, "'count' has True of type bool"),
        ({"kind": "part", "version": 3, "count": -1}, "'count' is negative"),
        ({"kind": "part", "version": 3, "count": 1, "x": {1, 2}}, "not JSON-serialisable"),
    ],
)
def test_bad_states_are_refused_by_name(state, match):
    with pytest.raises(ValueError, match=match):
        open_envelope(
            state, kind="part", version=3, fields={"count": int}, legacy_kinds=("old-name",)
        )
