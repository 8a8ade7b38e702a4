from __future__ import annotations

import json

import pytest

from meshfeed.balance import BalancedBatches, CostModel
from meshfeed.testing import assert_same, take

from .checks import Samples

# One rank at max_tokens=64: the batches have 4, 2, 4 and 2 micro-steps.


def _balanced(**kwargs) -> BalancedBatches:
    inner = Samples(0, seed=3, batches=4, max_len=64, docs=8)
    return BalancedBatches(inner, **{"max_tokens": 64, **kwargs})


def _mid_batch() -> tuple[list[dict], dict, list[dict]]:
    """The first 2 of batch 0's 4 micro-steps, the state there (JSON), and every micro-step."""
    with _balanced() as it:
        full = list(it)
    with _balanced() as it:
        head = take(it, 2)
        state = json.loads(json.dumps(it.state_dict()))
    assert state["skip"] == 2
    return head, state, full


def test_a_skip_beyond_the_batch_is_refused_by_name_at_load():
    # skip=999 was clamped to the batch's 4 micro-steps: its last 2 were never served.
    _, state, _ = _mid_batch()
    with _balanced() as it:
        before = it.state_dict()
        with pytest.raises(ValueError, match=r"skip=999, more than the 4 micro-steps .*state_dict\(\) returned"):  # fmt: skip
            it.load_state_dict(dict(state, skip=999))
        assert it.state_dict() == before  # nothing was loaded


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"max_tokens": 128}, r"max_tokens=64, and this BalancedBatches has max_tokens=128"),
        ({"cost": CostModel(quadratic=1.0)}, r"has cost=CostModel\(linear=0.0, quadratic=1.0"),
    ],
)
def test_a_mid_batch_state_is_refused_by_a_pipeline_that_plans_its_batch_otherwise(setting, named):
    # A state 2 micro-steps into a batch loaded into max_tokens=128 skipped 2 of the batch's
    # 2 micro-steps there: its documents were lost.
    _, state, _ = _mid_batch()
    with _balanced(**setting) as it:
        with pytest.raises(ValueError, match=named + r".*Build BalancedBatches with"):
            it.load_state_dict(state)


def test_a_state_between_batches_resumes_under_other_settings():
    with _balanced() as it:
        take(it, 4)  # all of batch 0
        state = it.state_dict()
    assert state["skip"] == 0
    with _balanced(max_tokens=128) as it:
        it.load_state_dict(state)
        assert [s["num_microsteps"] for s in it if s["microstep"] == 0] == [1, 2, 1]


def test_a_mid_batch_state_resumes_exactly_and_so_does_one_without_the_new_fields():
    head, state, full = _mid_batch()
    assert state["microsteps"] == 4 and state["plan"]["max_tokens"] == 64
    old = {k: v for k, v in state.items() if k not in ("microsteps", "plan")}
    for given in (state, old):
        with _balanced() as it:
            it.load_state_dict(given)
            assert it.state_dict() == given
            tail = list(it)
        assert_same(head + tail, full)


def test_a_skip_beyond_the_batch_it_resumes_is_refused_at_that_batch_and_kept():
    # A state without 'microsteps' (an older one) is checked when its batch is planned: a
    # skip of 3 into batch 1 (2 micro-steps) served nothing of it, silently.
    _, state, _ = _mid_batch()
    old = {"kind": state["kind"], "version": state["version"], "inner": {**state["inner"], "i": 1}}
    old["skip"] = 3
    with _balanced() as it:
        it.load_state_dict(old)
        for _ in range(2):  # it stays refused
            with pytest.raises(ValueError, match=r"skip=3, more than the 2 micro-steps"):
                next(it)
        assert it.state_dict() == old  # the state loaded is not lost


def test_a_state_whose_batch_is_planned_into_other_micro_steps_is_refused():
    # The state says its batch had 4 micro-steps; its inner state resumes batch 1, of 2.
    _, state, _ = _mid_batch()
    moved = dict(state, inner={**state["inner"], "i": 1}, skip=1)
    with _balanced() as it:
        it.load_state_dict(moved)
        with pytest.raises(ValueError, match=r"taken 1 micro-steps into a batch of 4, which this BalancedBatches plans into 2"):  # fmt: skip
            next(it)


def test_a_malformed_plan_or_microsteps_is_refused():
    _, state, _ = _mid_batch()
    with _balanced() as it:
        with pytest.raises(ValueError, match="'plan' is 7"):
            it.load_state_dict(dict(state, plan=7))
        with pytest.raises(ValueError, match="'microsteps' is -1"):
            it.load_state_dict(dict(state, microsteps=-1))


def test_a_mid_batch_state_through_dcp_is_refused_by_another_max_tokens(tmp_path):
    # DCP loads into the keys of the loading BalancedBatches' own state: it has them all.
    import torch.distributed.checkpoint as dcp

    with _balanced() as it:
        take(it, 2)
        dcp.save({"data": it}, checkpoint_id=str(tmp_path), no_dist=True)
    with _balanced(max_tokens=128) as fresh:
        with pytest.raises(ValueError, match=r"max_tokens=64, and this BalancedBatches has max_tokens=128"):  # fmt: skip
            dcp.load({"data": fresh}, checkpoint_id=str(tmp_path), no_dist=True)
