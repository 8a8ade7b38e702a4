"""Independent checks of a Placement, shared by the balance tests."""

from __future__ import annotations

import itertools

import numpy as np

from meshfeed.balance import CostModel, Placement


def check_placement(
    p: Placement, lengths: np.ndarray, cost: CostModel, *, aligned: bool = False
) -> None:
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
                assert len(groups) == 1, f"micro-step {k} on rank {r} mixes CP groups"
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


def simulate(p: Placement, lengths: np.ndarray, cost: CostModel) -> float:
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
                run = sum(work[d] for d, _ in step) / len(group)
                for g in group:
                    t[g] = start + run + cost.per_step
            else:
                t[r] += sum(work[d] for d, _ in step) + cost.per_step
    return float(t.max(initial=0.0))


class Samples:
    """A stateful per-rank iterator of packed samples with globally unique token values."""

    def __init__(self, rank: int, *, seed: int, batches: int, max_len: int, docs: int = 6):
        self.rank, self.seed, self.batches, self.max_len, self.docs = (
            rank,
            seed,
            batches,
            max_len,
            docs,
        )
        self.i = 0

    def __iter__(self) -> Samples:
        return self

    def __next__(self) -> dict:
        if self.i >= self.batches:
            raise StopIteration
        out = make_sample(self.rank, self.i, seed=self.seed, max_len=self.max_len, docs=self.docs)
        self.i += 1
        return out

    def state_dict(self) -> dict:
        return {"kind": "test.samples", "version": 1, "i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


def make_sample(rank: int, batch: int, *, seed: int, max_len: int, docs: int = 6) -> dict:
    import torch

    rng = np.random.default_rng([seed, rank, batch])
    n = int(rng.integers(0, docs + 1))
    # Heavy tail: mostly short documents, sometimes one up to max_len.
    lengths = np.where(rng.random(n) < 0.2, rng.integers(1, max_len + 1, n), rng.integers(1, 60, n))
    tokens, positions = [], []
    for d, s in enumerate(lengths.tolist()):
        tokens.append(((batch * 64 + rank) * 64 + d) * 100_000 + np.arange(s))
        positions.append(np.arange(s))
    tok = torch.from_numpy(np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64))
    return {
        "tokens": tok,
        "labels": tok + 1,
        "loss_mask": (tok % 3 != 0).to(torch.float32),
        "position_ids": torch.from_numpy(
            np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
        ),
        "cu_seqlens": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32),
    }


def check_routing(samples: list[dict], p: Placement, outputs: list[list[dict]]) -> None:
    """Rerouted micro-steps hold exactly the original documents, zigzag-split and padded."""
    from meshfeed.balance.zigzag import zigzag_positions

    docs = []  # (rank, start, length) of every document, in global order
    for r, s in enumerate(samples):
        cu = s["cu_seqlens"].tolist()
        docs += [(r, a, b - a) for a, b in itertools.pairwise(cu)]
    assert len(docs) == len(p.lengths)
    pieces: dict[int, dict[int, dict]] = {}
    for steps in outputs:
        assert len(steps) == p.num_microsteps
        for k, step in enumerate(steps):
            assert step["microstep"] == k and step["num_microsteps"] == p.num_microsteps
            cu = step["cu_seqlens"].tolist()
            assert cu[0] == 0 and cu[-1] == step["tokens"].numel() <= p.max_tokens
            for j, d in enumerate(step["doc_ids"].tolist()):
                a, b = cu[j], cu[j + 1]
                c = int(p.cp_size[d])
                assert b - a == p.padded[d] // c
                part = step["cp_rank"] if c > 1 else 0
                pieces.setdefault(d, {})[part] = {
                    k2: step[k2][a:b] for k2 in ("tokens", "labels", "loss_mask", "position_ids")
                }
    real_tokens = []
    for d, (r, a, s) in enumerate(docs):
        c, padded = int(p.cp_size[d]), int(p.padded[d])
        assert sorted(pieces[d]) == list(range(c)), f"document {d} lost a piece"
        full = {k: np.zeros(padded, dtype=np.float64) for k in pieces[d][0]}
        for part, kv in pieces[d].items():
            pos = zigzag_positions(padded, c, part)
            for k, v in kv.items():
                full[k][pos] = v.numpy()
        src = samples[r]
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            np.testing.assert_array_equal(full[k][:s], src[k][a : a + s].numpy())
        np.testing.assert_array_equal(full["position_ids"], np.arange(padded))
        assert (full["loss_mask"][s:] == 0).all() and (full["labels"][s:] == -100).all()
        real_tokens.append(full["tokens"][:s])
    got = np.sort(np.concatenate(real_tokens)) if real_tokens else np.zeros(0)
    want = np.sort(np.concatenate([s["tokens"].numpy() for s in samples]))
    np.testing.assert_array_equal(got, want)
