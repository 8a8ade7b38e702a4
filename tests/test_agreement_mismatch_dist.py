"""Ranks that differ where they must agree, on real gloo ranks: every rank is told by name.

One spawn of two ranks runs every case in turn (each case on a timeout of its own, so a case
that leaves a collective behind leaves it on a group no later case uses):

- ranks whose agreement checks different facts (a batch-size ramp on one rank only) raise
  ``ValueError`` on every rank, naming the facts, where the backend used to abort a process
  on the mismatched collective sizes;
- ``on_error="raise"`` on one rank only (its per-step check is a collective) is refused at the
  walk start, not a wait of the full timeout on that rank;
- the fix of a disagreement names the argument that differs (``shuffle=``, ``drop_last=``);
- a ``Mixture`` reweighted mid-epoch on every rank is agreed once more at its re-plan (one
  collective per re-plan); reweighted on one rank only, that rank raises within its timeout,
  naming the likely cause;
- a rank that comes after its peer gave up (the peer's timeout passed) is told the peer gave
  up, not that it timed out itself after 0.0 s.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.dist_utils import run_distributed

#: What gloo says to a rank that connects to a peer which gave up on the rendezvous.
_REFUSED = (
    "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:152] "
    "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:3996$1"
)
STEPS, REWEIGHT_AT, CHANGE_AT = 10, 3, 6


def _refusal(build: Any) -> str:
    """The error of a first batch (a ``ValueError``'s message; ``"no error"``)."""
    try:
        next(iter(build()))
    except ValueError as exc:
        return str(exc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _mixture() -> Any:
    import meshfeed

    code, web = np.arange(1_000, 2_000), np.arange(5_000, 9_000)
    return meshfeed.Mixture({"code": code, "web": web}, {"code": 1, "web": 3}, seed=0)


def _reweighted(loader: Any, mix: Any, reweight: bool) -> list[int]:
    """``STEPS`` batches' samples, with ``mix.reweight`` between batches ``REWEIGHT_AT - 1`` and
    ``REWEIGHT_AT`` when ``reweight`` (the weights change from step ``CHANGE_AT`` on)."""
    it, seen = iter(loader), []
    for step in range(STEPS):
        if reweight and step == REWEIGHT_AT:
            mix.reweight(CHANGE_AT, {"code": 1, "web": 1})
        seen.extend(next(it).tolist())
    return seen


def _wait_for(path: Path, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _cases(rank: int, world: int, signals: str) -> dict[str, Any]:
    from meshfeed import DataLoader, dist
    from meshfeed.errors import CollectiveError
    from meshfeed.services import distributed

    out: dict[str, Any] = {}
    data = list(range(64))

    # Facts of different counts: a ramp on rank 0 only (six rampup_* facts more).
    ramp = {"rampup": (8, 8, 32)} if rank == 0 else {}
    out["rampup"] = _refusal(
        lambda: DataLoader(data, batch_size=8, shuffle=False, seed=0, timeout=5, **ramp)
    )
    try:  # any caller of the agreement: an extra fact on one rank
        dist.check_agreement({"seed": 1, **({"extra": 2} if rank == 0 else {})}, timeout=5)
        out["extra"] = "no error"
    except ValueError as exc:
        out["extra"] = str(exc)
    wide = {f"fact{i:02}": i for i in range(40)}  # more than the first all-gather holds
    dist.check_agreement(wide, timeout=5)
    try:
        dist.check_agreement({**wide, "fact39": rank}, timeout=5)
        out["wide"] = "no error"
    except ValueError as exc:
        out["wide"] = str(exc)

    # on_error="raise" on rank 0 only.
    raises = {"on_error": "raise"} if rank == 0 else {}
    out["on_error"] = _refusal(lambda: DataLoader(data, batch_size=4, seed=0, timeout=3, **raises))

    # The fix names the argument.
    for name in ("shuffle", "drop_last"):
        flag = {name: rank == 0}
        out[name] = _refusal(lambda flag=flag: DataLoader(data, batch_size=4, timeout=5, **flag))

    # A reweight on every rank, between the same batches: agreed again at the re-plan.
    gathers: list[dict[str, int]] = []
    gather = distributed.gather_agreement

    def counted(values: Any, *args: Any, **kwargs: Any) -> Any:
        gathers.append(dict(values))
        return gather(values, *args, **kwargs)

    distributed.gather_agreement = counted
    try:
        mix = _mixture()
        out["both_ids"] = _reweighted(DataLoader(mix, batch_size=16, seed=1, timeout=5), mix, True)
    finally:
        distributed.gather_agreement = gather
    out["both_replanned"] = [g["replanned"] for g in gathers]

    # A reweight on rank 0 only: it re-plans alone.
    mix = _mixture()
    loader = DataLoader(mix, batch_size=16, seed=1, timeout=2)
    start = time.monotonic()
    try:
        _reweighted(loader, mix, rank == 0)
        out["alone"] = "no error"
    except CollectiveError as exc:
        out["alone"] = str(exc)
    out["alone_s"] = time.monotonic() - start
    if rank == 0:
        (Path(signals) / "alone").touch()

    # Rank 1 comes after rank 0 gave up (rank 0's timeout passed).
    if rank == 1:
        _wait_for(Path(signals) / "alone")
        _wait_for(Path(signals) / "gave_up")
    start = time.monotonic()
    try:
        dist.barrier(timeout=0.5)
        out["late"] = None
    except CollectiveError as exc:
        out["late"] = (exc.reason, exc.elapsed, str(exc))
    if rank == 0:
        gc.collect()  # the abandoned rendezvous closes its connections
        (Path(signals) / "gave_up").touch()
    refused = dist._failure(RuntimeError(_REFUSED), 0.0, 5.0, "a barrier")
    out["refused"] = (refused.reason, str(refused))
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    signals = tmp_path_factory.mktemp("signals")
    return run_distributed(_cases, 2, str(signals), timeout=120.0)


@pytest.mark.slow
def test_ranks_with_facts_of_different_counts_are_refused_by_name_on_every_rank(cases):
    # The all-gather of the facts had as many ints as facts: rank 1 aborted (gloo: "Received
    # data size doesn't match expected size"), rank 0 raised "all input arrays must have the
    # same shape".
    for out in cases:
        assert out["rampup"].startswith("data loaders were built with different arguments")
        assert (
            "rank 0 has facts ['rampup_increment', 'rampup_micro_batch_size', "
            "'rampup_round_down', 'rampup_samples', 'rampup_start', 'rampup_uneven'], "
            "rank 1 has none of them" in out["rampup"]
        )
        assert out["rampup"].endswith("every rank must build its DataLoader with the same rampup=")
        assert "rank 0 has facts ['extra'], rank 1 has none of them" in out["extra"]
        assert out["wide"].startswith("data loaders disagree on fact39: rank i holds [0, 1]")


@pytest.mark.slow
def test_on_error_raise_on_some_ranks_is_refused_at_the_walk_start(cases):
    # Only the "raise" rank made the per-step check: it waited the whole timeout and reported
    # a stalled rank, while the other one trained on.
    for out in cases:
        assert out["on_error"].startswith("data loaders disagree on on_error: rank i holds [1, 0]")
        assert "same on_error= ('raise'" in out["on_error"]


@pytest.mark.slow
def test_the_fix_of_a_disagreement_names_the_argument_that_differs(cases):
    for out in cases:
        for name in ("shuffle", "drop_last"):
            assert out[name] == (
                f"data loaders disagree on {name}: rank i holds [1, 0]; every rank must build "
                f"its DataLoader with the same {name}="
            )


@pytest.mark.slow
def test_a_mixture_reweighted_on_every_rank_is_agreed_once_more_at_its_replan(cases):
    from meshfeed import DataLoader

    for rank, out in enumerate(cases):
        assert out["both_replanned"] == [0, 1]  # the walk start, then the re-plan: no more
        mix = _mixture()  # the same run in one process, as data rank `rank` of 2
        sim = DataLoader(mix, batch_size=16, mesh={"dp": 2}, rank=rank, seed=1)
        assert out["both_ids"] == _reweighted(sim, mix, True)
    both = cases[0]["both_ids"] + cases[1]["both_ids"]
    assert len(set(both)) == len(both)


@pytest.mark.slow
def test_a_mixture_reweighted_on_one_rank_only_raises_there_within_its_timeout(cases):
    # The re-planned walk started again without agreeing: the ranks trained on different
    # mixtures, some samples twice, silently.
    alone = cases[0]["alone"]
    assert "waited more than timeout=2.0s" in alone
    assert "This rank re-planned its order at position 192 of epoch 0" in alone
    assert "call mix.reweight(step, weights) with the same arguments on every rank" in alone
    assert cases[0]["alone_s"] < 2.0 + 3.0
    assert cases[1]["alone"] == "no error"  # it never re-planned: it cannot know


@pytest.mark.slow
def test_a_rank_that_comes_after_its_peer_gave_up_is_told_so(cases):
    early, late = cases[0]["late"], cases[1]["late"]
    assert early[0] == "timeout" and "waited more than timeout=0.5s" in early[2]
    reason, elapsed, message = late
    # Which side of gloo's pair connects is the ports' draw: the late rank is refused at once
    # (the peer gave up), or it listens and waits for a peer that never connects.
    if "Connection refused" in message:
        assert reason == "closed" and "gave up waiting for this rank" in message
    else:
        assert reason == "timeout" and elapsed >= 0.5
    for out in cases:  # gloo's words for a peer that gave up: never "waited ... 0.0s"
        reason, message = out["refused"]
        assert reason == "closed"
        assert "a peer rank refused the connection after 0.0s in a barrier" in message
        assert "it gave up waiting for this rank" in message
