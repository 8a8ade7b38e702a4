from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from meshfeed import DataLoader
from meshfeed.balance import BalancedBatches, CostModel, PackedSamples, SampleFields, merge_rows
from meshfeed.testing import assert_resume_equivalence
from tests.dist_utils import run_distributed
from tests.optional import assume, given, settings, st

FIELDS = SampleFields(token_fields=("input_ids", "labels", "weight"))
SPAN = 10_000  # input_ids = sample * SPAN + offset: every token of every sample is unique


def _samples(lengths, extra=(), as_numpy=False) -> list[dict]:
    """Samples whose every field is a function of its tokens' ids; ``extra`` adds token fields
    ``f0``, ``f1``, ... of those numpy dtypes (``input_ids % 7``), as numpy arrays or tensors."""
    out = []
    for i, n in enumerate(lengths):
        ids = np.arange(i * SPAN, i * SPAN + n)
        fields = {"input_ids": ids, "labels": -ids, "weight": np.full(n, float(i))}
        fields |= {f"f{k}": (ids % 7).astype(dtype) for k, dtype in enumerate(extra)}
        out.append(fields if as_numpy else {k: torch.from_numpy(v) for k, v in fields.items()})
    return out


def _all_tokens(lengths) -> list[int]:
    return sorted(i * SPAN + k for i, n in enumerate(lengths) for k in range(n))


def _check_row(row: dict, max_tokens: int, extra=()) -> None:
    for k, dtype in enumerate(extra):
        want = torch.from_numpy((row["input_ids"].numpy() % 7).astype(dtype))
        assert torch.equal(row[f"f{k}"], want)
    cu = row["cu_seqlens"].tolist()
    assert row["cu_seqlens"].dtype == torch.int32 and cu[0] == 0
    assert cu[-1] == len(row["input_ids"]) <= max_tokens
    assert torch.equal(row["labels"], -row["input_ids"])  # fields stay aligned
    assert torch.equal(row["weight"], (row["input_ids"] // SPAN).double())
    for k, doc in enumerate(row["document_ids"].tolist()):
        ids = row["input_ids"][cu[k] : cu[k + 1]]
        assert (ids // SPAN == doc).all()
        # positions restart per sample (a split piece keeps counting from its offset)
        assert torch.equal(row["position_ids"][cu[k] : cu[k + 1]], ids % SPAN)


def _loaders(rows: PackedSamples, global_rows: int, dp: int, seed: int) -> list[DataLoader]:
    return [
        DataLoader(
            rows,
            batch_size=global_rows // dp,
            mesh={"dp": dp},
            rank=d,
            seed=seed,
            drop_last=False,
            collate_fn=merge_rows,
        )
        for d in range(dp)
    ]


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=60),
    max_tokens=st.integers(40, 120),
    window=st.integers(1, 40),
    method=st.sampled_from(["best_fit", "first_fit"]),
    dp=st.sampled_from([(1, 2), (2, 4), (4, 1), (2, 2)]),
    stop=st.integers(0, 30),
    seed=st.integers(0, 3),
    extra=st.lists(st.sampled_from(["int16", "float32", "bool"]), max_size=2),
    as_numpy=st.booleans(),
)
def test_every_token_trained_once_per_epoch_with_resume_on_another_dp_size(
    lengths, max_tokens, window, method, dp, stop, seed, extra, as_numpy
):
    names = tuple(f"f{k}" for k in range(len(extra)))
    rows = PackedSamples(
        _samples(lengths, extra, as_numpy),
        max_tokens=max_tokens,
        fields=SampleFields(token_fields=(*FIELDS.token_fields, *names)),
        lengths=lengths,
        window=window,
        method=method,
        seed=seed,
        long_samples="split",
    )
    global_rows = 4
    last = len(rows) % global_rows
    assume(
        len(rows) > 0 and (last == 0 or last >= max(dp))
    )  # no wrap-around padding of a tiny last batch
    before = _loaders(rows, global_rows, dp[0], seed)
    its = [iter(loader) for loader in before]
    served: list[int] = []
    for _ in range(stop):
        batches = [next(it, None) for it in its]
        if batches[0] is None:
            assert sorted(served) == _all_tokens(lengths)
            return
        for b in batches:
            _check_row(b, max_tokens * global_rows, extra)
            served += b["input_ids"].tolist()
    state = before[0].state_dict()
    assert all(loader.state_dict() == state for loader in before)  # one position for all ranks
    after = _loaders(rows, global_rows, dp[1], seed)
    for loader in after:
        loader.load_state_dict(state)
    for batches in zip(*after, strict=True):
        for b in batches:
            _check_row(b, max_tokens * global_rows, extra)
            served += b["input_ids"].tolist()
    assert sorted(served) == _all_tokens(lengths)


def test_rows_hold_whole_samples_within_the_budget_and_pack_tightly():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 500)
    rows = PackedSamples(_samples(lengths), max_tokens=512, fields=FIELDS, lengths=lengths)
    seen = Counter()
    for r in range(len(rows)):
        row = rows[r]
        _check_row(row, 512)
        seen.update(row["document_ids"].tolist())
    assert seen == Counter(range(500))
    assert lengths.sum() / (len(rows) * 512) > 0.97


def test_the_plan_is_a_pure_function_of_seed_and_lengths():
    lengths = np.random.default_rng(1).integers(1, 60, 300)
    a = PackedSamples(_samples(lengths), max_tokens=128, fields=FIELDS, lengths=lengths, seed=3)
    b = PackedSamples(list(range(300)), max_tokens=128, lengths=lengths.tolist(), seed=3)
    c = PackedSamples(list(range(300)), max_tokens=128, lengths=lengths, seed=4)
    assert [a.row_samples(r) for r in range(len(a))] == [b.row_samples(r) for r in range(len(b))]
    assert [a.row_samples(r) for r in range(len(a))] != [c.row_samples(r) for r in range(len(c))]
    assert a.fingerprint != c.fingerprint


def test_a_loader_of_packed_rows_resumes_exactly_across_epochs():
    lengths = np.random.default_rng(2).integers(0, 50, 64)

    def factory() -> DataLoader:
        rows = PackedSamples(
            _samples(lengths), max_tokens=64, fields=FIELDS, lengths=lengths, window=16
        )
        return DataLoader(rows, batch_size=2, collate_fn=merge_rows, seed=5)

    assert_resume_equivalence(factory, num_items=2 * len(factory()) + 3)


def test_a_loader_of_packed_rows_resumes_exactly_with_worker_processes():
    lengths = np.random.default_rng(3).integers(1, 50, 48)

    def factory() -> DataLoader:
        rows = PackedSamples(_samples(lengths), max_tokens=64, fields=FIELDS, lengths=lengths)
        return DataLoader(rows, batch_size=2, collate_fn=merge_rows, num_workers=2)

    steps = len(factory())
    reference = assert_resume_equivalence(factory, num_items=steps + 2, every=3)
    served = [t for b in reference[:steps] for t in b["input_ids"].tolist()]
    assert len(served) == len(set(served)) > 0  # no token twice in an epoch
    assert set(served) <= set(_all_tokens(lengths))


def test_lengths_come_from_a_callable_or_the_dataset():
    class WithLengths(list):
        @property
        def lengths(self) -> np.ndarray:
            return np.array([len(s["input_ids"]) for s in self])

    data = _samples([3, 5, 2])
    by_call = PackedSamples(data, max_tokens=8, lengths=lambda i: [3, 5, 2][i])
    by_data = PackedSamples(WithLengths(data), max_tokens=8)
    assert by_call.row_samples(0) == by_data.row_samples(0)
    with pytest.raises(ValueError, match="reports none; pass lengths="):
        PackedSamples(data, max_tokens=8)
    with pytest.raises(ValueError, match="lengths has 2 entries for a dataset of 3 samples"):
        PackedSamples(data, max_tokens=8, lengths=[3, 5])


def test_a_sample_disagreeing_with_its_length_is_refused_by_name():
    rows = PackedSamples(_samples([3, 5]), max_tokens=8, fields=FIELDS, lengths=[3, 4])
    with pytest.raises(ValueError, match="sample 1 has 5 tokens in 'input_ids' but its length"):
        [rows[r] for r in range(len(rows))]


def test_a_budget_smaller_than_one_sample_is_refused_naming_the_sample():
    with pytest.raises(ValueError, match="sample 1 has 9 tokens, more than a row holds \\(8\\)"):
        PackedSamples(_samples([3, 9]), max_tokens=8, fields=FIELDS, lengths=[3, 9])


def test_long_samples_are_truncated_or_split():
    data, lengths = _samples([3, 20]), [3, 20]
    cut = PackedSamples(data, max_tokens=8, fields=FIELDS, lengths=lengths, long_samples="truncate")
    kept = sorted(t for r in range(len(cut)) for t in cut[r]["input_ids"].tolist())
    assert kept == [0, 1, 2, *range(SPAN, SPAN + 8)]
    split = PackedSamples(data, max_tokens=8, fields=FIELDS, lengths=lengths, long_samples="split")
    pieces = [s for r in range(len(split)) for s in split.row_samples(r) if s[0] == 1]
    assert sorted(pieces) == [(1, 0, 8), (1, 8, 16), (1, 16, 20)]


def test_per_sample_fields_cannot_be_cut_into_pieces():
    fields = SampleFields(token_fields=("input_ids",), sample_fields=("pixels",))
    with pytest.raises(ValueError, match="would cut samples away from their per-sample fields"):
        PackedSamples([], max_tokens=8, fields=fields, lengths=[], long_samples="split")


def test_a_cost_budget_bounds_the_sum_of_squares_per_row():
    lengths = np.random.default_rng(4).integers(1, 40, 200)
    cost = CostModel(quadratic=1.0)
    rows = PackedSamples(
        _samples(lengths), max_tokens=4096, fields=FIELDS, lengths=lengths, cost=cost, max_cost=2000
    )
    sizes = [np.diff(rows[r]["cu_seqlens"].numpy()) for r in range(len(rows))]
    assert all(int((s.astype(np.int64) ** 2).sum()) <= 2000 for s in sizes)
    assert sorted(np.concatenate(sizes).tolist()) == sorted(lengths.tolist())
    with pytest.raises(ValueError, match="cost and max_cost go together"):
        PackedSamples([], max_tokens=8, lengths=[], cost=cost)
    with pytest.raises(ValueError, match="sample 0 has 50 tokens, more than a row holds \\(44\\)"):
        PackedSamples([{}], max_tokens=4096, lengths=[50], cost=cost, max_cost=2000)


@pytest.mark.parametrize("window", [0, -1, 2.0, True, "8"])
def test_a_window_that_is_not_a_positive_int_is_refused_by_name(window):
    with pytest.raises(ValueError, match=r"window must be a positive int \(got window="):
        PackedSamples(_samples([3, 5]), max_tokens=8, fields=FIELDS, lengths=[3, 5], window=window)


@pytest.mark.parametrize("max_cost", [float("inf"), float("nan"), 0, -1e300, True, "9"])
@pytest.mark.parametrize("cost", [CostModel(linear=1.0), CostModel(linear=1.0, quadratic=0.5)])
def test_a_max_cost_that_is_not_a_finite_positive_number_is_refused_by_name(cost, max_cost):
    with pytest.raises(ValueError, match=r"max_cost must be a finite number > 0 \(got max_cost="):
        PackedSamples(
            _samples([3, 5]),
            max_tokens=8,
            fields=FIELDS,
            lengths=[3, 5],
            cost=cost,
            max_cost=max_cost,
        )


def test_a_max_cost_beyond_any_row_holds_every_sample_up_to_max_tokens():
    cost = CostModel(linear=1.0, quadratic=1.0)  # 4 * quadratic * max_cost overflows a float
    rows = PackedSamples(
        _samples([3, 5]), max_tokens=8, fields=FIELDS, lengths=[3, 5], cost=cost, max_cost=1.7e308
    )
    assert len(rows) == 1 and rows[0]["cu_seqlens"].tolist() in ([0, 3, 8], [0, 5, 8])


BALANCE_KEYS = ("input_ids", "labels", "weight", "position_ids")
BALANCE_PAD = {"input_ids": -1, "labels": 1, "weight": 0, "position_ids": None}
FEED_LENGTHS = (
    np.random.default_rng(11).integers(1, 150, 90).tolist()
)  # 59 rows: no wrap-around padding


def _balanced_tokens(rank: int, world: int, group) -> list[list[int]]:
    rows = PackedSamples(
        _samples(FEED_LENGTHS),
        max_tokens=128,
        fields=FIELDS,
        lengths=FEED_LENGTHS,
        window=32,
        long_samples="split",
    )
    loader = DataLoader(
        rows, batch_size=2, mesh={"dp": world}, rank=rank, drop_last=False, collate_fn=merge_rows
    )
    steps = []
    with BalancedBatches(
        loader, max_tokens=128, group=group, keys=BALANCE_KEYS, pad=BALANCE_PAD
    ) as micro:
        for step in micro:
            assert len(step["input_ids"]) <= 128
            assert step["num_microsteps"] >= 1
            ids = step["input_ids"]
            steps.append(ids[ids >= 0].tolist())
    return steps


def _balanced_rank(rank: int, world: int) -> list[list[int]]:
    import torch.distributed as dist

    return _balanced_tokens(rank, world, dist.group.WORLD)


def test_packed_rows_feed_balanced_batches_in_one_process():
    steps = _balanced_tokens(0, 1, None)
    assert sorted(t for s in steps for t in s) == _all_tokens(FEED_LENGTHS)


def test_packed_rows_feed_balanced_batches_on_2_gloo_ranks_every_token_once():
    ranks = run_distributed(_balanced_rank, 2, timeout=120.0)
    assert len(ranks[0]) == len(ranks[1])  # equal micro-steps on every rank
    served = sorted(t for steps in ranks for s in steps for t in s)
    assert served == _all_tokens(FEED_LENGTHS)


def test_token_budget_batches_give_every_rank_the_same_steps_within_the_budget():
    lengths = np.random.default_rng(5).integers(1, 300, 400)
    cost = CostModel(linear=1.0, quadratic=1 / 256)  # tokens plus an attention term
    rows = PackedSamples(
        _samples(lengths),
        max_tokens=1024,
        fields=FIELDS,
        lengths=lengths,
        cost=cost,
        max_cost=2048,
        output="padded",
    )
    loaders = [
        DataLoader(rows, batch_size=1, mesh={"dp": 4}, rank=d, collate_fn=merge_rows)
        for d in range(4)
    ]
    per_rank = [list(loader) for loader in loaders]
    assert len({len(steps) for steps in per_rank}) == 1  # the same number of steps per epoch
    sizes = set()
    for steps in per_rank:
        for batch in steps:
            n = batch["attention_mask"].sum(dim=1).numpy()
            assert float(cost.work(n).sum()) <= 2048
            assert torch.equal(
                batch["labels"][batch["attention_mask"] == 1],
                -batch["input_ids"][batch["attention_mask"] == 1],
            )
            assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
            sizes.add(batch["input_ids"].shape[0])
    assert len(sizes) > 3  # the batch size varies with the samples' lengths
    with pytest.raises(ValueError, match="output='padded' pads token fields only"):
        fields = SampleFields(token_fields=("input_ids",), sample_fields=("pixels",))
        PackedSamples([], max_tokens=8, fields=fields, lengths=[], output="padded")


def test_documents_of_a_token_corpus_pack_with_the_corpus_lengths(tmp_path):
    from meshfeed.sources import TokenDocuments, write_indexed

    rng = np.random.default_rng(6)
    docs = [rng.integers(1, 999, int(n)) for n in rng.integers(1, 90, 50)]
    write_indexed(tmp_path / "corpus", iter(docs), np.uint16)
    rows = PackedSamples(
        TokenDocuments(tmp_path / "corpus"),  # reports .lengths: nothing read to plan
        max_tokens=128,
        fields=SampleFields(token_fields=("tokens",)),
    )
    for r in range(len(rows)):
        row = rows[r]
        cu = row["cu_seqlens"].tolist()
        assert row["tokens"].dtype == torch.int64  # as pack_documents gives a corpus's tokens
        for k, doc in enumerate(row["document_ids"].tolist()):
            assert row["tokens"][cu[k] : cu[k + 1]].tolist() == docs[doc].tolist()
    assert sorted(i for r in range(len(rows)) for i, _, _ in rows.row_samples(r)) == list(range(50))


def _feed_rows() -> PackedSamples:
    return PackedSamples(
        _samples(FEED_LENGTHS),
        max_tokens=128,
        fields=FIELDS,
        lengths=FEED_LENGTHS,
        window=32,
        long_samples="split",
    )


@pytest.mark.ray
@pytest.mark.slow
def test_packed_rows_on_the_ray_service_match_each_rank_read_alone(ray_session):
    from meshfeed.services.ray import RayService
    from meshfeed.testing import take

    kwargs = {"batch_size": 2, "mesh": {"dp": 2}, "seed": 3, "collate_fn": merge_rows}
    loader = DataLoader(_feed_rows, service=RayService(), **kwargs)
    try:
        remote = take(loader, 3)
        for rank in range(2):
            local = take(DataLoader(_feed_rows(), rank=rank, **kwargs), 3)
            got = ray_session.get([rb.for_rank(rank) for rb in remote])
            for want, have in zip(local, got, strict=True):
                assert torch.equal(want["input_ids"], have["input_ids"])
                assert torch.equal(want["cu_seqlens"], have["cu_seqlens"])
    finally:
        loader.shutdown()


def test_balanced_micro_steps_of_packed_rows_resume_exactly_from_every_step():
    def factory() -> BalancedBatches:
        loader = DataLoader(_feed_rows(), batch_size=3, collate_fn=merge_rows, drop_last=False)
        return BalancedBatches(
            loader, max_tokens=128, keys=BALANCE_KEYS, pad=BALANCE_PAD, plan_ahead=False
        )

    steps = assert_resume_equivalence(factory, num_items=30, every=4, cleanup=lambda b: b.close())
    assert all(len(s["input_ids"]) <= 128 for s in steps)
