"""SampleStore.load checks the file's bookkeeping: a doctored file (weights-only safe, so it
loads) is refused with a ValueError naming the fault and the file, never a bare IndexError /
KeyError and never a silently overwritten or dropped sample; temp files of killed saves are
cleaned on hosts whose name holds a '-'."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed.queue import SampleStore
from meshfeed.queue.checkpoints import state as ckpt


def _saved(tmp_path: Path) -> Path:
    store = SampleStore()
    store.put("p", {"x": torch.arange(8).reshape(4, 2), "y": [np.arange(2)] * 4})
    store.put("p", {"z": [1]}, ids=["a"])
    store.get("t", ["x"], 1, "p", timeout=1)
    path = tmp_path / "store.ckpt"
    store.save(path)
    return path


def _doctor(
    path: Path, change: Callable[[dict[str, Any], list[Any], dict[str, Any]], None]
) -> None:
    """Rewrite the file with ``change(meta, values, blob)`` applied: still weights-only safe."""
    blob = torch.load(path, weights_only=True)
    meta, values = json.loads(blob["meta"]), json.loads(blob["values"])
    change(meta, values, blob)
    blob["meta"], blob["values"] = json.dumps(meta), json.dumps(values)
    torch.save(blob, path)


def _part(meta: dict[str, Any]) -> dict[str, Any]:
    return meta["partitions"][0]


def _lower_next_id(meta, values, blob):
    _part(meta)["next_id"] = 2


def _negative_next_id(meta, values, blob):
    _part(meta)["next_id"] = -1


def _duplicate_id(meta, values, blob):
    samples = _part(meta)["samples"]
    samples[1][0] = samples[0][0]


def _tensor_out_of_range(meta, values, blob):
    values[0][0]["x"]["t"] = 99


def _negative_tensor_index(meta, values, blob):
    values[0][1]["y"]["a"] = -1


def _array_dtype_unviewable(meta, values, blob):
    values[0][1]["y"]["dtype"] = "<U3"  # 8-byte ints viewed as 12-byte strings: no


def _value_missing(meta, values, blob):
    del values[0][2]["y"]


def _sample_without_values(meta, values, blob):
    values[0].pop()


def _partition_field_missing(meta, values, blob):
    del _part(meta)["seen"]


def _option_missing(meta, values, blob):
    del meta["options"]["capacity"]


def _produced_too_low(meta, values, blob):
    meta["produced"] = 1


def _consumed_count_too_low(meta, values, blob):
    meta["consumed"]["t"] = 0


def _consumed_unknown_sample(meta, values, blob):
    _part(meta)["consumed"]["t"] = [77]


def _field_never_seen(meta, values, blob):
    _part(meta)["seen"] = ["x", "y"]


def _tensors_missing(meta, values, blob):
    del blob["tensors"]


CASES = [
    (_lower_next_id, "holds sample id 2 but its next_id is 2"),
    (_negative_next_id, "partition 'p' has a negative next_id -1"),
    (_duplicate_id, "lists sample id 0 twice"),
    (_tensor_out_of_range, "field 'x' of sample 0 .* names tensor 99, outside the file's 8"),
    (_negative_tensor_index, "field 'y' of sample 1 .* names tensor -1"),
    (_array_dtype_unviewable, "cannot view tensor .* as dtype '<U3'"),
    (_value_missing, r"sample 2 .* lists fields \['x', 'y'\] but has values for \['x'\]"),
    (_sample_without_values, "has values for 4 samples but lists 5"),
    (_partition_field_missing, "partition 0 \\('p'\\) lacks field 'seen'"),
    (_option_missing, "options lack 'capacity'"),
    (_produced_too_low, "holds 5 samples but counts only 1 produced"),
    (_consumed_count_too_low, "task 't' has 1 held samples marked consumed but a consumed count"),
    (_consumed_unknown_sample, r"consumed list of partition 'p' names samples .*\[77\]"),
    (_field_never_seen, r"sample 'a' .* fields \['z'\] the partition never saw"),
    (_tensors_missing, r"lacks \['tensors'\]"),
]


@pytest.mark.parametrize("change, message", CASES, ids=[c[0].__name__[1:] for c in CASES])
def test_load_refuses_doctored_bookkeeping_naming_the_fault_and_the_file(
    tmp_path: Path, change, message: str
) -> None:
    path = _saved(tmp_path)
    SampleStore.load(path)  # the intact file loads
    _doctor(path, change)
    with pytest.raises(ValueError, match=message) as info:
        SampleStore.load(path)
    assert repr(str(path)) in str(info.value)


def test_load_refuses_unparsable_metadata_naming_the_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    blob = torch.load(path, weights_only=True)
    blob["meta"] = "{not json"
    torch.save(blob, path)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}.* unreadable metadata"):
        SampleStore.load(path)


def test_a_lower_next_id_would_have_overwritten_a_held_sample(tmp_path: Path) -> None:
    # The fault the check prevents: fresh ids from next_id collide with held ones.
    path = _saved(tmp_path)
    _doctor(path, _lower_next_id)
    with pytest.raises(ValueError, match="fresh ids would overwrite held samples"):
        SampleStore.load(path)


def test_load_state_dict_refuses_doctored_bookkeeping_too() -> None:
    store = SampleStore()
    store.put("p", {"x": [1, 2, 3]})
    state = store.state_dict()
    state["partitions"][0]["samples"][2][0] = 0  # id 0 twice, id 2 gone
    with pytest.raises(ValueError, match="SampleStore state is inconsistent: .* sample id 0 twice"):
        store.load_state_dict(state)
    state = store.state_dict()
    state["partitions"].append(dict(state["partitions"][0]))
    with pytest.raises(ValueError, match="partition 'p' appears twice"):
        store.load_state_dict(state)


def test_an_intact_file_with_groups_leases_holds_and_shared_plans_loads(tmp_path: Path) -> None:
    from meshfeed.queue import RankAwareSampler

    store = SampleStore(lease_timeout=60)
    store.put("p", {"x": [1, 2, 3, 4]}, ids=["a", "b", "c", "d"], groups=[0, 0, 1, 1])
    store.get("t", ["x"], 1, "p", timeout=1, hold=True)
    lead = RankAwareSampler(data_rank=0, replica_rank=0, replica_size=2)
    store.get("r", ["x"], 2, "p", sampler=lead, timeout=1, batch_index=0)
    store.save(tmp_path / "s")
    assert SampleStore.load(tmp_path / "s").stats()["held"] == 4


def test_the_temp_name_and_the_cleanup_agree_on_a_host_with_dashes(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-07")
    target = str(tmp_path / "s")
    script = (
        "import os, socket, torch\n"
        "socket.gethostname = lambda: 'gpu-node-07'\n"
        "from meshfeed.queue import SampleStore\n"
        "def stop(*a, **k): os._exit(9)\n"  # killed in the middle of writing
        "torch.save = stop\n"
        f"s = SampleStore(); s.put('p', {{'x': [1]}}); s.save({target!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=120).returncode == 9
    left = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(f".samplestore-{ckpt.host_tag()}-")
    assert ckpt.host_tag() == "gpu_node_07"
    store = SampleStore()
    store.put("p", {"x": [1]})
    store.save(tmp_path / "s")
    assert os.listdir(tmp_path) == ["s"]


def test_a_held_sample_marked_consumed_by_every_task_is_refused(tmp_path: Path) -> None:
    """A crafted file that lists a held sample as consumed (count bumped to match) would keep
    it in the store, never delivered; with declared tasks no store writes that (#28)."""
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": [0, 1, 2, 3]})
    store.get("t", ["x"], 2, "p", timeout=1)  # 0 and 1 consumed and dropped
    path = tmp_path / "store.ckpt"
    store.save(path)
    intact = SampleStore.load(path)
    assert intact.get("t", ["x"], 2, "p", timeout=1).ids == [2, 3]

    def consume_held(meta, values, blob):
        _part(meta)["consumed"]["t"].append(2)

    _doctor(path, consume_held)
    with pytest.raises(ValueError, match=r"samples \['2'\] marked consumed by every task"):
        SampleStore.load(path)
    # A sample a loader holds (fetched ahead, not yet returned) is kept, consumed: it loads.
    store.get("t", ["x"], 1, "p", timeout=1, hold=True)
    store.save(path)
    assert SampleStore.load(path).get("t", ["x"], 1, "p", timeout=1).ids == [3]
