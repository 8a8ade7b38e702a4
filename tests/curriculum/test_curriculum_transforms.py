"""Seqlen truncation and reshape: DeepSpeed's transform-only curriculum metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshfeed.curriculum import SeqlenReshape, SeqlenTruncate, fixed_linear

SCHEDULE = fixed_linear(8, 64, 10, 8)


def test_truncate_cuts_every_listed_key_and_leaves_the_rest():
    batch = {
        "input_ids": torch.arange(20).reshape(2, 10),
        "labels": torch.arange(20).reshape(2, 10),
        "lengths": torch.tensor([10, 10]),
    }
    out = SeqlenTruncate(schedule=SCHEDULE)(batch, 4)
    assert out["input_ids"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert out["labels"].shape == (2, 4) and out["input_ids"].is_contiguous()
    assert out["lengths"] is batch["lengths"]


def test_truncate_to_a_length_beyond_the_sequence_is_a_no_op():
    x = torch.zeros(3, 5)
    assert SeqlenTruncate(schedule=SCHEDULE)(x, 64) is x


def test_reshape_folds_rows_and_drops_only_the_remainder():
    x = np.arange(14).reshape(2, 7)
    out = SeqlenReshape(schedule=SCHEDULE)(x, 3)
    assert out.tolist() == [[0, 1, 2], [3, 4, 5], [7, 8, 9], [10, 11, 12]]


def test_reshape_keeps_trailing_feature_dimensions():
    x = torch.zeros(2, 8, 5)
    assert SeqlenReshape(schedule=SCHEDULE, keys=("emb",))({"emb": x}, 4)["emb"].shape == (4, 4, 5)


@pytest.mark.parametrize(
    ("batch", "difficulty", "message"),
    [
        (torch.zeros(4), 2, r"needs \[batch, seq, ...\] tensors"),
        (torch.zeros(2, 4), 0, "needs a positive sequence length"),
        ([1, 2, 3], 2, "need a tensor or a mapping of tensors"),
    ],
)
def test_bad_batches_are_refused(batch, difficulty, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SeqlenTruncate(schedule=SCHEDULE)(batch, difficulty)


def test_default_keys_are_meshfeeds_token_keys_plus_the_hugging_face_names():
    from meshfeed.curriculum.transforms import SEQLEN_KEYS
    from meshfeed.keys import DEFAULT_KEYS

    assert SEQLEN_KEYS[: len(DEFAULT_KEYS)] == DEFAULT_KEYS
    assert {"input_ids", "attention_mask"} <= set(SEQLEN_KEYS)
    row = torch.arange(10).reshape(1, 10)
    batch = {k: row.clone() for k in (*DEFAULT_KEYS, "input_ids", "attention_mask", "doc_ids")}
    out = SeqlenTruncate(schedule=SCHEDULE)(batch, 3)
    assert {k: v.shape[1] for k, v in out.items()} == {
        **dict.fromkeys((*DEFAULT_KEYS, "input_ids", "attention_mask"), 3),
        "doc_ids": 10,
    }
