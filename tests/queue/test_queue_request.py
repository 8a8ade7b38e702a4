"""GetRequest: one get, validated once by SampleStore.get, picklable for the Ray actor."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from meshfeed.queue import RankAwareSampler, SampleStore
from meshfeed.queue.request import GetRequest
from meshfeed.queue.samplers import SequentialSampler


def test_a_request_is_frozen_keyword_only_and_survives_pickling():
    sampler = RankAwareSampler(data_rank=0, replica_rank=1, replica_size=2)
    request = GetRequest(
        task="t", fields=("x",), batch_size=2, partition="p", sampler=sampler, batch_index=3,
        stream="s", prefetch=2, hold=True, token="tok", lease="L", context={"k": 1},
    )  # fmt: skip
    assert pickle.loads(pickle.dumps(request)) == request
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.task = "u"  # type: ignore[misc]
    with pytest.raises(TypeError):
        GetRequest("t", ("x",), 2, "p")  # type: ignore[misc]
    assert request.sampler_context() == {"k": 1, "batch_index": 3, "stream": "s"}
    assert request.agree == {"prefetch": 2} and not request.plain


def test_a_plain_request_carries_no_sampler_context():
    request = GetRequest(task="t", fields=("x", "y"), batch_size=2, partition="p")
    assert request.sampler == SequentialSampler() and request.plain
    assert request.sampler_context() == {}
    extra = GetRequest(
        task="t",
        fields=("x",),
        batch_size=2,
        partition="p",
        sampler=SequentialSampler(extra_fields=("y", "x")),
    )
    assert extra.need == ("x", "y")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_index": -1}, "batch_index must be an int >= 0"),
        ({"batch_index": True}, "batch_index must be an int >= 0"),
        ({"batch_index": "0"}, "batch_index must be an int >= 0"),
        ({"prefetch": 0}, "prefetch must be an int >= 1"),
        ({"agree": {"prefetch": 0}}, "prefetch must be an int >= 1"),
        ({"agree": {"other": 1}}, "pass prefetch=P instead"),
    ],
)
def test_get_refuses_a_bad_typed_context_value_by_name(kwargs, match):
    store = SampleStore()
    store.put("p", {"x": [1, 2]})
    with pytest.raises(ValueError, match=match):
        store.get("t", ["x"], 1, "p", timeout=1, **kwargs)
    assert store.get("t", ["x"], 2, "p", timeout=1).ids == [0, 1]  # nothing consumed


def test_prefetch_and_the_older_agree_spelling_are_one_setting_for_replica_peers():
    store = SampleStore()
    store.put("p", {"x": list(range(4))})
    lead = RankAwareSampler(data_rank=0, replica_rank=0, replica_size=2)
    lag = RankAwareSampler(data_rank=0, replica_rank=1, replica_size=2)
    first = store.get("t", ["x"], 2, "p", sampler=lead, batch_index=0, prefetch=2, timeout=1)
    again = store.get(
        "t", ["x"], 2, "p", sampler=lag, batch_index=0, agree={"prefetch": 2}, timeout=1
    )
    assert first.ids == again.ids == [0, 1]
    with pytest.raises(ValueError, match="replica peers must share"):
        store.get("t", ["x"], 2, "p", sampler=lag, batch_index=0, prefetch=3, timeout=1)
