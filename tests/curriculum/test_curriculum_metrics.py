"""Metric definitions: validation, and the context a two-pass metric receives."""

from __future__ import annotations

import numpy as np
import pytest

from meshfeed.curriculum import (
    AccumulatedMetric,
    SampleMetric,
    seqlen,
    token_histogram,
    vocab_rarity,
)


def test_built_ins_are_named_and_typed_like_deepspeed_metrics():
    assert seqlen().name == "seqlen" and seqlen().dtype == "int64"
    rarity = vocab_rarity(10)
    assert rarity.dtype == "float64"
    assert [a.name for a in rarity.requires] == ["token_histogram"]
    assert token_histogram(10).size == 10


def test_per_sample_and_batched_built_ins_agree():
    docs = [np.array([1, 2, 2]), np.array([3]), np.array([0, 0, 0, 1])]
    m = seqlen()
    assert m.batch_fn is not None
    assert m.batch_fn(docs).tolist() == [m.fn(d) for d in docs]
    hist = token_histogram(4)
    a, b = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64)
    for d in docs:
        hist.fn(a, d)
    assert hist.batch_fn is not None
    hist.batch_fn(b, docs)
    assert a.tolist() == b.tolist() == [3, 2, 2, 1]


def test_prepare_turns_the_histogram_into_negative_log_probabilities():
    ctx = vocab_rarity(3).context({"token_histogram": np.array([2, 2, 0])})
    assert ctx[:2] == pytest.approx([np.log(2), np.log(2)]) and np.isinf(ctx[2])


def test_without_prepare_the_context_is_the_accumulated_array():
    acc = AccumulatedMetric(name="a", fn=lambda acc, x: None, size=2)
    m = SampleMetric(name="m", fn=lambda x, ctx: 0, requires=(acc,))
    assert m.context({"a": np.array([5, 6])}).tolist() == [5, 6]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SampleMetric(name="", fn=len), "metric name must be non-empty"),
        (lambda: SampleMetric(name="a/b", fn=len), "metric name must be non-empty"),
        (lambda: SampleMetric(name="m", fn=len, dtype="str"), "dtype must be numeric"),
        (lambda: AccumulatedMetric(name="h", fn=lambda a, x: None, size=0), "needs size >= 1"),
    ],
)
def test_bad_metric_definitions_are_refused(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def _count(hist, acc, docs, batched):
    """Feed ``docs`` to the histogram ``hist`` in one batched call, or one call per doc."""
    if batched:
        assert hist.batch_fn is not None
        hist.batch_fn(acc, docs)
    else:
        for doc in docs:
            hist.fn(acc, doc)


@pytest.mark.parametrize("batched", [False, True])
def test_token_ids_outside_the_vocabulary_are_refused_not_dropped(batched):
    hist = token_histogram(4)
    acc = np.zeros(4, dtype=np.int64)
    docs = [np.array([0, 1]), np.array([3, 4])]  # 4 is outside range(4)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 4\); pass vocab_size > 4"):
        _count(hist, acc, docs, batched)


@pytest.mark.parametrize("batched", [False, True])
def test_negative_token_ids_are_refused_as_negative_not_by_vocab_size(batched):
    hist = token_histogram(100)
    acc = np.zeros(100, dtype=np.int64)
    docs = [np.array([0, 1]), np.array([3, -2, 5, -7, 99])]
    where = "sample 1 of the analysed chunk of 2 samples" if batched else "the sample"
    with pytest.raises(ValueError, match=rf"token id -7 \(the smallest, at token 3 of {where}\)"):
        _count(hist, acc, docs, batched)
    with pytest.raises(ValueError, match=r"token ids must be >= 0") as info:
        hist.fn(acc, np.array([-1, 500]))  # negative and too large: the negative one is named
    assert "token id -1 " in str(info.value) and "vocab_size >" not in str(info.value)


@pytest.mark.parametrize("empty", [[], (), np.array([])], ids=["list", "tuple", "float-array"])
def test_an_empty_document_counts_zero_tokens(empty):
    docs = [[1, 2], empty, [2]]
    hist = token_histogram(4)
    one, batched = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64)
    for d in docs:
        hist.fn(one, d)
    assert hist.batch_fn is not None
    hist.batch_fn(batched, docs)
    assert one.tolist() == batched.tolist() == [0, 1, 2, 0]
    only_empty = np.zeros(4, dtype=np.int64)
    hist.batch_fn(only_empty, [empty])
    assert only_empty.tolist() == [0, 0, 0, 0]

    rarity = vocab_rarity(4)
    ctx = rarity.context({"token_histogram": one})
    assert rarity.batch_fn is not None
    assert rarity.batch_fn(docs, ctx).tolist() == [rarity.fn(d, ctx) for d in docs]
    assert rarity.fn(empty, ctx) == 0.0
