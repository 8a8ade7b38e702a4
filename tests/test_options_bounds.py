"""Options refused at construction by name: a ``max_retries`` no run needs (one sample that
always fails would hold its batch for every retry, in the main process with no timeout) and
``device="meta"`` (no batch can be copied there)."""

from __future__ import annotations

import pytest
import torch

from meshfeed import DataLoader
from meshfeed.delivered import Delivered
from meshfeed.fetch import Fetcher
from meshfeed.options import MAX_RETRIES


def test_max_retries_beyond_the_bound_is_refused_by_name():
    with pytest.raises(ValueError, match=r"max_retries=1000000000 .*MAX_RETRIES = 100"):
        DataLoader(list(range(8)), batch_size=2, max_retries=10**9)
    with pytest.raises(ValueError, match="max_retries=101"):
        Fetcher(list(range(8)), seed=0, max_retries=MAX_RETRIES + 1)
    DataLoader(list(range(8)), batch_size=2, max_retries=MAX_RETRIES)  # the bound itself is fine


def test_device_meta_is_refused_by_name():
    with pytest.raises(ValueError, match=r"device='meta' holds no data"):
        DataLoader(list(range(8)), batch_size=2, device="meta")
    with pytest.raises(ValueError, match=r"device=device\(type='meta'\) holds no data"):
        Delivered(DataLoader(list(range(8)), batch_size=2), device=torch.device("meta"))
