"""Curriculum over a Mixture: each source gated by its own difficulty, the weights still held."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from meshfeed import DataLoader
from meshfeed.curriculum import (
    Curriculum,
    CurriculumMetric,
    MetricIndex,
    SeqlenTruncate,
    fixed_linear,
)
from meshfeed.ordering import CurriculumMixtureOrder, build_order
from meshfeed.sources.mixture import Mixture
from meshfeed.testing import assert_resume_equivalence, take
from tests.optional import given, settings, st


class Docs:
    """Source ``name``: sample i is ``(name, i, length)``; the length is the metric."""

    def __init__(self, name: str, n: int, seed: int) -> None:
        self.name = name
        self.lengths = np.random.default_rng(seed).integers(1, 11, size=n)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[str, int, int]:
        return (self.name, int(i), int(self.lengths[i]))


def _index(name: str, values: np.ndarray) -> MetricIndex:
    return MetricIndex.from_values(name, values, fingerprint={"length": len(values), "hash": name})


def _whole(mix: Mixture, sources: list[Docs], schedule=None) -> Curriculum:
    values = np.concatenate([d.lengths for d in sources])
    metric = CurriculumMetric(
        index=_index("length", values), schedule=schedule or fixed_linear(2, 10, 8, 2)
    )
    return Curriculum([metric])


def _mixture(weights: dict[str, float], sizes=(300, 200), seed: int = 0):
    sources = [
        Docs(n, size, seed + i) for i, (n, size) in enumerate(zip(weights, sizes, strict=True))
    ]
    mix = Mixture({d.name: d for d in sources}, weights, seed=seed)
    return mix, sources


def _check_prefixes(batches: list[list[tuple[str, int, int]]], shares: dict[str, Fraction]):
    counts = dict.fromkeys(shares, 0)
    n = 0
    for batch in batches:
        for name, _, _ in batch:
            counts[name] += 1
        n += len(batch)
        for name, share in shares.items():
            assert abs(counts[name] - n * share) < 1, (name, n, counts[name], float(n * share))


def test_the_issue_example_keeps_the_mixture_instead_of_going_fifty_fifty():
    mix, sources = _mixture({"a": 0.8, "b": 0.2}, sizes=(400, 400))
    loader = DataLoader(
        mix, batch_size=16, seed=1, collate_fn=list, curriculum=_whole(mix, sources)
    )
    batches = take(loader, 31)  # 496 samples, as in the issue
    names = [s[0] for b in batches for s in b]
    assert names.count("a") in (396, 397, 398) and len(names) == 496  # 0.8 * 496 = 396.8
    _check_prefixes(batches, {"a": Fraction(4, 5), "b": Fraction(1, 5)})
    schedule = fixed_linear(2, 10, 8, 2)
    for step, batch in enumerate(batches):
        assert max(length for _, _, length in batch) <= schedule.difficulty(step)


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.floats(0.05, 5.0), min_size=2, max_size=3),
    g=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_every_prefix_of_global_batches_holds_the_weights_and_every_draw_is_eligible(
    weights, g, seed
):
    names = ["a", "b", "c"][: len(weights)]
    mix, sources = _mixture(
        dict(zip(names, weights, strict=True)), (97, 61, 40)[: len(names)], seed
    )
    cur = _whole(mix, sources, fixed_linear(2, 10, 12, 1))
    order = build_order(
        mix, curriculum=cur, dataset_length=len(mix), global_batch_size=g, seed=seed, shuffle=True
    )
    assert isinstance(order, CurriculumMixtureOrder)
    per = order.epoch_length(0)
    total = sum(Fraction(w) for w in weights)
    shares = {n: Fraction(w) / total for n, w in zip(names, weights, strict=True)}
    batches = []
    for step in range(40):
        epoch, start = divmod(step * g, per)
        idx = order.indices(epoch, start + np.arange(g))
        batches.append([mix[int(i)] for i in idx])
    _check_prefixes(batches, shares)
    lengths = {d.name: d.lengths for d in sources}
    for step, batch in enumerate(batches):
        limit = cur.difficulties(step)["length"]
        assert all(lengths[n][i] <= limit for n, i, _ in batch)


def _loader(per_source: bool = False):
    mix, sources = _mixture({"a": 3, "b": 1}, sizes=(40, 30), seed=4)
    if per_source:
        cur = {
            "a": Curriculum(
                [
                    CurriculumMetric(
                        index=_index("a", sources[0].lengths), schedule=fixed_linear(3, 10, 6, 1)
                    )
                ]
            )
        }
    else:
        cur = _whole(mix, sources, fixed_linear(2, 10, 6, 2))
    return DataLoader(
        mix, batch_size=4, mesh={"dp": 2}, rank=1, seed=3, collate_fn=list, curriculum=cur
    )


@pytest.mark.parametrize("per_source", [False, True])
def test_resume_is_exact_at_every_step_across_difficulty_changes_and_epochs(per_source):
    ref = assert_resume_equivalence(lambda: _loader(per_source), num_items=24)
    assert len(ref) == 24  # 70 samples -> 64 per epoch / global batch 8 = 8 steps: 3 epochs


def test_a_dict_of_curricula_gates_only_the_sources_it_names():
    loader = _loader(per_source=True)
    seen = [s for b in take(loader, 6) for s in b]
    a_lengths = [length for name, _, length in seen if name == "a"]
    b_lengths = {length for name, _, length in seen if name == "b"}
    assert max(a_lengths) <= 3 + 6  # step <= 5 of fixed_linear(3, 10, 6): at most 8
    assert min(a_lengths) >= 1 and len(b_lengths) > 3  # b is not gated
    state = loader.state_dict()["order"]
    assert state["kind"] == "curriculum_mixture_order" and set(state["sources"]) == {"a"}


def test_a_checkpoint_with_other_gates_is_refused():
    state = _loader(per_source=True).state_dict()
    with pytest.raises(ValueError, match="gates sources"):
        _loader(per_source=False).order.validate(state["order"])  # type: ignore[attr-defined]


def test_unsupported_combinations_are_refused_by_name():
    mix, sources = _mixture({"a": 1, "b": 1})
    cur = _whole(mix, sources)
    with pytest.raises(ValueError, match="needs a meshfeed Mixture"):
        DataLoader(sources[0], batch_size=4, curriculum={"a": cur})

    class OwnOrder(list):
        def make_order(self, **kwargs):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="a dataset with its own order"):
        DataLoader(OwnOrder(range(10)), batch_size=2, curriculum=cur)
    hard = Curriculum(
        [
            CurriculumMetric(
                index=_index("b", sources[1].lengths * 0 + 9), schedule=fixed_linear(2, 10, 8)
            )
        ]
    )
    with pytest.raises(ValueError, match="source 'b'.*no sample is eligible at step 0"):
        DataLoader(mix, batch_size=4, curriculum={"b": hard})
    with_transforms = Curriculum(
        [CurriculumMetric(index=_index("a", sources[0].lengths), schedule=fixed_linear(2, 10, 8))],
        transforms=[SeqlenTruncate(schedule=fixed_linear(2, 10, 8))],
    )
    with pytest.raises(ValueError, match="per-source transforms are not supported"):
        DataLoader(mix, batch_size=4, curriculum={"a": with_transforms})
    low_a = _index("length", np.concatenate([sources[0].lengths * 0 + 9, sources[1].lengths]))
    with pytest.raises(ValueError, match="no sample of source 'a' is eligible at step 0"):
        DataLoader(
            mix,
            batch_size=4,
            curriculum=Curriculum([CurriculumMetric(index=low_a, schedule=fixed_linear(2, 10, 8))]),
        )
    with pytest.raises(ValueError, match="not sources of the mixture"):
        DataLoader(mix, batch_size=4, curriculum={"z": cur})


def test_any_curriculum_hooks_object_is_an_extension_point_and_other_objects_are_refused():
    from meshfeed.order.batches import ShuffledOrder

    class Reversed:
        """A curriculum of one's own: CurriculumHooks (make_order, postprocess), nothing else."""

        postprocess = None

        def make_order(self, *, dataset_length, global_batch_size, seed):
            class Backwards(ShuffledOrder):
                def indices(self, epoch, positions):
                    return dataset_length - 1 - positions

            return Backwards(dataset_length, seed=seed, shuffle=False)

    loader = DataLoader(list(range(10)), batch_size=2, curriculum=Reversed())
    assert [b.tolist() for b in loader] == [[9, 8], [7, 6], [5, 4], [3, 2], [1, 0]]
    with pytest.raises(ValueError, match=r"lacks make_order\(\) or postprocess.*CurriculumHooks"):
        DataLoader(list(range(10)), batch_size=2, curriculum=object())


def test_shuffle_false_with_a_mixture_or_a_curriculum_is_refused_by_name():
    mix, sources = _mixture({"a": 1, "b": 1})
    with pytest.raises(ValueError, match=r"shuffle=False with dataset=Mixture .*would be ignored"):
        DataLoader(mix, batch_size=4, shuffle=False)
    with pytest.raises(ValueError, match=r"shuffle=False with curriculum=Curriculum.*ignored"):
        DataLoader(mix, batch_size=4, shuffle=False, curriculum=_whole(mix, sources))
    with pytest.raises(ValueError, match=r"shuffle=False with curriculum=dict.*ignored"):
        DataLoader(mix, batch_size=4, shuffle=False, curriculum={"a": _whole(mix, sources)})
    plain = _whole(mix, sources)
    with pytest.raises(ValueError, match=r"shuffle=False with curriculum=Curriculum.*ignored"):
        DataLoader(sources[0], batch_size=4, shuffle=False, curriculum=plain)
    # shuffle=False stays meaningful (and accepted) for a plain dataset without curriculum
    assert take(DataLoader(list(range(8)), batch_size=4, shuffle=False, collate_fn=list), 2) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def _mixture_loader_on_rank(rank: int, world: int) -> list[list[tuple[str, int, int]]]:
    mix, sources = _mixture({"a": 0.7, "b": 0.3}, sizes=(120, 80), seed=9)
    loader = DataLoader(
        mix, batch_size=6, seed=2, collate_fn=list, curriculum=_whole(mix, sources)
    )  # mesh from the process group: 2 data ranks
    batches = take(loader, 20)
    loader.shutdown()
    return batches


@pytest.mark.slow
def test_two_gloo_ranks_split_each_global_batch_of_a_gated_mixture():
    from tests.dist_utils import run_distributed

    results = run_distributed(_mixture_loader_on_rank, 2)
    mix, sources = _mixture({"a": 0.7, "b": 0.3}, sizes=(120, 80), seed=9)
    single = take(
        DataLoader(mix, batch_size=12, seed=2, collate_fn=list, curriculum=_whole(mix, sources)), 20
    )
    for step in range(20):
        assert [tuple(s) for s in results[0][step] + results[1][step]] == single[step]
    # The single-process simulation of both ranks gives the same slices.
    for rank in range(2):
        sim = DataLoader(
            mix,
            batch_size=6,
            mesh={"dp": 2},
            rank=rank,
            seed=2,
            collate_fn=list,
            curriculum=_whole(mix, sources),
        )
        assert [[tuple(s) for s in b] for b in results[rank]] == take(sim, 20)


# --------------------------------------------------------------- weights changed while gated
def _gated(weights, workers: int = 0):
    sources = [Docs("a", 300, 0), Docs("b", 300, 1)]
    mix = Mixture({d.name: d for d in sources}, weights)
    schedule = fixed_linear(2, 10, 40, 1)
    loader = DataLoader(
        mix, batch_size=16, seed=1, collate_fn=list, curriculum=_whole(mix, sources, schedule),
        num_workers=workers,
    )  # fmt: skip
    return mix, loader, schedule


def _ineligible(batches, schedule, first: int = 0) -> int:
    return sum(
        length > schedule.difficulty(first + step)
        for step, batch in enumerate(batches)
        for _, _, length in batch
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reweight_after_the_loader_is_built_keeps_every_draw_eligible(workers):
    # The gates plan where each source's pool grows from the mixture's counts; a reweight
    # moves those draws, so the gates plan again (they served ineligible samples: 244 of 640).
    mix, loader, schedule = _gated({"a": 1, "b": 1}, workers)
    it = iter(loader)
    head = [next(it) for _ in range(5)]  # workers have batches after these made already
    mix.reweight(8, {"a": 1, "b": 7})
    batches = head + [next(it) for _ in range(31)]  # the epoch: 37 batches
    assert _ineligible(batches, schedule) == 0
    # From the change on, the same batches as a mixture built with the whole schedule.
    _, ahead, _ = _gated({0: {"a": 1, "b": 1}, 8: {"a": 1, "b": 7}}, workers)
    assert take(ahead, 36)[5:] == batches[5:]
    names = [s[0] for b in batches[8:] for s in b]
    assert names.count("b") == 7 * names.count("a")  # the new weights hold


def test_a_resume_that_brings_the_schedule_back_gates_as_the_uninterrupted_run():
    # README: resume with the mixture built as at the start; the checkpoint brings the
    # schedule back, and with it the gates' plan.
    _, whole, schedule = _gated({0: {"a": 1, "b": 1}, 20: {"a": 1, "b": 7}})
    full = take(whole, 36)
    _, first, _ = _gated({0: {"a": 1, "b": 1}, 20: {"a": 1, "b": 7}})
    assert take(first, 25) == full[:25]
    state = first.state_dict()
    _, resumed, _ = _gated({"a": 1, "b": 1})
    resumed.load_state_dict(state)
    assert take(resumed, 11) == full[25:]
    assert _ineligible(full, schedule) == 0


def test_a_reweight_mid_run_resumes_exactly_at_every_step():
    def make():
        mix, loader, _ = _gated({"a": 1, "b": 1})
        mix.reweight(6, {"a": 3, "b": 1})
        return loader

    assert len(assert_resume_equivalence(make, num_items=14)) == 14
