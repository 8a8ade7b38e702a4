"""``meshfeed demo``: the whole story on one machine, with real gloo ranks.

1. Write a synthetic tokenised corpus in the Megatron format and view it as GPT windows.
2. Run ``world`` ranks on a dp x tp mesh for one epoch and part of the next (the reference),
   with a checkpoint mid-way through epoch 1.
3. Resume from that checkpoint on the same mesh, and on a mesh with a different data-parallel
   size (same global batch).
4. Verify: every window seen exactly once per epoch across data ranks, replica peers got
   identical batches, every rank took the same number of steps, and resumed batches equal the
   uninterrupted run. Print a summary table; exit non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshfeed.launch import run_distributed
from meshfeed.loader import DataLoader
from meshfeed.mesh import DataMesh, data_sizes_dividing
from meshfeed.progress import Progress
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenWindows
from meshfeed.storage import is_url

log = logging.getLogger("meshfeed")


class IndexedWindows:
    """GPT windows that also report which window each row is (to check coverage)."""

    def __init__(self, prefix: str, seq_len: int) -> None:
        self.windows = TokenWindows(prefix, seq_len=seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def fingerprint(self) -> str:
        return self.windows.fingerprint

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": torch.tensor(i), "tokens": self.windows[i]}

    def fetch_batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return {
            "index": torch.from_numpy(indices.copy()),
            "tokens": self.windows.fetch_batch(indices),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    prefix: str
    seq_len: int
    global_batch: int
    num_workers: int
    seed: int
    checkpoint_step: int
    checkpoint_path: str
    quiet: bool = False


def _record(batch: dict[str, torch.Tensor]) -> tuple[list[int], int]:
    tokens = batch["tokens"]
    return batch["index"].tolist(), int(tokens.sum()) ^ int(tokens[:, ::7].sum()) << 1


def _rank_main(
    rank: int, world: int, sizes: dict[str, Any], cfg: DemoConfig, phase: str, label: str
) -> dict[str, Any]:
    if rank == 0 and not cfg.quiet:
        from meshfeed.cli import configure_logging

        configure_logging()
        log.info("%s: %d ranks joined the gloo group", label, world)
    mesh = DataMesh.from_sizes(world_size=world, **sizes)
    dataset = IndexedWindows(cfg.prefix, cfg.seq_len)
    loader = DataLoader(
        dataset,
        batch_size=cfg.global_batch // mesh.data_world_size,
        mesh=mesh,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        warn_wait_share=None,  # this loop only records ids: it waits for data by design
    )
    records: dict[int, list[tuple[list[int], int]]] = {0: [], 1: []}
    start = time.perf_counter()
    with loader:
        if phase == "resume":
            with open(cfg.checkpoint_path) as f:
                loader.load_state_dict(json.load(f))
        for epoch in range(loader.epoch, 2):
            loader.set_epoch(epoch)
            done = loader.position // loader.global_batch_size
            # Count only the batches this run delivers; say where a resumed epoch starts.
            start_at = f", from step {done}" if done else ""
            bar = Progress(
                len(loader) - done,
                desc=f"{label} epoch {epoch} (rank 0 of {world}{start_at})",
                unit="batch",
                enabled=rank == 0 and not cfg.quiet,
                log_interval=1.0,
            )
            for batch in loader:
                records[epoch].append(_record(batch))
                bar.update()
                if phase == "reference" and epoch == 1 and len(records[1]) == cfg.checkpoint_step:
                    state = loader.state_dict()
                    if rank == 0:
                        with open(cfg.checkpoint_path + ".tmp", "w") as f:
                            json.dump(state, f)
                        os.replace(cfg.checkpoint_path + ".tmp", cfg.checkpoint_path)
            bar.close()
    return {
        "rank": rank,
        "data_rank": mesh.data_rank(rank),
        "records": records,
        "seconds": time.perf_counter() - start,
        "samples": sum(len(r[0]) for e in records.values() for r in e),
    }


def _global_batches(results: list[dict[str, Any]], mesh: DataMesh, epoch: int) -> list[list[int]]:
    """Concatenate the data ranks' slices per step (first member of each replica group)."""
    leaders = [results[g[0]] for g in mesh.replica_groups()]
    steps = len(leaders[0]["records"][epoch])
    return [[i for r in leaders for i in r["records"][epoch][s][0]] for s in range(steps)]


def _checks(
    results: list[dict[str, Any]], mesh: DataMesh, n: int, cfg: DemoConfig
) -> list[tuple[str, bool, str]]:
    rows = []
    expected = (n // cfg.global_batch) * cfg.global_batch
    for epoch in (0, 1):
        seen = [i for b in _global_batches(results, mesh, epoch) for i in b]
        unique = len(set(seen))
        ok = len(seen) == expected and unique == expected
        detail = f"{unique}/{expected} unique, {len(seen) - unique} repeats"
        rows.append((f"epoch {epoch}: every window once across data ranks", ok, detail))
    groups = mesh.replica_groups()
    same = all(results[r]["records"] == results[g[0]]["records"] for g in groups for r in g)
    detail = f"{len(groups)} groups of {len(groups[0])}"
    rows.append(("replica peers (tp) got identical batches", same, detail))
    steps = {len(r["records"][0]) for r in results}
    detail = f"steps/epoch {sorted(steps)}"
    rows.append(("every rank took the same number of steps", len(steps) == 1, detail))
    return rows


def _compare_resume(
    ref: list[dict[str, Any]],
    ref_mesh: DataMesh,
    res: list[dict[str, Any]],
    res_mesh: DataMesh,
    cfg: DemoConfig,
) -> tuple[bool, str]:
    want = _global_batches(ref, ref_mesh, 1)[cfg.checkpoint_step :]
    got = _global_batches(res, res_mesh, 1)
    ok = want == got and len(got) > 0
    return ok, f"{len(got)} resumed global batches vs {len(want)} uninterrupted"


def _check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with the demo's arguments, as a message naming the fix, or None."""
    for name, value, least in (
        ("--dp", args.dp, 1),
        ("--tp", args.tp, 1),
        ("--batch-size", args.batch_size, 1),
        ("--seq-len", args.seq_len, 1),
        ("--documents", args.documents, 1),
        ("--num-workers", args.num_workers, 0),
    ):
        if value < least:
            return f"{name} must be at least {least} (got {value})"
    if args.resume_dp is not None and args.resume_dp < 1:
        return f"--resume-dp must be at least 1 (got {args.resume_dp})"
    if args.workdir is not None:
        if is_url(args.workdir):
            return f"--workdir {args.workdir} is a URL; pick a local folder (the demo writes there)"
        try:
            os.makedirs(args.workdir, exist_ok=True)
        except OSError as e:
            return (
                f"cannot use --workdir {args.workdir} ({e.strerror or e}); pick a writable folder"
            )
    global_batch = args.batch_size * args.dp
    new_dp = args.resume_dp or 2 * args.dp
    if global_batch % new_dp:
        divisors = ", ".join(map(str, data_sizes_dividing(global_batch)))
        return (
            f"--resume-dp {new_dp} must divide the global batch {global_batch} "
            f"(--batch-size {args.batch_size} x --dp {args.dp}) so the elastic resume keeps it; "
            f"use a divisor such as {divisors}"
        )
    return None


def _phase(
    label: str, world: int, sizes: dict[str, Any], cfg: DemoConfig, kind: str
) -> list[dict[str, Any]]:
    log.info(
        "%s: starting %d gloo ranks on %s (process start-up takes a few seconds)",
        label,
        world,
        sizes,
    )
    t0 = time.perf_counter()
    results = run_distributed(_rank_main, world, sizes, cfg, kind, label)
    log.info("%s: done in %.1fs", label, time.perf_counter() - t0)
    return results


def run(args: argparse.Namespace) -> int:
    problem = _check_arguments(args)
    if problem is not None:
        log.error("meshfeed demo: error: %s", problem)
        return 2
    dp, tp = args.dp, args.tp
    world = dp * tp
    with tempfile.TemporaryDirectory(prefix="meshfeed-demo-") as tmp:
        workdir = args.workdir or tmp
        prefix = os.path.join(workdir, "corpus")
        rng = np.random.default_rng(args.seed)
        lengths = rng.integers(16, 4 * args.seq_len, size=args.documents)
        log.info(
            "writing a synthetic corpus: %d documents, %s tokens",
            args.documents,
            f"{int(lengths.sum()):,}",
        )
        write_indexed(
            prefix,
            (rng.integers(1, 50_000, size=int(s)) for s in lengths),
            np.uint16,
            progress=not args.quiet,
        )
        n = len(IndexedWindows(prefix, args.seq_len))
        global_batch = args.batch_size * dp
        if n // global_batch < 2:
            log.error(
                "meshfeed demo: error: the corpus gives %d windows, %d global batch(es) of %d per "
                "epoch; the demo checkpoints inside an epoch and needs at least 2: use more "
                "--documents or a smaller --batch-size / --seq-len",
                n,
                n // global_batch,
                global_batch,
            )
            return 2
        cfg = DemoConfig(
            prefix=prefix,
            seq_len=args.seq_len,
            global_batch=global_batch,
            num_workers=args.num_workers,
            seed=args.seed,
            checkpoint_step=max(1, (n // global_batch) // 3),
            checkpoint_path=os.path.join(workdir, "loader_state.json"),
            quiet=args.quiet,
        )
        mesh = DataMesh.from_sizes(dp=dp, tp=tp)
        log.info(
            "%d windows of %d tokens; mesh %s, global batch %d, %d worker(s)/rank",
            n,
            args.seq_len + 1,
            mesh.sizes,
            global_batch,
            args.num_workers,
        )
        t0 = time.perf_counter()
        ref = _phase("reference", world, mesh.sizes, cfg, "reference")
        elapsed = time.perf_counter() - t0
        with open(cfg.checkpoint_path) as f:
            state = json.load(f)
        log.info(
            "checkpoint at epoch %d position %d (step %d): %d bytes of JSON",
            state["epoch"],
            state["position"],
            cfg.checkpoint_step,
            len(json.dumps(state)),
        )
        rows = _checks(ref, mesh, n, cfg)
        same = _phase(f"resume on the same mesh {mesh.sizes}", world, mesh.sizes, cfg, "resume")
        ok, detail = _compare_resume(ref, mesh, same, mesh, cfg)
        rows.append((f"resume on the same mesh {mesh.sizes}", ok, detail))
        new_dp = args.resume_dp or dp * 2
        new_mesh = DataMesh.from_sizes(dp=new_dp)
        other = _phase(f"elastic resume on {new_mesh.sizes}", new_dp, new_mesh.sizes, cfg, "resume")
        ok, detail = _compare_resume(ref, mesh, other, new_mesh, cfg)
        rows.append((f"elastic resume on {new_mesh.sizes}", ok, detail))
    samples = sum(r["samples"] for r in ref)
    width = max(len(r[0]) for r in rows)
    print("\nmeshfeed demo summary")
    print(f"{'check':<{width}}  result  detail")
    for name, passed, detail in rows:
        print(f"{name:<{width}}  {'PASS' if passed else 'FAIL':<6}  {detail}")
    print(
        f"reference run: {samples} samples over {world} ranks in {elapsed:.1f}s (including process start-up)"
    )
    return 0 if all(r[1] for r in rows) else 1


def add_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run ranks on a dp x tp mesh, checkpoint, resume, verify",
        description=(
            "Real gloo ranks on a dp x tp mesh read a synthetic Megatron corpus for one epoch "
            "and part of the next, checkpoint mid-epoch, resume on the same mesh and on "
            "--resume-dp data ranks, and verify every batch. About a minute on 2 cores."
        ),
    )
    for flag, default, help_text in (
        ("--dp", 2, "data-parallel size of the reference run (default: 2)"),
        ("--tp", 2, "tensor-parallel size, replicas of each shard (default: 2)"),
        (
            "--resume-dp",
            None,
            "data-parallel size of the elastic resume; must divide the global batch "
            "(default: 2 x dp)",
        ),
        ("--batch-size", 4, "samples per data rank per step (default: 4)"),
        ("--seq-len", 256, "tokens per window, plus one (default: 256)"),
        ("--documents", 3000, "documents in the corpus (default: 3000)"),
        ("--num-workers", 1, "worker processes per rank (default: 1)"),
        ("--seed", 0, "seed of the corpus and the order (default: 0)"),
    ):
        p.add_argument(flag, type=int, default=default, help=help_text)
    p.add_argument(
        "--workdir", default=None, help="keep the corpus and checkpoint here (default: a temp dir)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress, only the summary")
    p.set_defaults(func=run)
