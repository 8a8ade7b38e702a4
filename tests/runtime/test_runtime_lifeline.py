"""Worker processes die with their parent (#20): SIGKILL a loader's process mid-epoch (fork, the
default start method) and every process of its tree (workers, multiprocessing's resource
tracker) is gone within 2 s, for every runtime that starts workers. Plus the lifeline's parts
on their own: when the parent-death signal is armed, how a dead or replaced parent is seen, and
that a forked worker holds no copy of the parent's pipe ends."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from meshfeed.runtime import WorkerPool, call
from meshfeed.runtime.lifeline import Parent, parent_alive
from tests.process_faults import TREE_SCRIPTS, assert_tree_dies


@pytest.mark.slow
@pytest.mark.parametrize("runtime", list(TREE_SCRIPTS))
def test_killed_loader_leaves_no_process_behind(runtime: str, tmp_path: Path) -> None:
    assert_tree_dies(runtime, tmp_path)


def test_parent_here_arms_the_signal_only_from_a_long_lived_thread() -> None:
    import threading

    assert Parent.here("fork") == Parent(pid=os.getpid(), direct=True, pdeathsig=True)
    assert Parent.here("forkserver").direct is False
    seen: list[Parent] = []
    t = threading.Thread(target=lambda: seen.append(Parent.here("spawn")))
    t.start()
    t.join()
    assert seen == [Parent(pid=os.getpid(), direct=True, pdeathsig=False)]


def test_parent_alive_sees_a_dead_pid_and_a_new_parent() -> None:
    me = Parent(pid=os.getpid(), direct=True, pdeathsig=False)
    assert parent_alive(me, os.getppid())
    assert not parent_alive(me, os.getppid() + 1)  # reparented
    child = mp.get_context("fork").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    gone = Parent(pid=child.pid, direct=False, pdeathsig=False)
    assert not parent_alive(gone, os.getppid())


def test_forked_worker_sees_end_of_file_when_the_parent_closes_its_pipe() -> None:
    """No worker holds a copy of a task pipe's write end (its own or an earlier worker's):
    the parent closing it is end-of-file in the worker, which then exits."""
    with WorkerPool(2, timeout=10, start_method="fork") as pool:
        pool.start(call)
        procs = pool._state["procs"]
        for w in (1, 0):  # worker 1 was forked holding worker 0's end before the fix
            pool._state["tasks"][w].close()
            procs[w].join(timeout=2.0)
            assert procs[w].exitcode == 0, (w, procs[w].exitcode)
