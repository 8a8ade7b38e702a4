from __future__ import annotations

import numpy as np
import pytest

from meshfeed.balance.synthetic import sample_batch, sample_lengths


def test_longtail_mixes_many_short_documents_with_a_few_very_long_ones():
    lengths = sample_lengths("longtail", 20_000, seed=1)
    long = lengths >= 32_768
    assert 0.005 < long.mean() < 0.02
    assert lengths[~long].min() >= 512 and lengths[~long].max() <= 4096
    assert lengths.max() <= 131_072


def test_lognormal_lengths_have_the_requested_median_and_stay_in_range():
    lengths = sample_lengths("lognormal", 20_000, seed=2, median=2048)
    assert 1800 < np.median(lengths) < 2300
    assert lengths.min() >= 1 and lengths.max() <= 131_072


def test_sample_batch_reaches_the_token_target_and_is_deterministic():
    a = sample_batch("lognormal", tokens=500_000, seed=3)
    assert a.sum() >= 500_000 and a[:-1].sum() < 500_000
    np.testing.assert_array_equal(a, sample_batch("lognormal", tokens=500_000, seed=3))
    assert not np.array_equal(a, sample_batch("lognormal", tokens=500_000, seed=4))


def test_sample_lengths_rejects_an_unknown_distribution():
    with pytest.raises(ValueError, match="choose from"):
        sample_lengths("zipf", 3)
