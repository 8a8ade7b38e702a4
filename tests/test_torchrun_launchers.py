"""Four ``torchrun`` launchers x 2 ranks on loopback, one launcher killed, resumed on three (#32).

Each launcher is its own ``torchrun --nnodes=4 --node_rank=i`` (a node of a multi-node job, on
127.0.0.1). The job trains (a barrier per step stands for the gradient all-reduce), saves the
loader with ``torch.distributed.checkpoint`` at step 4, and goes on; the test SIGKILLs launcher
3 and its two ranks (torchrun starts ranks outside the launcher's process group, so killing the
group alone left them running), every surviving rank fails in its next collective (each says
so in a file), and the job is launched
again on 3 launchers x 2 ranks (6 data ranks, the same global batch of 24) from the
checkpoint: the samples before the checkpoint and after the resume are one epoch, each once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.dist_utils import free_port

N, G, SAVE_AT = 240, 24, 4

JOB = textwrap.dedent(
    f"""
    import json, os, sys, time
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from meshfeed import DataLoader

    out, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(list(range({N})), batch_size={G} // world, seed=5, timeout=60)
    if phase == "resume":
        dcp.load({{"data": loader}}, checkpoint_id=os.path.join(out, "ckpt"))
    log = open(os.path.join(out, f"{{phase}}-{{rank}}.jsonl"), "a")
    with open(os.path.join(out, f"{{phase}}-{{rank}}.pid"), "w") as f:
        f.write(str(os.getpid()))  # torchrun starts its ranks outside the launcher's group
    try:
        for step, batch in enumerate(loader):
            log.write(json.dumps([loader.position, batch.tolist()]) + "\\n")
            log.flush()
            dist.barrier()  # the training step's collective
            if phase == "first" and step + 1 == {SAVE_AT}:
                dcp.save({{"data": loader}}, checkpoint_id=os.path.join(out, "ckpt"))
                dist.barrier()
                if rank == 0:
                    open(os.path.join(out, "saved"), "w").close()
            if phase == "first" and step + 1 >= {SAVE_AT}:
                time.sleep(0.5)  # slow enough for the kill to land mid-epoch
    except Exception as exc:  # a peer's node was lost: this rank fails, and says so
        with open(os.path.join(out, f"{{phase}}-{{rank}}.failed"), "w") as f:
            f.write(type(exc).__name__)
        raise
    dist.destroy_process_group()
    """
)


def _launch(script: Path, out: Path, phase: str, nodes: int, port: int) -> list[subprocess.Popen]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                f"--nnodes={nodes}",
                f"--node_rank={node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(script),
                str(out),
                phase,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: the kill takes its ranks too
        )
        for node in range(nodes)
    ]


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait(timeout=30))
    return codes


def _batches(out: Path, phase: str, ranks: int) -> dict[int, list[int]]:
    """Global position after each step -> the samples of that step on every rank."""
    steps: dict[int, list[int]] = {}
    for r in range(ranks):
        for line in (out / f"{phase}-{r}.jsonl").read_text().splitlines():
            position, batch = json.loads(line)
            steps.setdefault(position, []).extend(batch)
    return steps


@pytest.mark.slow
def test_four_launchers_one_killed_and_the_job_resumed_on_three(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    first = _launch(script, tmp_path, "first", 4, free_port())
    deadline = time.monotonic() + 240
    while not (tmp_path / "saved").exists():
        assert time.monotonic() < deadline, "the job never reached its checkpoint"
        assert all(p.poll() is None for p in first), [p.stderr.read()[-2000:] for p in first]
        time.sleep(0.2)
    # A node is lost mid-epoch: its launcher and both its ranks (6 and 7).
    os.killpg(first[3].pid, signal.SIGKILL)
    for r in (6, 7):
        os.kill(int((tmp_path / f"first-{r}.pid").read_text()), signal.SIGKILL)
    # The survivors' ranks fail in their next collective, not hang. (Their launchers then
    # wait in torchrun's own exit barrier for the lost node, 300 s: not the loader's to end.)
    failed = [tmp_path / f"first-{r}.failed" for r in range(6)]
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in failed):
        assert time.monotonic() < deadline, [f.name for f in failed if not f.exists()]
        time.sleep(0.2)
    for p in first:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert _wait(first, 30)[3] != 0
    resumed = _launch(script, tmp_path, "resume", 3, free_port())
    assert _wait(resumed, 240) == [0, 0, 0], [p.stderr.read()[-3000:] for p in resumed]
    before = _batches(tmp_path, "first", 8)
    after = _batches(tmp_path, "resume", 6)
    served = [x for pos in sorted(before) if pos <= SAVE_AT * G for x in before[pos]]
    served += [x for pos in sorted(after) for x in after[pos]]
    assert min(after) == SAVE_AT * G + G  # the first step after the checkpoint
    assert all(len(before[pos]) == G for pos in before if pos <= SAVE_AT * G)
    assert max(before) < N  # the first run was cut short: it never served the whole epoch
    assert sorted(served) == list(range(N))  # one epoch, every sample exactly once
