from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from meshfeed.balance import PackedSamples, SampleFields, merge_rows, pack_samples

TOKENS = SampleFields(token_fields=("input_ids", "labels"))


class _Samples:
    """Samples whose tokens are ``100 * index + position``: a token names its sample and place."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = np.asarray(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.arange(int(self.lengths[i])) + 100 * i
        return {"input_ids": x, "labels": x}


def _rows(lengths: list[int], output: str, policy: str, max_tokens: int = 4) -> list[dict]:
    rows = PackedSamples(
        _Samples(lengths),
        max_tokens=max_tokens,
        long_samples=policy,
        shuffle=False,
        output=output,
        fields=TOKENS,
    )
    return [rows[r] for r in range(len(rows))]


def _pieces(row: dict, output: str) -> list[tuple[list[int], list[int]]]:
    """(tokens, position ids) of each sample or piece of a row, padded or packed."""
    if output == "padded":
        mask = row["attention_mask"].bool()
        return [
            (row["input_ids"][k][mask[k]].tolist(), row["position_ids"][k][mask[k]].tolist())
            for k in range(mask.shape[0])
        ]
    cu = row["cu_seqlens"].tolist()
    return [
        (row["input_ids"][a:b].tolist(), row["position_ids"][a:b].tolist())
        for a, b in itertools.pairwise(cu)
    ]


@pytest.mark.parametrize("policy", ["split", "truncate"])
def test_padded_pieces_keep_the_position_ids_of_the_packed_output(policy):
    # output="padded" restarted every piece of a split sample at position 0 (PadCollate's
    # arange): piece 2 of a 10-token sample in rows of 4 had positions 0..3, not 4..7.
    lengths = [10, 3, 6]
    packed = sorted(p for row in _rows(lengths, "packed", policy) for p in _pieces(row, "packed"))
    padded = sorted(p for row in _rows(lengths, "padded", policy) for p in _pieces(row, "padded"))
    assert padded == packed
    for tokens, positions in padded:
        assert positions == [t % 100 for t in tokens]  # a token's place in its sample
    if policy == "split":
        assert ([4, 5, 6, 7], [4, 5, 6, 7]) in padded
    else:
        assert all(p[0] == 0 for _, p in padded)


def test_padded_rows_pad_position_ids_with_zeros_after_a_split_piece():
    rows = _rows([10, 1], "padded", "split", max_tokens=6)  # pieces 6 + 4, then 1 token
    (both,) = [r for r in rows if r["input_ids"].shape[0] == 2]
    assert list(both) == ["input_ids", "labels", "attention_mask", "position_ids", "document_ids"]
    assert both["position_ids"].dtype == torch.int64
    assert sorted(both["position_ids"].tolist()) == [[0, 0, 0, 0], [6, 7, 8, 9]]
    assert sorted(both["attention_mask"].tolist()) == [[1, 0, 0, 0], [1, 1, 1, 1]]


def test_refused_long_samples_are_still_refused_with_padded_output():
    with pytest.raises(ValueError, match="sample 0 has 10 tokens"):
        _rows([10, 3], "padded", "refuse")


def test_padded_rows_keep_position_ids_given_as_a_token_field():
    fields = SampleFields(token_fields=("input_ids", "position_ids"))
    samples = [{"input_ids": torch.arange(6), "position_ids": torch.arange(6) * 10}]
    rows = PackedSamples(
        samples, max_tokens=4, lengths=[6], fields=fields, long_samples="split", output="padded"
    )
    got = sorted(rows[r]["position_ids"][0].tolist() for r in range(len(rows)))
    assert got == [[0, 10, 20, 30], [40, 50]]  # as given, not counted again


@pytest.mark.parametrize(
    ("kwargs", "clash"),
    [
        ({"sample_fields": ("image", "image_offsets")}, "image_offsets"),
        ({"token_fields": ("input_ids", "input_ids_offsets")}, "input_ids_offsets"),
        ({"sample_fields": ("image",), "concat_fields": ("image_offsets",)}, "image_offsets"),
        ({"sample_fields": ("cu_seqlens_offsets",)}, "cu_seqlens_offsets"),
        ({"sample_fields": ("document_ids_offsets",)}, "document_ids_offsets"),
        ({"sample_fields": ("position_ids_offsets",)}, "position_ids_offsets"),
        ({"concat_fields": ("pix",), "sample_fields": ("pix_offsets_offsets",)}, "pix_offsets_"),
    ],
)
def test_a_field_named_as_another_keys_offsets_is_refused(kwargs, clash):
    # merge_rows joins "<name>_offsets" as a concat field's offsets wherever the row holds
    # "<name>": a per-sample image_offsets beside image merged [1, 2] and [3, 4] into [1, 2, 6]
    # (and crashed on tensors). Such names are refused where the fields are named.
    kwargs = {"token_fields": ("input_ids",)} | kwargs
    with pytest.raises(ValueError, match=rf"\['{clash}.*\] are named as the offsets of"):
        SampleFields(**kwargs)


def _image(i: int, at: object) -> dict:
    return {"input_ids": torch.arange(6) + 10 * i, "image": torch.full((2, 2), float(i)), "at": at}


@pytest.mark.parametrize("tensors", [False, True])
def test_renamed_per_sample_fields_merge_as_per_sample_lists(tensors):
    fields = SampleFields(token_fields=("input_ids",), sample_fields=("image", "at"))
    at = [torch.tensor([k, k + 3]) if tensors else k for k in range(4)]
    rows = [
        pack_samples([_image(2 * r, at[2 * r]), _image(2 * r + 1, at[2 * r + 1])], fields)
        for r in range(2)
    ]
    merged = merge_rows(rows)
    assert [x if isinstance(x, int) else x.tolist() for x in merged["at"]] == [
        x if isinstance(x, int) else x.tolist() for x in at
    ]
    assert [float(x[0, 0]) for x in merged["image"]] == [0.0, 1.0, 2.0, 3.0]


def test_concat_fields_still_merge_with_their_offsets():
    fields = SampleFields(token_fields=("input_ids",), concat_fields=("pix",))
    rows = [
        pack_samples([{"input_ids": torch.arange(3), "pix": torch.zeros(n, 2)} for n in ns], fields)
        for ns in ([2, 1], [3])
    ]
    merged = merge_rows(rows)
    assert merged["pix"].shape == (6, 2) and merged["pix_offsets"].tolist() == [0, 2, 3, 6]


def test_concat_fields_of_different_trailing_shapes_name_the_field_and_samples():
    # torch.cat's bare "Sizes of tensors must match except in dimension 0" named neither the
    # field nor the samples.
    fields = SampleFields(token_fields=("input_ids",), concat_fields=("pix",))
    samples = [
        {"input_ids": torch.arange(3), "pix": torch.zeros(2, 3)},
        {"input_ids": torch.arange(2), "pix": torch.zeros(2, 3)},
        {"input_ids": torch.arange(2), "pix": torch.zeros(1, 4)},
    ]
    with pytest.raises(ValueError, match=r"concat field 'pix' cannot be concatenated") as err:
        pack_samples(samples, fields, ids=[7, 8, 9])
    text = str(err.value)
    assert "sample 7 has shape (2, 3)" in text and "sample 9 has shape (1, 4)" in text
    assert "sample 8" not in text  # one sample per shape
    assert "same trailing shape" in text and "sample_fields" in text
    with pytest.raises(ValueError, match=r"sample 0 has shape \(2, 3\), sample 2 has shape"):
        pack_samples(samples, fields)  # without ids: the samples' places in the list


def test_a_dataset_of_mismatched_concat_fields_names_its_samples():
    fields = SampleFields(token_fields=("input_ids",), concat_fields=("pix",))
    samples = [{"input_ids": torch.arange(2), "pix": torch.zeros(1, k + 2)} for k in range(2)]
    rows = PackedSamples(samples, max_tokens=8, lengths=[2, 2], fields=fields, shuffle=False)
    with pytest.raises(ValueError, match=r"'pix'.*sample 0 has shape \(1, 2\), sample 1 has"):
        rows[0]


@pytest.mark.parametrize("as_numpy", [False, True])
def test_token_fields_of_different_trailing_shapes_name_the_field(as_numpy):
    def emb(n: int, d: int):
        return np.zeros((n, d)) if as_numpy else torch.zeros(n, d)

    fields = SampleFields(token_fields=("input_ids", "emb"))
    samples = [
        {"input_ids": np.arange(2), "emb": emb(2, 3)},
        {"input_ids": np.arange(1), "emb": emb(1, 5)},
    ]
    with pytest.raises(ValueError, match=r"token field 'emb'.*sample 1 has shape \(1, 5\)"):
        pack_samples(samples, fields)


@pytest.mark.parametrize("kind", ["sample_fields", "concat_fields"])
def test_position_ids_as_a_per_sample_field_is_refused(kind):
    # It replaced the per-token position_ids packing writes, silently.
    with pytest.raises(ValueError, match=r"\['position_ids'\] are written by packing"):
        SampleFields(token_fields=("input_ids",), **{kind: ("position_ids",)})
    SampleFields(token_fields=("input_ids", "position_ids"))  # a token field: taken as given
