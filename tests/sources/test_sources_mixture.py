"""Mixture: low-discrepancy interleave, per-source reshuffle, reweight schedule, exact resume."""

from __future__ import annotations

import json
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from meshfeed.loader import DataLoader
from meshfeed.order.interleave import MARK_EVERY, _Deadline
from meshfeed.sources.lazy import LazyDataset
from meshfeed.sources.mixture import MAX_PERIOD, Mixture, interleave_period
from meshfeed.testing import assert_resume_equivalence, take
from tests.optional import given, settings, st


def _src(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def _prefix_error(src: np.ndarray, shares: list[float]) -> float:
    n = np.arange(1, len(src) + 1)
    return max(
        float(np.abs(np.cumsum(src == s) - n * share).max()) for s, share in enumerate(shares)
    )


weights_strategy = st.lists(
    st.one_of(
        st.integers(0, 20).map(float),
        st.sampled_from([0.05, 0.1, 0.25, 0.3, 1 / 3, 0.7]),
        st.floats(0.001, 10.0),
    ),
    min_size=1,
    max_size=7,
).filter(lambda w: sum(w) > 0)


@settings(max_examples=50, deadline=None)
@given(weights=weights_strategy, start=st.integers(0, 10**12))
def test_every_prefix_holds_each_source_within_one_of_its_share(weights, start):
    names = [f"s{i}" for i in range(len(weights))]
    mix = Mixture({n: [0] for n in names}, dict(zip(names, weights, strict=True)))
    shares = list(mix.shares[0].values())
    period = round(1 / min(s for s in shares if s > 0)) if any(shares) else 1
    n = min(3 * max(period, 1), 20_000)
    src = mix.source_of(np.arange(n))
    assert _prefix_error(src, shares) < 1.0
    # Arbitrary far positions: counts are arithmetic and agree with the interleave there too
    # (a sequential earliest-deadline mixture is walked: keep its prefix short).
    if _sequential(mix):
        start %= 200_000
    counts = mix.counts(start)
    assert sum(counts.values()) == start
    for s, name in enumerate(names):
        assert abs(counts[name] - start * shares[s]) < 1.0


def test_exact_shares_for_decimal_and_integer_weights():
    mix = Mixture({"a": [0], "b": [0], "c": [0]}, {"a": 0.3, "b": 0.5, "c": 0.2})
    assert mix.shares[0] == {"a": 0.3, "b": 0.5, "c": 0.2}
    src = mix.source_of(np.arange(10))
    assert sorted(Counter(src.tolist()).items()) == [(0, 3), (1, 5), (2, 2)]


def test_weights_beyond_the_max_period_are_held_exactly_and_still_within_one():
    """Weights with no small common denominator are no longer rounded to 1/65536."""
    weights = {"a": 1 / 3.1, "b": 1 / 7.3, "c": 0.5, "d": 0.011}
    mix = Mixture({k: [0] for k in weights}, weights)
    assert sum(interleave_period([1, 1])) == 1
    exact = _exact_shares(list(weights.values()))
    assert list(mix.shares[0].values()) == [float(s) for s in exact]
    assert _prefix_error(mix.source_of(np.arange(3 * MAX_PERIOD)), [float(s) for s in exact]) < 1
    for n in (4_000_000, 10**12, 2**40):
        _assert_within_one(mix, exact, n)


@pytest.mark.parametrize("seed", range(4))
def test_the_period_table_of_many_sources_is_the_quota_method_s(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above 16 sources the table is built with heaps (#32): the same table as the loop."""
    from meshfeed.order import rational

    rng = np.random.default_rng(seed)
    cases = [[int(q) for q in rng.integers(0, 40, int(rng.integers(1, 60)))] for _ in range(40)]
    cases += [[1] * 300, [4] * 50, [3, 0, 5] * 30, [7] + [1] * 40]
    heap = [rational._interleave_period_heap(q) for q in cases if sum(q)]
    monkeypatch.setattr(rational, "_HEAP_SOURCES", 10**9)  # the plain loop for every size
    loop = [interleave_period(q) for q in cases if sum(q)]
    assert all(np.array_equal(a, b) for a, b in zip(heap, loop, strict=True))


def test_a_mixture_of_thousands_of_sources_keeps_its_shares() -> None:
    names = [f"c{i}" for i in range(3_000)]
    mix = Mixture({n: [0, 1] for n in names}, dict.fromkeys(names, 1))  # 1/3000 each
    counts = Counter(mix.source_of(np.arange(6_000)).tolist())
    assert sorted(counts.values()) == [2] * 3_000


def _exact_shares(weights: list[float]) -> list[Fraction]:
    fr = [Fraction(w) for w in weights]
    return [f / sum(fr) for f in fr]


def _assert_within_one(mix: Mixture, exact: list[Fraction], n: int) -> None:
    """Counts at prefix n are within +-1 of n * share (exact arithmetic, no enumeration)."""
    counts = mix.counts(n)
    assert sum(counts.values()) == n
    for name, share in zip(mix.names, exact, strict=True):
        assert abs(counts[name] - n * share) < 1, (name, n, counts[name], float(n * share))
    # The positions right after the prefix continue those counts (draws agree with counts).
    src, k = mix.draws(np.arange(n, n + 64))
    for s, kk in zip(src.tolist(), k.tolist(), strict=True):
        assert kk == counts[mix.names[s]]
        counts[mix.names[s]] += 1


def positive_weights(max_size: int) -> st.SearchStrategy[list[float | int]]:
    return st.lists(
        st.one_of(
            st.floats(1e-9, 1e9, allow_subnormal=False),
            st.integers(1, 10**30),
            st.sampled_from([0.1, 0.3, 1 / 3, 0.123457, 0.876543, 1e-7]),
        ),
        min_size=1,
        max_size=max_size,
    )


@settings(max_examples=150, deadline=None)
@given(weights=positive_weights(3), n=st.integers(0, 2**40))
def test_any_positive_weights_of_up_to_three_sources_hold_within_one_up_to_2_to_the_40(weights, n):
    names = [f"s{i}" for i in range(len(weights))]
    mix = Mixture({x: [0] for x in names}, dict(zip(names, weights, strict=True)))
    assert mix.max_deviation[0] <= 1  # exactly below 1; a float may round 1 - 1e-17 up
    _assert_within_one(mix, _exact_shares(weights), n)


def _sequential(mix: Mixture) -> bool:
    return any(seg.kind == "deadline" for seg in mix._segments)


def _far(mix: Mixture, n: int) -> int:
    """A prefix to check: any up to 2**40 for arithmetic interleaves; a walkable one otherwise."""
    return n % 300_000 if _sequential(mix) else n


@settings(max_examples=60, deadline=None)
@given(weights=positive_weights(8).filter(lambda w: len(w) >= 4), n=st.integers(0, 2**40))
@pytest.mark.slow
def test_any_positive_weights_of_four_to_eight_sources_hold_within_one(weights, n):
    names = [f"s{i}" for i in range(len(weights))]
    mix = Mixture({x: [0] for x in names}, dict(zip(names, weights, strict=True)))
    assert mix.max_deviation[0] <= 1  # exactly below 1; a float may round 1 - 1e-17 up
    _assert_within_one(mix, _exact_shares(weights), _far(mix, n))


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.floats(1e-6, 1e6, allow_subnormal=False), min_size=6, max_size=8),
    n=st.integers(0, 2**40),
)
@pytest.mark.slow
def test_more_sources_stay_within_one(weights, n):
    names = [f"s{i}" for i in range(len(weights))]
    mix = Mixture({x: [0] for x in names}, dict(zip(names, weights, strict=True)))
    n = _far(mix, n)
    counts = mix.counts(n)
    assert mix.max_deviation[0] <= 1  # exactly below 1 (see above)
    for name, share in zip(names, _exact_shares(weights), strict=True):
        assert abs(counts[name] - n * share) <= mix.max_deviation[0]


# Weightings of five and six sources whose best rounding tree cannot prove +-1 (they fell back
# to 1/65536 rounding before): the earliest-deadline interleave holds them.
EDF_WEIGHTS = [
    [12.190981666243244, 72.69509302318598, 1.300300876779305, 51.6338960582451, 0.0136384434451],
    [
        37.469724054544116,
        0.0010295236322606903,
        0.4702438932156436,
        21.342249566728263,
        0.023581603214276145,
        469.48765087057234,
    ],
]


def _deviation_ok(src: np.ndarray, shares: list[Fraction], bound: float) -> None:
    """Every prefix of ``src`` holds each source within ``bound`` (< 1) of n * share."""
    n = np.arange(1, len(src) + 1)
    for s, share in enumerate(shares):
        err = np.abs(np.cumsum(src == s) - n * float(share)).max()
        assert err <= bound + 1e-6 and err < 1, (s, float(err), bound)


@pytest.mark.parametrize("weights", EDF_WEIGHTS, ids=lambda w: f"{len(w)}-sources")
@pytest.mark.slow
def test_weights_that_defeat_the_tree_use_earliest_deadline_and_hold_within_one(weights):
    names = [f"s{i}" for i in range(len(weights))]
    mix = Mixture({x: [0] for x in names}, dict(zip(names, weights, strict=True)))
    assert _sequential(mix)
    exact = _exact_shares(weights)
    _deviation_ok(mix.source_of(np.arange(200_000)), exact, mix.max_deviation[0])
    assert mix.max_deviation[0] == 1 - 1 / (2 * len(weights) - 2)
    for n in (1_000_000, 1_234_567, 2**21 + 5):
        _assert_within_one(mix, exact, n)


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(
        st.one_of(
            st.floats(1e-9, 1e9, allow_subnormal=False),
            st.integers(1, 10**30),
            st.sampled_from([1e-7, 3e-7, 0.123457, 1.0]),
        ),
        min_size=2,
        max_size=8,
    ),
    n=st.integers(0, 10**5),
)
@pytest.mark.slow
def test_earliest_deadline_holds_within_its_bound_for_any_weights(weights, n):
    """Tijdeman's rule, forced for every weighting of 2..8 sources, checked at every prefix."""
    exact = _exact_shares(weights)
    edf = _Deadline(exact)
    src, rank = edf.draws(np.arange(100_000))
    _deviation_ok(src, exact, edf.max_deviation)
    for s in range(len(weights)):  # ranks count the earlier draws of the same source
        assert np.array_equal(rank[src == s], np.arange(int((src == s).sum())))
    counts = edf.counts(n)
    assert counts.sum() == n
    assert all(abs(c - n * e) <= edf.D for c, e in zip(counts.tolist(), exact, strict=True))


def test_earliest_deadline_positions_agree_wherever_the_walk_starts():
    """Marks, the cursor and seeded counts are only shortcuts: the stream is one function."""
    exact = _exact_shares(EDF_WEIGHTS[0])
    whole = _Deadline(exact)
    src, rank = whole.draws(np.arange(3 * MARK_EVERY + 17))
    jumpy = _Deadline(exact)
    for at in (2 * MARK_EVERY + 3, 5, MARK_EVERY - 1, 3 * MARK_EVERY):
        s, r = jumpy.draws(np.arange(at, at + 17))
        assert np.array_equal(s, src[at : at + 17]) and np.array_equal(r, rank[at : at + 17])
    seeded = _Deadline(exact)
    at = 2 * MARK_EVERY + 3
    seeded.seed(at, whole.counts(at).tolist())
    assert seeded._start(at)[0] == at  # resumes from the seed, no walk from 0
    s, _ = seeded.draws(np.arange(at, at + 100))
    assert np.array_equal(s, src[at : at + 100])


def test_the_issue_weights_do_not_drift():
    """{0.123457, 0.876543} drifted by +7 at 4,000,000 positions with 1/65536 rounding."""
    weights = [0.123457, 0.876543]
    mix = Mixture({"a": [0], "b": [0]}, dict(zip("ab", weights, strict=True)))
    for n in (4_000_000, 123_456_789_012, 2**40):
        _assert_within_one(mix, _exact_shares(weights), n)


def test_tiny_weights_keep_their_share_and_never_divide_by_zero():
    mix = Mixture({"a": [0], "b": [0]}, {"a": 1e-7, "b": 1.0})
    assert mix.counts(10**9)["a"] in (99, 100, 101)  # 10**9 * 1e-7 / (1 + 1e-7) = 99.99999
    small = Mixture({"a": [0], "b": [0]}, {"a": 1e-7, "b": 3e-7})
    assert small.counts(4_000)["a"] in (999, 1000, 1001)
    _assert_within_one(small, _exact_shares([1e-7, 3e-7]), 2**40 - 7)


def test_huge_integer_weights_are_normalised():
    mix = Mixture({"a": [0], "b": [0]}, {"a": 10**400, "b": 3 * 10**400})
    assert mix.shares[0] == {"a": 0.25, "b": 0.75}
    assert mix.counts(4_000) == {"a": 1000, "b": 3000}
    lopsided = Mixture({"a": [0], "b": [0]}, {"a": 1, "b": 2**80})
    _assert_within_one(lopsided, [Fraction(1, 2**80 + 1), Fraction(2**80, 2**80 + 1)], 2**40)


def test_source_is_reshuffled_with_its_own_epoch_when_exhausted():
    mix = Mixture({"a": _src("a", 5), "b": _src("b", 50)}, {"a": 1, "b": 1})
    order = mix.make_order(dataset_length=len(mix), global_batch_size=5, seed=3)
    idx = order.indices(0, np.arange(40))
    from_a = [i for i in idx.tolist() if i < 5]
    assert len(from_a) == 20
    epochs = [from_a[k : k + 5] for k in range(0, 20, 5)]
    assert all(sorted(e) == list(range(5)) for e in epochs)  # each pass is a permutation
    assert len({tuple(e) for e in epochs}) > 1  # and passes are reshuffled
    from_b = [i for i in idx.tolist() if i >= 5]
    assert len(set(from_b)) == 20  # b is not exhausted: no repeats


def test_getitem_routes_concatenated_indices_to_sources():
    mix = Mixture({"a": _src("a", 3), "b": _src("b", 4)}, {"a": 1, "b": 1})
    assert len(mix) == 7
    assert [mix[i] for i in range(7)] == ["a0", "a1", "a2", "b0", "b1", "b2", "b3"]
    assert mix.__getitems__([6, 0, 3]) == ["b3", "a0", "b0"]
    with pytest.raises(IndexError):
        mix[7]


def test_loader_over_mixture_follows_the_weights_and_reports_consumption():
    mix = Mixture({"a": _src("a", 30), "b": _src("b", 90)}, {"a": 1, "b": 3})
    lo = DataLoader(mix, batch_size=4, mesh={"dp": 2}, rank=0, collate_fn=list)
    assert len(lo) == 120 // 8
    batches = [b for b in lo]
    assert all(len(b) == 4 for b in batches)
    consumed = lo.stats()["order"]
    assert consumed["kind"] == "mixture"
    # One full epoch: 120 positions, shares 1/4 and 3/4.
    assert consumed["consumed"] == {"a": 30, "b": 90}


def test_reweight_changes_the_interleave_from_the_given_step():
    mix = Mixture({"a": _src("a", 100), "b": _src("b", 100)}, {"a": 1, "b": 1})
    mix.reweight(3, {"a": 0, "b": 1})
    src = mix.source_of(np.arange(40), global_batch_size=4)
    assert Counter(src[:12].tolist()) == {0: 6, 1: 6}
    assert set(src[12:].tolist()) == {1}
    assert mix.counts(40, global_batch_size=4) == {"a": 6, "b": 34}


def test_schedule_in_the_constructor_equals_reweight():
    a = Mixture({"x": [0] * 9, "y": [0] * 9}, {0: {"x": 1, "y": 2}, 5: {"x": 3, "y": 1}})
    b = Mixture({"x": [0] * 9, "y": [0] * 9}, {"x": 1, "y": 2})
    b.reweight(5, {"x": 3, "y": 1})
    assert a.schedule == b.schedule and a.fingerprint == b.fingerprint
    pos = np.arange(200)
    assert np.array_equal(
        a.source_of(pos, global_batch_size=3), b.source_of(pos, global_batch_size=3)
    )


def _mixture_loader(schedule: bool = True) -> DataLoader:
    weights = {0: {"a": 1, "b": 1}, 4: {"a": 1, "b": 4}} if schedule else {"a": 1, "b": 1}
    mix = Mixture({"a": _src("a", 7), "b": LazyDataset(_src("b", 11))}, weights, seed=5)
    return DataLoader(mix, batch_size=3, mesh={"dp": 2}, rank=1, seed=2, collate_fn=list)


def test_resume_is_exact_across_a_reweight_and_epochs():
    ref = assert_resume_equivalence(_mixture_loader, num_items=10)
    assert len(ref) == 10  # 18 samples per epoch / global batch 6 = 3 steps: crosses epochs


def test_resume_restores_the_checkpoint_schedule_and_refuses_a_conflicting_one():
    source = _mixture_loader()
    take(source, 2)
    state = json.loads(json.dumps(source.state_dict()))
    assert state["order"]["schedule"] == [[0, [1, 1]], [4, [1, 4]]]  # readable back
    other = _mixture_loader(schedule=False)  # built with the initial weights only
    other.load_state_dict(state)
    assert other.dataset.schedule == source.dataset.schedule
    assert take(other, 5) == take(source, 5)
    clash = _mixture_loader(schedule=False)
    clash.dataset.reweight(1, {"a": 5, "b": 1})  # a change the run never made, before its position
    with pytest.raises(ValueError, match="weight schedule"):
        clash.load_state_dict(state)
    sources = {"a": _src("a", 7), "b": _src("b", 11)}
    assert (
        Mixture(sources, {"a": 2, "b": 1}).fingerprint
        != Mixture(sources, {"a": 1, "b": 1}).fingerprint
    )  # the step-0 weights are part of the fingerprint


def test_a_checkpoint_taken_after_reweight_resumes_with_the_schedule_in_the_constructor():
    """The loader records the fingerprint when built; a later reweight must not break resume."""
    mix = Mixture({"a": _src("a", 7), "b": _src("b", 11)}, {"a": 1, "b": 1}, seed=5)
    lo = DataLoader(mix, batch_size=3, seed=2, collate_fn=list)
    mix.reweight(4, {"a": 1, "b": 4})
    take(lo, 2)
    state = json.loads(json.dumps(lo.state_dict()))
    rest = take(lo, 6)
    schedule = {0: {"a": 1, "b": 1}, 4: {"a": 1, "b": 4}}
    again = Mixture({"a": _src("a", 7), "b": _src("b", 11)}, schedule, seed=5)
    fresh = DataLoader(again, batch_size=3, seed=2, collate_fn=list)
    fresh.load_state_dict(state)
    assert take(fresh, 6) == rest


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reweight_at_a_step_not_yet_returned_replans_what_was_prefetched(num_workers):
    def build() -> tuple[Mixture, DataLoader]:
        mix = Mixture({"a": _src("a", 40), "b": _src("b", 40)}, {"a": 1, "b": 1})
        return mix, DataLoader(mix, batch_size=2, collate_fn=list, num_workers=num_workers)

    declared, ref = build()
    declared.reweight(3, {"a": 1, "b": 3})
    want = take(ref, 12)
    mix, lo = build()
    it = iter(lo)
    got = [next(it) for _ in range(3)]  # steps 0-2 returned; later ones planned, prefetched
    mix.reweight(3, {"a": 1, "b": 3})  # step 3 is not returned yet: it is re-planned
    got += [next(it) for _ in range(9)]
    assert got == want
    with pytest.raises(ValueError, match=r"already returned batches up to .*step 12"):
        mix.reweight(5, {"a": 2, "b": 1})
    lo.shutdown()
    ref.shutdown()


@pytest.mark.parametrize(
    ("sources", "weights", "match"),
    [
        ({}, {}, "non-empty dict"),
        ({"a": []}, {"a": 1}, "is empty"),
        ({"a": [1]}, {"b": 1}, "one weight per source"),
        ({"a": [1]}, {"a": -1}, "not all zero"),
        ({"a": [1]}, {1: {"a": 1}}, "start at step 0"),
    ],
)
def test_bad_configuration_is_refused_with_the_fix(sources, weights, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Mixture(sources, weights)


@pytest.mark.parametrize(
    ("seed", "error", "match"),
    [(2**64, ValueError, r"seed must be in \[0, 2\*\*64\)"), (-1, ValueError, "seed must be in"),
     (True, TypeError, "seed must be an int")],
)  # fmt: skip
def test_a_seed_beyond_64_bits_is_refused_at_construction(seed, error, match):
    with pytest.raises(error, match=match):
        Mixture({"a": [1], "b": [2]}, {"a": 1, "b": 1}, seed=seed)


def test_loader_state_lives_in_the_order_not_in_the_mixture():
    mix = Mixture(
        {"a": _src("a", 40), "b": _src("b", 40)}, {0: {"a": 1, "b": 1}, 3: {"a": 1, "b": 3}}
    )
    small = DataLoader(mix, batch_size=2, collate_fn=list)
    big = DataLoader(mix, batch_size=8, collate_fn=list)
    take(small, 1)
    assert not hasattr(mix, "_frozen_until") and not hasattr(mix, "_global_batch_size")
    assert small.order.planned_until > 0 and big.order.planned_until == 0  # type: ignore[attr-defined]
    # Each order places the weight change with its own global batch size.
    assert small.order.describe(0, 8)["consumed"] == {"a": 3, "b": 5}  # type: ignore[attr-defined]
    assert big.order.describe(0, 32)["consumed"] == {"a": 14, "b": 18}  # type: ignore[attr-defined]


def test_a_checkpoint_of_the_rounded_interleave_is_refused_by_version():
    lo = _mixture_loader()
    old = json.loads(json.dumps(lo.state_dict()))
    old["order"] = {k: v for k, v in old["order"].items() if k != "version"}
    with pytest.raises(ValueError, match="version=None"):
        _mixture_loader().load_state_dict(old)


def test_a_checkpoint_with_inconsistent_consumption_is_refused():
    lo = _mixture_loader()
    take(lo, 2)
    state = json.loads(json.dumps(lo.state_dict()))
    state["order"]["consumed"] = {"a": 0, "b": 999}
    with pytest.raises(ValueError, match="per-source consumption"):
        _mixture_loader().load_state_dict(state)


def _edf_loader(dp: int = 2, rank: int = 1, seed: int = 2) -> DataLoader:
    names = [f"s{i}" for i in range(5)]
    sources = {x: _src(x, 3 + 2 * i) for i, x in enumerate(names)}
    mix = Mixture(sources, dict(zip(names, EDF_WEIGHTS[0], strict=True)), seed=5)
    return DataLoader(
        mix, batch_size=8 // dp, mesh={"dp": dp}, rank=rank, seed=seed, collate_fn=list
    )


def test_resume_is_exact_for_a_sequential_earliest_deadline_mixture():
    assert _sequential(_edf_loader().dataset)
    ref = assert_resume_equivalence(_edf_loader, num_items=12)
    assert len(ref) == 12  # 35 samples per epoch -> 4 steps of 8: crosses two epochs


def _edf_global_stream(loaders: list[DataLoader], steps: int) -> list[list[str]]:
    outs = [take(lo, steps) for lo in loaders]
    return [sum((o[s] for o in outs), []) for s in range(steps)]


def test_elastic_resume_of_an_earliest_deadline_mixture_from_four_to_two_data_ranks():
    reference = _edf_global_stream([_edf_loader(4, r) for r in range(4)], 14)
    first = [_edf_loader(4, r) for r in range(4)]
    for lo in first:
        take(lo, 5)
    state = json.loads(json.dumps(first[3].state_dict()))
    resumed = []
    for r in range(2):
        lo = _edf_loader(2, r)
        lo.load_state_dict(state)
        resumed.append(lo)
    assert _edf_global_stream(resumed, 9) == reference[5:14]


def test_a_checkpoint_of_an_earliest_deadline_mixture_carries_and_reseeds_its_counts():
    lo = _edf_loader(dp=1, rank=0)
    take(lo, 3)
    state = json.loads(json.dumps(lo.state_dict()))
    order = state["order"]
    assert sum(order["consumed"].values()) == order["stream_position"] == 24
    fresh = _edf_loader(dp=1, rank=0)
    fresh.load_state_dict(state)
    seg = fresh.dataset._segments[0]
    assert seg._seeds == {24: tuple(order["consumed"].values())}
    assert take(fresh, 4) == take(lo, 4)


def test_an_earliest_deadline_checkpoint_with_wrong_counts_is_refused():
    lo = _edf_loader(dp=1, rank=0)
    take(lo, 2)
    good = json.loads(json.dumps(lo.state_dict()))
    assert good["order"]["consumed"] == {"s0": 1, "s1": 9, "s2": 0, "s3": 6, "s4": 0}
    for consumed, why in [
        ({"s0": 1, "s1": 8, "s2": 1, "s3": 6, "s4": 0}, "expected"),  # within the bound
        ({"s0": 1, "s1": 10, "s2": 0, "s3": 5, "s4": 0}, "away from 16"),  # beyond it
        ({"s0": 1, "s1": 9, "s2": 0, "s3": 6, "s4": 1}, "summing to 16"),
    ]:
        state = json.loads(json.dumps(good))
        state["order"]["consumed"] = consumed
        with pytest.raises(ValueError, match=f"per-source consumption.*{why}"):
            _edf_loader(dp=1, rank=0).load_state_dict(state)
    state = json.loads(json.dumps(good))
    state["order"]["bases"] = [[0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="segment starts"):
        _edf_loader(dp=1, rank=0).load_state_dict(state)


def test_earliest_deadline_memory_is_bounded():
    """Marks thin out (every second one kept, the start always) and seeds are first-in-first-out."""
    from meshfeed.order import interleave

    edf = _Deadline(_exact_shares(EDF_WEIGHTS[0]))
    for j in range(1, 3 * interleave._MAX_MARKS):
        edf._remember(j * MARK_EVERY, (j, 0, 0, 0, 0))
    assert len(edf._marks) <= interleave._MAX_MARKS and 0 in edf._marks
    for j in range(3 * interleave._MAX_SEEDS):
        edf.seed(j, [j, 0, 0, 0, 0])
    assert sorted(edf._seeds) == list(range(2 * interleave._MAX_SEEDS, 3 * interleave._MAX_SEEDS))


def test_a_walk_from_counts_that_are_not_the_interleaves_own_raises_by_name():
    edf = _Deadline(_exact_shares(EDF_WEIGHTS[0]))
    edf.seed(1000, [1000, 0, 0, 0, 0])  # seed() trusts its caller; the walk does not
    with pytest.raises(ValueError, match="counts at position 1000 that are not its own"):
        edf.draws(np.arange(1000, 1010))


def test_far_earliest_deadline_counts_are_checked_against_the_bound_without_a_walk():
    """Beyond a cheap walk, carried counts are checked against the bound and then trusted."""
    exact = _exact_shares(EDF_WEIGHTS[0])
    far = 10**12
    plausible = [math.floor(far * s) for s in exact]
    plausible[1] += far - sum(plausible)
    edf = _Deadline(exact)
    why = edf.check_counts(far, plausible)
    if all(abs(c - far * s) <= edf.D for c, s in zip(plausible, exact, strict=True)):
        assert why is None and edf._cursor[0] == 0  # no walk happened
    wrong = [*plausible]
    wrong[0] += 2
    wrong[1] -= 2
    assert "away from" in (edf.check_counts(far, wrong) or "")


def test_a_reweight_restarts_the_earliest_deadline_from_the_counts_at_the_change():
    """Per segment, +-1 of the segment's shares holds for the positions since the change."""
    names = [f"s{i}" for i in range(5)]
    w0 = dict(zip(names, EDF_WEIGHTS[0], strict=True))
    w1 = dict(zip(names, reversed(EDF_WEIGHTS[0]), strict=True))
    mix = Mixture({x: [0] * 10 for x in names}, {0: w0, 100: w1})
    G = 16
    src = mix.source_of(np.arange(3200), global_batch_size=G)
    _deviation_ok(src[: 100 * G], _exact_shares(list(w0.values())), mix.max_deviation[0])
    _deviation_ok(src[100 * G :], _exact_shares(list(w1.values())), mix.max_deviation[1])
    at_change = mix.counts(100 * G, global_batch_size=G)
    assert at_change == dict(
        zip(names, np.bincount(src[: 100 * G], minlength=5).tolist(), strict=True)
    )


# ---------------------------------------------------------------------- real processes
def _edf_dist_loader(world: int) -> DataLoader:
    names = [f"s{i}" for i in range(5)]
    sources = {x: _src(x, 3 + 2 * i) for i, x in enumerate(names)}
    mix = Mixture(sources, dict(zip(names, EDF_WEIGHTS[0], strict=True)), seed=5)
    return DataLoader(mix, batch_size=8 // world, seed=2, collate_fn=list, timeout=60)


def _edf_rank(rank: int, world: int, state: dict | None, steps: int) -> dict:
    lo = _edf_dist_loader(world)  # data rank and world size from the gloo process group
    if state is not None:
        lo.load_state_dict(state)
    out: dict = {"batches": take(lo, steps)}
    out["state"] = json.loads(json.dumps(lo.state_dict()))
    out["rest"] = take(lo, 9)
    return out


@pytest.mark.slow
def test_four_gloo_ranks_resume_an_earliest_deadline_mixture_on_two():
    from tests.dist_utils import run_distributed

    first = run_distributed(_edf_rank, 4, None, 5, timeout=240)
    then = run_distributed(_edf_rank, 2, first[3]["state"], 9, timeout=240)
    reference = _edf_global_stream([_edf_loader(4, r) for r in range(4)], 14)  # one process
    assert [sum((r["batches"][s] for r in first), []) for s in range(5)] == reference[:5]
    assert [sum((r["rest"][s] for r in first), []) for s in range(9)] == reference[5:14]
    assert [sum((r["batches"][s] for r in then), []) for s in range(9)] == reference[5:14]


def test_sources_given_as_a_list_are_refused_with_a_short_message_naming_the_fix():
    big = [list(range(10_000)), list(range(10_000, 30_000))]
    with pytest.raises(TypeError, match=r"non-empty dict name -> map-style source") as err:
        Mixture(big, weights={"a": 1})  # type: ignore[arg-type]
    message = str(err.value)
    assert len(message) < 400 and "Mixture({'web': web" in message  # not 30,000 numbers
