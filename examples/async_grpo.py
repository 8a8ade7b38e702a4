"""Asynchronous GRPO on the sample store: Ray rollout actors, a trainer on 2 gloo ranks.

Two Ray actors generate rollouts with a tiny policy: each reads the trainer's latest weights
(a version and a tensor, from a small Ray actor standing in for weight sync), answers a prompt
with ``GROUP`` samples, scores them (the reward step) and puts the group into a named Ray
``SampleStore`` with the weights' ``version``. The trainer runs on 2 gloo ranks: each reads its
part of every round through a ``StoreLoader`` with ``max_staleness``, drops groups whose rewards
are all equal (``group_filter``: DAPO's dynamic sampling), takes a GRPO step (gradients
averaged with ``all_reduce``), and publishes the next version. Generating a round takes about as
long as a training step (``--gen`` / ``--train`` seconds), so with ``max_staleness=1`` generation
of the next round overlaps training, while ``max_staleness=0`` is the synchronous loop
(generate with the current weights, then train). The job runs once each way and prints samples
trained per second and the staleness histogram (trainer version minus sample version).

Run:  PYTHONPATH=src python examples/async_grpo.py [--steps 8] [--gen 0.2] [--train 0.2]
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections import Counter
from typing import Any

import ray
import torch

from meshfeed import DataMesh
from meshfeed.launch import run_distributed
from meshfeed.queue import GroupSampler, SampleStore, StaleVersion, StoreLoader, Varies

GROUP, VOCAB, PROMPTS_PER_RANK, RANKS = 4, 8, 2, 2


class Weights:
    """The trainer's latest weights and version (weight sync, kept minimal); producers wait
    for ``start`` so that the two jobs of this example do not overlap."""

    def __init__(self) -> None:
        self.version, self.logits = 0, torch.zeros(VOCAB)
        self.started = self.done = False

    def start(self) -> None:
        self.started = True

    def publish(self, version: int, logits: torch.Tensor) -> None:
        self.version, self.logits = version, logits

    def latest(self) -> tuple[int, torch.Tensor, bool, bool]:
        return self.version, self.logits, self.started, self.done

    def stop(self) -> None:
        self.done = True


class Producer:
    """A rollout worker: sample ``GROUP`` answers per prompt, score them, put the group."""

    def run(self, store: SampleStore, weights: Any, me: int, gen_seconds: float) -> int:
        rng = torch.Generator().manual_seed(me)
        prompt, put = me, 0
        while True:
            version, logits, started, done = ray.get(weights.latest.remote())
            if done:
                return put
            if not started:
                time.sleep(0.05)
                continue
            time.sleep(gen_seconds)  # the time generation takes on a real model
            answers = torch.multinomial(logits.softmax(0), GROUP, replacement=True, generator=rng)
            reward = (answers >= VOCAB // 2).float()  # the reward step (a verifier stand-in)
            ids = [f"{prompt}/{a}" for a in range(GROUP)]
            try:
                store.put("rollouts", {"answer": answers, "reward": reward, "prompt": [prompt] * GROUP},
                          ids=ids, groups=prompt, version=version, timeout=60)  # fmt: skip
                put += GROUP
            except StaleVersion:  # too old for the trainer: load newer weights and retry
                continue
            except ValueError:  # the partition was closed: the job is over
                return put
            prompt += 2  # the two producers take even and odd prompts


def train_job(rank: int, world: int, job: dict[str, Any], steps: int, train: float) -> dict:
    """One job on this rank: GRPO steps on its part of each round, in lockstep."""
    import torch.distributed as dist

    store = SampleStore.connect(job["store"])
    weights = ray.get_actor(job["weights"], namespace="meshfeed.queue")
    logits = torch.zeros(VOCAB, requires_grad=True)
    optim = torch.optim.SGD([logits], lr=0.5)
    loader = StoreLoader(
        store, task="train", fields=["answer", "reward"], partition="rollouts",
        batch_size=PROMPTS_PER_RANK * GROUP, mesh=DataMesh.from_env(),
        sampler=GroupSampler(group_size=GROUP), max_staleness=job["max_staleness"],
        group_filter=Varies(field="reward"),  # DAPO: drop groups with equal rewards
        prefetch=1, timeout=120,
    )  # fmt: skip
    lags: Counter[int] = Counter()
    dist.barrier()
    if rank == 0:
        ray.get(weights.start.remote())
    with loader:
        for step in range(steps):
            batch = next(loader)
            if step == 0:
                start = time.perf_counter()
            lags.update(step - v for v in batch.versions)
            t0 = time.perf_counter()
            reward = batch["reward"].view(-1, GROUP)
            advantage = (reward - reward.mean(1, keepdim=True)).flatten()
            loss = -(advantage * logits.log_softmax(0)[batch["answer"]]).mean()
            optim.zero_grad()
            loss.backward()
            dist.all_reduce(logits.grad)
            logits.grad /= world
            optim.step()
            time.sleep(max(0.0, train - (time.perf_counter() - t0)))
            loader.set_version(step + 1)
            if rank == 0:
                ray.get(weights.publish.remote(step + 1, logits.detach().clone()))
        elapsed = time.perf_counter() - start
        filtered = loader.stats()["versions"]["filtered"]
    dist.barrier()
    if rank == 0:  # the job is over: producers stop, a put they wait in fails
        ray.get(weights.stop.remote())
        store.close("rollouts")
    return {"elapsed": elapsed, "lags": dict(lags), "filtered": filtered}


def train_rank(rank: int, world: int, address: str, jobs: list, steps: int, train: float) -> list:
    """One trainer rank (a gloo process): the jobs one after the other."""
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        return [train_job(rank, world, job, steps, train) for job in jobs]
    finally:
        ray.shutdown()


def run_jobs(staleness: list[int], steps: int, gen: float, train: float) -> dict[int, dict]:
    """The same job with each ``max_staleness``; ``samples_per_s`` counts samples trained
    (every rank's) from the first batch to the last."""
    jobs, stores, actors, running = [], [], [], []
    per_group = gen * 2 / (RANKS * PROMPTS_PER_RANK)  # a round from 2 producers in ``gen``
    for s in staleness:
        tag = uuid.uuid4().hex[:8]
        stores.append(SampleStore("ray", name=f"grpo-{tag}", tasks=["train"]))
        remote = ray.remote(num_cpus=0)(Weights).options(
            name=f"w-{tag}", namespace="meshfeed.queue"
        )
        weights = remote.remote()
        producers = [ray.remote(num_cpus=0)(Producer).remote() for _ in range(2)]
        running += [
            p.run.remote(stores[-1], weights, i, per_group) for i, p in enumerate(producers)
        ]
        actors += [weights, *producers]
        jobs.append({"store": f"grpo-{tag}", "weights": f"w-{tag}", "max_staleness": s})
    try:
        address = ray.get_runtime_context().gcs_address
        results = run_distributed(train_rank, RANKS, address, jobs, steps, train, timeout=300)
        ray.get(running, timeout=60)
        stats = [store.stats() for store in stores]
    finally:
        for store in stores:
            store.shutdown()
        for actor in actors:
            ray.kill(actor)
    out = {}
    for j, s in enumerate(staleness):
        lags: Counter[int] = Counter()
        for rank_results in results:
            lags.update({int(k): v for k, v in rank_results[j]["lags"].items()})
        elapsed = max(rank_results[j]["elapsed"] for rank_results in results)
        out[s] = {
            "samples_per_s": sum(lags.values()) / elapsed,
            "lags": dict(sorted(lags.items())),
            "filtered": stats[j]["filtered"].get("train", 0),
            "stale": stats[j]["stale"].get("train", 0),
        }
    return out


def main(argv: list[str] | None = None) -> dict[int, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per job")
    parser.add_argument("--gen", type=float, default=0.2, help="seconds to generate a round")
    parser.add_argument("--train", type=float, default=0.2, help="seconds per training step")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (got {args.steps})")
    if args.gen < 0 or args.train < 0:
        parser.error(f"--gen and --train are seconds >= 0 (got {args.gen}, {args.train})")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        jobs = run_jobs([1, 0], args.steps, args.gen, args.train)
    finally:
        if started:
            ray.shutdown()
    for s, job in jobs.items():
        print(f"max_staleness={s}: {job['samples_per_s']:.1f} samples/s trained; staleness "
              f"histogram {job['lags']}; {job['filtered']} groups filtered, {job['stale']} "
              "stale samples dropped")  # fmt: skip
    speedup = jobs[1]["samples_per_s"] / jobs[0]["samples_per_s"]
    print(f"asynchronous (max_staleness=1) / synchronous (max_staleness=0): {speedup:.2f}x")
    return jobs


if __name__ == "__main__":
    main()
