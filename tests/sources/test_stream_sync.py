"""Rank alignment helpers: local no-ops without a process group (gloo runs in test_stream)."""

from __future__ import annotations

from meshfeed.sources.stream_sync import all_ranks_have_a_batch, check_agreement


def test_without_a_process_group_a_rank_agrees_with_itself():
    assert all_ranks_have_a_batch(True, timeout=1.0) is True
    assert all_ranks_have_a_batch(False, timeout=1.0) is False


def test_agreement_check_is_a_no_op_in_one_process():
    check_agreement({"seed": 3, "batch_size": 8}, timeout=1.0)
