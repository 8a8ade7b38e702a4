"""Independent checks of a Plan, shared by the balance tests."""

from __future__ import annotations

import numpy as np

from meshfeed.balance import CostModel, Plan


def check_plan(p: Plan, lengths: np.ndarray, cost: CostModel, *, aligned: bool = False) -> None:
    """Assert every contract of a plan, recomputing what can be recomputed from microsteps."""
    n, k_total = len(lengths), p.num_microsteps
    assert len(p.microsteps) == p.num_ranks
    assert all(len(steps) == k_total for steps in p.microsteps), "unequal micro-step counts"
    seen: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
    tokens = np.zeros((p.num_ranks, k_total), dtype=np.int64)
    for r, steps in enumerate(p.microsteps):
        for k, step in enumerate(steps):
            groups = {g for _, g in step}
            if any(len(g) > 1 for g in groups):
                assert len(step) == 1, f"a split document shares micro-step {k} on rank {r}"
            for doc, group in step:
                assert r in group
                seen.setdefault(doc, []).append((r, k, group))
                tokens[r, k] += p.padded[doc] // len(group)
    assert sorted(seen) == list(range(n)), "a document is missing or unknown"
    for doc, places in seen.items():
        group = places[0][2]
        c = len(group)
        assert group == tuple(range(group[0], group[0] + c)), "groups are consecutive ranks"
        assert sorted(r for r, _, _ in places) == list(group), f"document {doc} placed wrongly"
        assert len({k for _, k, _ in places}) == 1, "a group runs a document at one micro-step"
        assert p.cp_size[doc] == c and p.cp_start[doc] == group[0]
        assert p.padded[doc] >= lengths[doc]
        unit = 2 * c * p.tp if c > 1 else p.tp
        assert p.padded[doc] % unit == 0
        if aligned:
            assert c & (c - 1) == 0 and group[0] % c == 0
    assert tokens.max(initial=0) <= p.max_tokens, "budget exceeded"
    np.testing.assert_array_equal(tokens, p.tokens())
    assert np.isclose(simulate(p, lengths, cost), p.makespan, rtol=1e-9, atol=1e-9)
    assert p.makespan >= p.lower_bound * (1 - 1e-9)


def simulate(p: Plan, lengths: np.ndarray, cost: CostModel) -> float:
    """Step time of running the plan: micro-steps in order, CP groups wait for each other."""
    t = np.zeros(p.num_ranks)
    work = cost.work(lengths)
    for k in range(p.num_microsteps):
        done: set[int] = set()
        for r in range(p.num_ranks):
            step = p.microsteps[r][k]
            if step and len(step[0][1]) > 1:
                doc, group = step[0]
                if doc in done:
                    continue
                done.add(doc)
                start = max(t[g] for g in group)
                for g in group:
                    t[g] = start + work[doc] / len(group) + cost.per_step
            else:
                t[r] += sum(work[d] for d, _ in step) + cost.per_step
    return float(t.max(initial=0.0))
