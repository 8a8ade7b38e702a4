"""Bad samples: retry, then raise / skip / deterministic substitute, each sample read once."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from typing import Any

import numpy as np
import pytest

from meshfeed import DataLoader, SampleError
from meshfeed.errors import RankError, SourceError
from meshfeed.fetch import Failed, Fetcher, FetchTask
from meshfeed.order.permutation import derive_seed
from meshfeed.sources.tokens.indexed import IndexedFormatError, TokenCorpus
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.testing import assert_resume_equivalence, take
from tests.dist_utils import run_distributed

N = 400


def is_bad(i: int) -> bool:
    """About 5 % of indices, spread pseudo-randomly."""
    return derive_seed(77, i) % 20 == 0


class Flaky:
    """Items raise for ``is_bad`` indices; ``reads`` counts every read of every index."""

    def __init__(self, n: int = N, *, transient: bool = False) -> None:
        self.n, self.transient = n, transient
        self.reads: Counter[int] = Counter()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads[i] += 1
        if is_bad(i) and (not self.transient or self.reads[i] == 1):
            raise OSError(f"corrupt record {i}")
        return i


class Batched(Flaky):
    """Reports bad items in place from ``__getitems__`` (None rejects, Failed fails)."""

    def __init__(self, n: int = N) -> None:
        super().__init__(n)
        self.batch_reads: Counter[int] = Counter()

    def __getitems__(self, indices: list[int]) -> list[Any]:
        out: list[Any] = []
        for i in indices:
            self.batch_reads[i] += 1
            if is_bad(i):
                out.append(None if i % 2 else Failed(OSError(f"corrupt record {i}")))
            else:
                out.append(i)
        return out


BAD = [i for i in range(N) if is_bad(i)]


def test_the_fixture_has_about_five_percent_bad_items():
    assert 0.03 < len(BAD) / N < 0.08


def test_substitutes_keep_batches_full_and_are_counted():
    ds = Flaky()
    lo = DataLoader(ds, batch_size=10, seed=1)
    batches = [b.tolist() for b in lo]
    assert len(batches) == N // 10 and all(len(b) == 10 for b in batches)
    assert not set(BAD) & {x for b in batches for x in b}
    stats = lo.stats()
    assert stats["substituted"] >= len(BAD) and stats["skipped"] == 0
    first = stats["failures"][0]
    assert set(first) == {"index", "position", "attempt", "error", "message"}
    assert first["error"] == "OSError" and first["index"] in BAD
    assert len(stats["failures"]) == 8  # the first K failures only


def test_healthy_samples_are_read_exactly_once():
    ds = Flaky()
    list(DataLoader(ds, batch_size=10, seed=1, on_error="skip"))
    assert all(ds.reads[i] == 1 for i in range(N))


def test_batched_datasets_report_bad_items_in_place_without_rereads():
    ds = Batched()
    lo = DataLoader(ds, batch_size=10, seed=1)
    batches = [b.tolist() for b in lo]
    assert all(len(b) == 10 for b in batches)
    assert ds.batch_reads == Counter(range(N))  # every item once through the batch call
    # Item by item, only substitutes are read (not the healthy rest of an affected batch).
    stats = lo.stats()
    assert stats["substituted"] >= len(BAD)
    assert sum(ds.reads.values()) <= stats["substituted"] + len(BAD)


def test_transient_failures_are_retried_and_not_substituted():
    ds = Flaky(transient=True)
    lo = DataLoader(ds, batch_size=10, seed=1, max_retries=2)
    batches = [b.tolist() for b in lo]
    assert sorted(x for b in batches for x in b) == list(range(N))
    assert lo.stats()["retries"] == len(BAD) and lo.stats()["substituted"] == 0


def test_skip_shortens_the_batch_but_not_the_epoch():
    lo = DataLoader(Flaky(), batch_size=10, seed=1, on_error="skip")
    sizes = [len(b) for b in lo]
    assert len(sizes) == N // 10 and sum(sizes) == N - len(BAD)
    assert lo.stats()["skipped"] == len(BAD)


def test_raise_stops_with_the_failing_index_in_the_message():
    lo = DataLoader(Flaky(), batch_size=10, shuffle=False, on_error="raise")
    with pytest.raises(SampleError, match=rf"sample {BAD[0]} \(epoch position {BAD[0]}\)"):
        list(lo)


def test_raise_names_a_rejected_index_too():
    lo = DataLoader(Batched(), batch_size=10, shuffle=False, on_error="raise")
    with pytest.raises(SampleError, match=rf"sample {BAD[0]} "):
        list(lo)


def test_substitute_depends_only_on_seed_epoch_position_and_attempt():
    fetcher = Fetcher(Flaky(), seed=5)
    a = fetcher.substitute_index(2, 17, 1)
    assert a == Fetcher(Flaky(), seed=5).substitute_index(2, 17, 1)
    assert a != fetcher.substitute_index(3, 17, 1)
    task = FetchTask(2, 0, np.array([BAD[0]]), np.array([17]))
    batch, events = fetcher(task)
    sub = a if not is_bad(a) else None
    if sub is not None:
        assert batch.tolist() == [sub] and events.substituted == 1


def test_all_ranks_agree_with_the_single_process_global_batch():
    """Simulation of 4 data ranks in one process: same steps, same substitutes per position."""
    whole = [b.tolist() for b in DataLoader(Flaky(), batch_size=40, seed=3)]
    ranks = [[b.tolist() for b in DataLoader(Flaky(), batch_size=10, mesh={"dp": 4}, rank=r, seed=3)] for r in range(4)]  # fmt: skip
    assert {len(r) for r in ranks} == {len(whole)}
    for step, batch in enumerate(whole):
        assert sum((ranks[r][step] for r in range(4)), []) == batch


def test_failure_counts_are_in_the_checkpoint_and_resume_exactly():
    def factory() -> DataLoader:
        return DataLoader(Flaky(60), batch_size=4, mesh={"dp": 2}, rank=1, seed=2)

    assert_resume_equivalence(factory, num_items=12)
    lo = factory()
    take(lo, 10)
    state = json.loads(json.dumps(lo.state_dict()))
    assert state["stats"]["substituted"] == lo.stats()["substituted"] > 0
    fresh = factory()
    fresh.load_state_dict(state)
    assert fresh.stats()["substituted"] == state["stats"]["substituted"]
    assert fresh.stats()["failures"] == lo.stats()["failures"]
    keys = ("index", "position", "attempt", "error", "message")
    assert [[f[k] for k in keys] for f in lo.stats()["failures"]] == state["stats"]["failures"]


def test_workers_substitute_like_the_main_process():
    ref = [b.tolist() for b in DataLoader(Flaky(), batch_size=10, seed=4)]
    with DataLoader(Flaky(), batch_size=10, seed=4, num_workers=2) as lo:
        assert [b.tolist() for b in lo] == ref


# ---------------------------------------------------------------------- token files
@pytest.fixture
def corpus(tmp_path):
    prefix = tmp_path / "c"
    write_indexed(prefix, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], np.uint16)
    return prefix


def test_truncated_bin_file_gives_a_clear_error(corpus):
    bin_path = corpus.with_suffix(".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-4])
    with pytest.raises(IndexedFormatError, match="truncated"):
        TokenCorpus(corpus)


def test_truncated_idx_file_gives_a_clear_error(corpus):
    idx_path = corpus.with_suffix(".idx")
    idx_path.write_bytes(idx_path.read_bytes()[:-3])
    with pytest.raises(IndexedFormatError, match="truncated or corrupt"):
        TokenCorpus(corpus)
    idx_path.write_bytes(idx_path.read_bytes()[:10])
    with pytest.raises(IndexedFormatError, match="shorter than the 34-byte header"):
        TokenCorpus(corpus)


def test_corrupt_magic_gives_a_clear_error(corpus, tmp_path):
    shutil.copy(corpus.with_suffix(".bin"), tmp_path / "d.bin")
    raw = bytearray(corpus.with_suffix(".idx").read_bytes())
    raw[:4] = b"JUNK"
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedFormatError, match="bad magic"):
        TokenCorpus(tmp_path / "d")


def test_missing_token_file_names_the_path(corpus):
    corpus.with_suffix(".bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"c\.bin does not exist"):
        TokenCorpus(corpus)


# ---------------------------------------------------------------------- real processes
def _bad_samples_rank(rank: int, world: int) -> dict[str, Any]:
    lo = DataLoader(Flaky(), batch_size=10, seed=3, timeout=60)
    batches = [b.tolist() for b in lo]
    out: dict[str, Any] = {"batches": batches, "stats": lo.stats()}
    raising = DataLoader(Flaky(), batch_size=10, shuffle=False, on_error="raise", timeout=60)
    try:
        out["raise_steps"] = len(list(raising))
    except (SampleError, RankError) as exc:
        out["raise_error"] = type(exc).__name__
        out["raise_message"] = str(exc).splitlines()[0]
    return out


@pytest.mark.slow
def test_four_gloo_ranks_complete_an_epoch_with_identical_steps_and_substitutes():
    results = run_distributed(_bad_samples_rank, 4, timeout=180)
    whole = [b.tolist() for b in DataLoader(Flaky(), batch_size=40, seed=3)]
    assert [len(r["batches"]) for r in results] == [len(whole)] * 4
    for step, batch in enumerate(whole):
        assert sum((r["batches"][step] for r in results), []) == batch
    assert sum(r["stats"]["substituted"] for r in results) >= len(BAD)
    # Without shuffling rank r reads positions [10r, 10r + 10) of every global batch of 40.
    # on_error="raise": every rank stops at the first step where any rank has a bad sample;
    # the ranks that have one there raise it, the others RankError naming the lowest of them.
    first = {r: min([i // 40 for i in BAD if (i % 40) // 10 == r] + [N // 40]) for r in range(4)}
    stop = min(first.values())
    assert stop < N // 40
    failed = min(r for r in range(4) if first[r] == stop)
    for r, res in enumerate(results):
        if first[r] == stop:
            bad = min(i for i in BAD if (i % 40) // 10 == r)
            assert res["raise_error"] == "SampleError", res
            assert f"sample {bad} (epoch position {bad})" in res["raise_message"]
        else:
            assert res["raise_error"] == "RankError", res
            assert res["raise_message"].startswith(
                f"rank {failed} failed to make its batch at step {stop} of epoch 0"
            )


class _OneGoodItem:
    """Every item but ``good`` is rejected (a filter that keeps 1 item in 32)."""

    def __init__(self, good: int) -> None:
        self.good = good

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Any:
        return i if i == self.good else None


def test_heavy_filters_are_substituted_not_reported_as_a_broken_dataset():
    fetcher = Fetcher(_OneGoodItem(0), seed=0)
    # The position whose first substitute hitting the good item comes latest (but within 64).
    hits = {
        p: next(a for a in range(1, 65) if fetcher.substitute_index(0, p, a) == 0)
        for p in range(1, 200)
        if any(fetcher.substitute_index(0, p, a) == 0 for a in range(1, 65))
    }
    position = max(hits, key=hits.__getitem__)
    assert hits[position] > 16
    task = FetchTask(epoch=0, step=0, indices=np.array([position]), positions=np.array([position]))
    batch, events = fetcher(task)
    assert batch.tolist() == [0] and events.substituted == 1


# ---------------------------------------------------------------------- visible (#11 item 4)
def test_the_first_bad_sample_of_a_run_is_logged_then_rate_limited(caplog, monkeypatch):
    import meshfeed.loader_base

    monkeypatch.setattr(meshfeed.loader_base, "WARN_EVERY", 10)
    loader = DataLoader(Flaky(), batch_size=8, seed=4)
    with caplog.at_level("WARNING", logger="meshfeed"):
        take(loader, 1)
        first = loader.stats()
        list(loader)
    bad = loader.stats()["substituted"]
    assert bad > 10  # enough to cross the rate limit at least once
    # The bad-sample warnings (on a loaded machine the stall warning may join them).
    warnings = [
        r for r in caplog.records if r.name == "meshfeed" and "bad sample" in r.getMessage()
    ]
    assert 1 <= len(warnings) <= 1 + bad // 10
    message = warnings[0].getMessage()
    failure = (first["failures"] or loader.stats()["failures"])[0]
    assert f"index {failure['index']}" in message and "OSError: corrupt record" in message
    assert "loader.stats()['failures']" in message and "at most once per 10" in message
    # A new run (a new loader, e.g. resumed) warns again for its own first bad sample.
    caplog.clear()
    with caplog.at_level("WARNING", logger="meshfeed"):
        take(DataLoader(Flaky(), batch_size=8, seed=4), 50)
    assert any("bad sample" in r.getMessage() for r in caplog.records)


def test_a_clean_run_logs_nothing(caplog):
    with caplog.at_level("WARNING", logger="meshfeed"):
        list(DataLoader(list(range(40)), batch_size=4))
    assert not caplog.records


def test_padding_with_drop_last_false_is_logged_once(caplog):
    with caplog.at_level("WARNING", logger="meshfeed"):
        # 9 samples over 4 data ranks of batch 2: the last global batch has 1 sample.
        loader = DataLoader(list(range(9)), batch_size=2, mesh={"dp": 4}, rank=3, drop_last=False)
        take(loader, 6)
    padded = [r for r in caplog.records if "repeat the start of the epoch" in r.getMessage()]
    assert loader.stats()["padded"] >= 2 and len(padded) == 1
    assert "drop_last=True" in padded[0].getMessage()


# ---------------------------------------------------------------------- damaged files (item 3)
class Damaged:
    def __init__(self, error: BaseException, *, batched: bool = False) -> None:
        self.error, self.reads = error, Counter()
        if batched:
            self.__getitems__ = self._getitems  # type: ignore[method-assign]

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        self.reads[i] += 1
        if i == 5:
            raise self.error
        return i

    def _getitems(self, indices: list[int]) -> list[Any]:
        return [Failed(self.error) if i == 5 else i for i in indices]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("on_error", ["substitute", "skip"])
@pytest.mark.parametrize(
    "error", [SourceError("shard-3.bin is truncated at document 5"), MemoryError("out of memory")]
)
def test_a_damaged_file_is_raised_at_once_never_substituted(error, on_error, batched):
    ds = Damaged(error, batched=batched)
    loader = DataLoader(ds, batch_size=8, shuffle=False, on_error=on_error, max_retries=3)
    with pytest.raises(type(error), match=str(error)):
        list(loader)
    assert ds.reads[5] <= 1  # not retried
    assert loader.stats()["substituted"] == loader.stats()["skipped"] == 0


class DamagedBatch:
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return i

    def fetch_batch(self, indices: np.ndarray) -> Any:
        raise SourceError("page 2 of part-0.parquet is corrupt")


def test_a_damaged_file_in_fetch_batch_is_raised_not_repaired_item_by_item():
    with pytest.raises(SourceError, match="part-0.parquet"):
        list(DataLoader(DamagedBatch(), batch_size=4))


def test_a_raising_on_step_takes_back_the_bad_samples_of_its_batch():
    """on_step raising on a batch with substitutes: stats and state as before that batch (the
    failures list cut back, the same list), and the finished run counts every batch once."""
    calls: list[int] = []

    def on_step(timing: Any) -> None:
        calls.append(timing.steps)
        if len(calls) == 7:
            raise KeyError("dashboard down")

    def factory(**kw: Any) -> DataLoader:
        return DataLoader(Flaky(60), batch_size=4, shuffle=False, seed=2, **kw)

    ref = factory()
    ref_batches = [b.tolist() for b in ref]
    lo = factory(on_step=on_step)
    it = iter(lo)
    got = [next(it).tolist() for _ in range(6)]
    before, state, listed = lo.stats(), lo.state_dict(), lo._stats["failures"]
    assert before["substituted"] == len(listed) == 1  # index 23
    assert any(is_bad(i) for i in range(24, 28))  # the refused batch has a substitute too
    with pytest.raises(KeyError, match="dashboard down"):
        next(it)
    after = lo.stats()
    del before["delivery"], after["delivery"]
    assert after == before and lo.state_dict() == state
    assert lo._stats["failures"] is listed
    got += [b.tolist() for b in lo]
    assert got == ref_batches
    mine, theirs = lo.stats(), ref.stats()
    del mine["delivery"], theirs["delivery"]
    assert mine == theirs


class _RejectsSome:
    """``__getitem__`` only: every third item is rejected (None), the rest is its index."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: Counter[int] = Counter()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.reads[i] += 1
        return None if i % 3 == 1 else i


def test_getitem_rejections_anywhere_in_a_batch_are_replaced_and_read_once():
    ds = _RejectsSome(24)
    lo = DataLoader(ds, batch_size=6, shuffle=False, on_error="skip")
    batches = [b.tolist() for b in lo]
    assert batches == [[i for i in range(k, k + 6) if i % 3 != 1] for k in range(0, 24, 6)]
    assert ds.reads == Counter(range(24)) and lo.stats()["skipped"] == 8
