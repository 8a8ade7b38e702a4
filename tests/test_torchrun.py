"""A real ``torchrun --nproc_per_node=2`` launch without ``init_process_group`` (issue 11.1).

Both processes must take their rank from torchrun's ``RANK`` and read different data; before,
both ran as data rank 0 and trained on the same samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.dist_utils import free_port

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from meshfeed import DataLoader

    mesh = None if sys.argv[2] == "none" else {"dp": 2}
    loader = DataLoader(list(range(40)), batch_size=4, mesh=mesh, seed=3)
    seen = [int(x) for batch in loader for x in batch]
    out = os.path.join(sys.argv[1], os.environ["RANK"] + ".json")
    with open(out, "w") as f:
        json.dump({"rank": loader.rank, "data_rank": loader.data_rank, "seen": seen}, f)
    """
)


@pytest.mark.parametrize("mesh", ["none", "dp2"])
@pytest.mark.slow
def test_torchrun_processes_read_different_data(tmp_path: Path, mesh: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--nnodes=1",
        f"--master_port={free_port()}",
        str(script),
        str(tmp_path),
        mesh,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["data_rank"]) for r in results] == [(0, 0), (1, 1)]
    assert set(results[0]["seen"]).isdisjoint(results[1]["seen"])
    assert sorted(results[0]["seen"] + results[1]["seen"]) == list(range(40))
