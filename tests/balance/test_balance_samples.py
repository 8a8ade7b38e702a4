from __future__ import annotations

import numpy as np
import pytest
import torch

from meshfeed.balance.samples import PackCollate, SampleFields, merge_rows, pack_samples

FIELDS = SampleFields(token_fields=("input_ids", "labels", "loss_mask"))


def _sample(n: int, base: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(base, base + n),
        "labels": torch.arange(n) - 100,
        "loss_mask": torch.ones(n, dtype=torch.float32),
    }


def test_pack_samples_concatenates_token_fields_with_boundaries_and_positions():
    row = pack_samples([_sample(3, 10), _sample(2, 20)], FIELDS, ids=[7, 4])
    assert row["input_ids"].tolist() == [10, 11, 12, 20, 21]
    assert row["labels"].tolist() == [-100, -99, -98, -100, -99]
    assert row["loss_mask"].dtype == torch.float32
    assert row["cu_seqlens"].dtype == torch.int32 and row["cu_seqlens"].tolist() == [0, 3, 5]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1]
    assert row["document_ids"].tolist() == [7, 4]


def test_pack_samples_takes_spans_and_keeps_counting_positions_of_a_piece():
    row = pack_samples([_sample(5, 0), _sample(5, 0)], FIELDS, ids=[3, 3], spans=[(0, 2), (2, 5)])
    assert row["input_ids"].tolist() == [0, 1, 2, 3, 4]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4]
    assert row["cu_seqlens"].tolist() == [0, 2, 5]


def test_pack_samples_carries_per_sample_tensors_as_lists_and_with_offsets():
    fields = SampleFields(
        token_fields=("input_ids",), sample_fields=("grid",), concat_fields=("pixels",)
    )
    a = {"input_ids": np.arange(4), "grid": torch.tensor([[1, 2, 2]]), "pixels": torch.ones(4, 3)}
    b = {"input_ids": np.arange(2), "grid": torch.tensor([[1, 1, 2]]), "pixels": torch.zeros(2, 3)}
    row = pack_samples([a, b], fields)
    assert [g.tolist() for g in row["grid"]] == [[[1, 2, 2]], [[1, 1, 2]]]
    assert row["pixels"].shape == (6, 3) and row["pixels_offsets"].tolist() == [0, 4, 6]
    assert row["pixels"][4:].sum() == 0


def test_pack_samples_uses_given_position_ids():
    fields = SampleFields(token_fields=("input_ids", "position_ids"))
    s = {"input_ids": torch.arange(3), "position_ids": torch.tensor([0, 0, 1])}
    assert pack_samples([s], fields)["position_ids"].tolist() == [0, 0, 1]


def test_pack_samples_refuses_a_missing_field_naming_the_sample():
    bad = {"input_ids": torch.arange(3), "labels": torch.arange(3)}
    with pytest.raises(KeyError, match="sample 9 has no field 'loss_mask'"):
        pack_samples([_sample(2, 0), bad], FIELDS, ids=[1, 9])


def test_pack_samples_refuses_fields_of_unequal_length_naming_the_sample():
    bad = _sample(3, 0) | {"labels": torch.arange(2)}
    with pytest.raises(ValueError, match="sample 5 has fields of unequal length"):
        pack_samples([bad], FIELDS, ids=[5])


def test_pack_samples_refuses_a_sample_that_is_not_a_mapping():
    with pytest.raises(TypeError, match="sample 0 is a list, not a mapping"):
        pack_samples([[1, 2]], FIELDS)  # type: ignore[list-item]


def test_sample_fields_refuse_a_bare_string_and_reserved_names():
    with pytest.raises(TypeError, match="must be a tuple of field names"):
        SampleFields(token_fields="input_ids")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="written by packing"):
        SampleFields(token_fields=("input_ids", "cu_seqlens"))
    with pytest.raises(ValueError, match="named more than once"):
        SampleFields(token_fields=("input_ids",), sample_fields=("input_ids",))


def test_merge_rows_joins_rows_into_one_packed_sample():
    fields = SampleFields(token_fields=("input_ids",), concat_fields=("pixels",))
    rows = [
        pack_samples([{"input_ids": torch.arange(n), "pixels": torch.ones(n, 2)}], fields, ids=[i])
        for i, n in enumerate([3, 2, 4])
    ]
    merged = merge_rows(rows)
    assert merged["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert merged["cu_seqlens"].dtype == torch.int32
    assert merged["document_ids"].tolist() == [0, 1, 2]
    assert merged["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert merged["pixels"].shape == (9, 2) and merged["pixels_offsets"].tolist() == [0, 3, 5, 9]
    assert merge_rows(rows[:1])["cu_seqlens"].tolist() == [0, 3]


def test_pack_collate_packs_a_step_without_document_ids_and_pickles():
    import pickle

    collate = pickle.loads(pickle.dumps(PackCollate(FIELDS)))
    packed = collate([_sample(2, 0), _sample(3, 5)])
    assert packed["cu_seqlens"].tolist() == [0, 2, 5] and "document_ids" not in packed
    with pytest.raises(ValueError, match="sample 1 has fields of unequal length"):
        collate([_sample(2, 0), _sample(3, 5) | {"labels": torch.arange(1)}])


def _stream_rows(s: int):
    return iter([_sample(1 + (7 * s + k) % 9, 100 * s + 10 * k) for k in range(6)])


def test_a_stream_packed_per_step_resumes_exactly():
    from functools import partial

    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream
    from meshfeed.testing import assert_resume_equivalence

    def factory() -> StreamLoader:
        shards = [partial(_stream_rows, s) for s in range(4)]
        stream = ShardedStream(shards, shuffle_buffer=3, seed=2)
        return StreamLoader(stream, batch_size=4, seed=1, collate_fn=PackCollate(FIELDS))

    reference = assert_resume_equivalence(factory, num_items=9)
    for packed in reference:
        assert packed["cu_seqlens"][-1] == len(packed["input_ids"]) == len(packed["position_ids"])


@pytest.mark.parametrize("workers", [0, 2])
def test_the_sample_store_packs_its_batches_of_columns(workers):
    from meshfeed.queue import SampleStore, StoreLoader

    lengths = [1 + (5 * i) % 11 for i in range(30)]
    store = SampleStore(tasks=["t"])
    samples = [_sample(n, 100 * i) for i, n in enumerate(lengths)]
    store.put("p", {k: [s[k] for s in samples] for k in FIELDS.token_fields})
    store.close("p")
    loader = StoreLoader(
        store,
        task="t",
        fields=list(FIELDS.token_fields),
        partition="p",
        mesh={"dp": 1},
        rank=0,
        batch_size=4,
        num_workers=workers,
        timeout=60,
        collate_fn=PackCollate(FIELDS),
    )
    served = []
    for packed in loader:
        assert packed["cu_seqlens"][-1] == len(packed["input_ids"]) == len(packed["labels"])
        served += packed["input_ids"].tolist()
    assert sorted(served) == sorted(t for s in samples for t in s["input_ids"].tolist())


def test_a_field_named_like_offsets_is_joined_as_the_field_it_is():
    # merge_rows took every "*_offsets" key for a concat field's offsets: a token field
    # char_offsets lost the first value of each later row and shifted the rest.
    fields = SampleFields(token_fields=("input_ids", "char_offsets"))
    one = pack_samples(
        [{"input_ids": torch.tensor([1, 2, 3]), "char_offsets": torch.tensor([0, 4, 9])}], fields
    )
    two = pack_samples(
        [{"input_ids": torch.tensor([4, 5]), "char_offsets": torch.tensor([0, 6])}], fields
    )
    merged = merge_rows([one, two])
    assert merged["char_offsets"].tolist() == [0, 4, 9, 0, 6]
    assert merged["cu_seqlens"].tolist() == [0, 3, 5]


def test_a_field_named_as_a_concat_fields_offsets_is_refused():
    with pytest.raises(ValueError, match=r"\['pixels_offsets'\] are written by packing"):
        SampleFields(
            token_fields=("input_ids",),
            concat_fields=("pixels",),
            sample_fields=("pixels_offsets",),
        )
