"""Two threads of one rank, each making meshfeed collectives: ``Delivered(BalancedBatches)``
runs ahead on its delivery thread while the loop's thread iterates another loader (an eval
loader between training steps). On one group, the two threads' collectives would pair with
their peer's in whatever order each rank's threads reach them: mismatched sizes, a hang, or
one loader's agreement read as the other's. A delivery thread's collectives run on groups of
their own (:func:`meshfeed.dist.control_group`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from meshfeed import DataLoader
from meshfeed.balance import BalancedBatches, CostModel
from meshfeed.balance.routing import route_local
from meshfeed.delivered import Delivered
from meshfeed.delivery import to_device
from meshfeed.testing import assert_same
from tests.balance.checks import Samples, make_sample
from tests.dist_utils import run_distributed

STEPS = 6
S2 = CostModel(quadratic=1.0)


def _train_and_eval(rank: int, world: int) -> dict[str, list]:
    inner = BalancedBatches(
        Samples(rank, seed=9, batches=STEPS, max_len=450, docs=8),
        max_tokens=256, cost=S2, timeout=30,
    )  # fmt: skip
    train, evals = [], []
    with Delivered(inner, device="cpu", device_prefetch=2, timeout=30) as it:
        for n, step in enumerate(it):
            train.append(to_device(step, torch.device("cpu")))
            if n % 2 == 0:  # the delivery thread is making the next steps meanwhile
                ev = DataLoader(np.arange(40), batch_size=4, seed=n, timeout=30)
                evals.append([b.tolist() for b in ev])
    inner.close()
    return {"train": train, "evals": evals}


def test_a_delivered_iterator_and_a_loop_loader_on_two_gloo_ranks_keep_their_collectives_apart():
    started = time.monotonic()
    results = run_distributed(_train_and_eval, 2, timeout=120)
    assert time.monotonic() - started < 60  # no collective waited out its timeout
    for n, (a, b) in enumerate(zip(results[0]["evals"], results[1]["evals"], strict=True)):
        seen = sorted(v for batch in a + b for v in batch)
        assert seen == list(range(40)), f"eval {n}: each sample once over both ranks"
    want: list[list] = [[], []]
    for b in range(STEPS):
        samples = [make_sample(r, b, seed=9, max_len=450, docs=8) for r in range(2)]
        _, outputs = route_local(samples, max_tokens=256, cost=S2, cp_sizes="any")
        for r in range(2):
            want[r] += outputs[r]
    for r in range(2):
        assert_same(results[r]["train"], want[r], f"rank {r}")
