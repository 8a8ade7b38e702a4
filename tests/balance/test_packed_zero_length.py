from __future__ import annotations

import pytest
import torch

from meshfeed.balance import PackedSamples, SampleFields

TOKENS = SampleFields(token_fields=("input_ids",))


class _Samples:
    """Samples of ``real`` tokens each; counts how often each is read."""

    def __init__(self, real: list[int]) -> None:
        self.real = real
        self.reads = [0] * len(real)

    def __len__(self) -> int:
        return len(self.real)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads[i] += 1
        return {"input_ids": torch.arange(self.real[i])}


def _served(rows: PackedSamples) -> list[int]:
    return sorted(i for r in range(len(rows)) for i in rows[r]["document_ids"].tolist())


def test_a_length_of_0_for_a_sample_with_tokens_is_refused_by_name():
    # A declared length of 5 for a 10-token sample was refused, one of 0 was not: the sample
    # was left out of every row unread, its 10 tokens lost without a word.
    data = _Samples([10, 20, 30])
    with pytest.raises(ValueError, match=r"sample 0 has 10 tokens in 'input_ids' but its length says 0"):  # fmt: skip
        PackedSamples(data, max_tokens=100, lengths=[0, 20, 30], fields=TOKENS)


def test_samples_of_length_0_are_read_once_and_left_out():
    data = _Samples([0, 20, 0, 30])
    rows = PackedSamples(data, max_tokens=100, lengths=[0, 20, 0, 30], fields=TOKENS)
    assert data.reads == [1, 0, 1, 0]  # only the empty ones, once, at construction
    assert _served(rows) == [1, 3]
    assert data.reads == [1, 1, 1, 1]
