"""num_workers="auto": the first batches timed in-process, then workers or not; same output."""

import time

import pytest
import torch

from meshfeed import DataLoader
from meshfeed.services import AutoService
from meshfeed.services.auto import MAX_AUTO_WORKERS, MIN_BATCH_SECONDS, choose_workers, usable_cores
from meshfeed.testing import assert_resume_equivalence, assert_same


class Costly:
    """Items that spend ``seconds`` of CPU each."""

    def __init__(self, n, seconds):
        self.n, self.seconds = n, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return torch.tensor([i])


def test_choose_workers_leaves_two_cores_and_keeps_cheap_batches_in_process():
    assert choose_workers(1.0, 1) == 0  # one core: in-process
    assert choose_workers(1.0, 2) == choose_workers(1.0, 3) == choose_workers(1.0, 4) == 2
    assert choose_workers(1.0, 5) == 3 and choose_workers(1.0, 16) == 14
    assert choose_workers(MIN_BATCH_SECONDS / 2, 2) == 0
    assert choose_workers(MIN_BATCH_SECONDS / 2, 16) == 0  # too cheap to send
    assert choose_workers(1.0, 1000) == MAX_AUTO_WORKERS
    assert 1 <= usable_cores() <= (len(__import__("os").sched_getaffinity(0)))


def test_auto_starts_workers_for_costly_batches_with_the_same_output():
    data = Costly(24, 0.002)  # 4 ms batches
    service = AutoService(cores=4)
    got = list(DataLoader(data, batch_size=2, seed=1, service=service))
    assert service.chosen == 2
    assert_same(got, list(DataLoader(data, batch_size=2, seed=1)))
    service.shutdown()


def test_auto_stays_in_process_for_cheap_batches_and_on_one_core():
    cheap = AutoService(cores=16)
    list(DataLoader(list(range(40)), batch_size=4, service=cheap))
    assert cheap.chosen == 0
    single = AutoService(cores=1)
    list(DataLoader(Costly(12, 0.002), batch_size=2, service=single))
    assert single.chosen == 0


def test_auto_starts_two_workers_on_two_cores_for_costly_batches():
    data = Costly(16, 0.002)
    service = AutoService(cores=2)
    got = list(DataLoader(data, batch_size=2, seed=4, service=service))
    assert service.chosen == 2
    assert_same(got, list(DataLoader(data, batch_size=2, seed=4)))
    service.shutdown()


def test_num_workers_auto_on_this_machine_reads_every_sample():
    loader = DataLoader(Costly(16, 0.0005), batch_size=2, seed=0, num_workers="auto")
    got = sorted(v for b in loader for v in b.view(-1).tolist())
    assert got == list(range(16))
    loader.shutdown()


def test_resume_is_exact_when_auto_starts_workers():
    def factory():
        return DataLoader(
            Costly(20, 0.001), batch_size=2, seed=3, service=AutoService(cores=4), drop_last=False
        )

    assert_resume_equivalence(
        factory, num_items=14, every=3, cleanup=lambda loader: loader.shutdown()
    )


def test_bad_num_workers_strings_are_refused_by_name():
    with pytest.raises(ValueError, match="num_workers must be an int >= 0 or 'auto'"):
        DataLoader(list(range(8)), batch_size=2, num_workers="many")
    with pytest.raises(ValueError, match="num_workers=auto and service=AutoService"):
        DataLoader(list(range(8)), batch_size=2, num_workers="auto", service=AutoService())
