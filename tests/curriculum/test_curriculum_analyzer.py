"""The analyzer: worker-count independent output, two-pass vocabulary rarity, saved indexes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from meshfeed.curriculum import (
    AccumulatedMetric,
    MetricIndex,
    SampleMetric,
    analyze,
    seqlen,
    vocab_rarity,
)
from meshfeed.runtime import WorkerError

VOCAB = 40


def _docs(n: int = 600, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(1, 30))) for _ in range(n)]


def _mean(doc: np.ndarray) -> float:
    return float(doc.mean()) / 3.0


METRICS = [
    seqlen(),
    vocab_rarity(VOCAB),
    SampleMetric(name="mean", fn=_mean, dtype="float32"),
]


def test_output_is_identical_with_1_and_4_workers(tmp_path):
    docs = _docs()
    one = analyze(docs, METRICS, num_workers=1, chunk_size=64, progress=False)
    four = analyze(docs, METRICS, num_workers=4, chunk_size=64, progress=False, output_dir=tmp_path)
    assert sorted(one) == ["mean", "seqlen", "token_histogram", "vocab_rarity"]
    for name in ("mean", "seqlen", "vocab_rarity"):
        a, b = one[name], four[name]
        assert isinstance(a, MetricIndex) and isinstance(b, MetricIndex)
        assert a.values.dtype == b.values.dtype and a.values.tobytes() == b.values.tobytes()
        assert a.order.tolist() == b.order.tolist()
        saved = MetricIndex.load(tmp_path / name, dataset=docs)
        assert saved.values.tobytes() == a.values.tobytes()
    assert np.array_equal(one["token_histogram"], four["token_histogram"])


def test_in_process_and_worker_runs_agree():
    docs = _docs(200)
    a = analyze(docs, [seqlen()], num_workers=0, chunk_size=7, progress=False)
    b = analyze(docs, [seqlen()], num_workers=2, chunk_size=50, progress=False)
    assert a["seqlen"].values.tolist() == b["seqlen"].values.tolist() == [len(d) for d in docs]


def test_vocab_rarity_is_the_sum_of_negative_log_token_probabilities():
    docs = _docs(100)
    result = analyze(docs, [vocab_rarity(VOCAB)], progress=False, chunk_size=16)
    counts = np.bincount(np.concatenate(docs), minlength=VOCAB)
    assert result["token_histogram"].tolist() == counts.tolist()
    p = counts / counts.sum()
    want = [float(-np.log(p[d]).sum()) for d in docs]
    np.testing.assert_allclose(result["vocab_rarity"].values, want, rtol=1e-12)


def test_accumulated_metrics_can_be_float_and_are_summed_in_chunk_order():
    docs = _docs(100)

    def add_len(acc: np.ndarray, doc: np.ndarray) -> None:
        acc[0] += len(doc) * 0.1

    acc = AccumulatedMetric(name="tokens", fn=add_len, size=1, dtype="float64")
    a = analyze(docs, [acc], progress=False, chunk_size=9)["tokens"]
    b = analyze(docs, [acc], progress=False, chunk_size=9, num_workers=3)["tokens"]
    assert isinstance(a, np.ndarray) and a.tobytes() == b.tobytes()
    assert a[0] == pytest.approx(sum(len(d) for d in docs) * 0.1)


def test_dict_samples_are_read_through_a_key():
    docs = [{"input_ids": d} for d in _docs(50)]
    out = analyze(docs, [seqlen(key="input_ids")], progress=False)
    assert out["seqlen"].values.tolist() == [len(d["input_ids"]) for d in docs]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metrics": []}, "at least one metric"),
        ({"metrics": ["seqlen"]}, "must be SampleMetric or AccumulatedMetric"),
        ({"metrics": [seqlen(), seqlen()]}, "names must be unique"),
        ({"metrics": [seqlen()], "num_workers": -1}, "num_workers >= 0"),
        ({"metrics": [seqlen()], "timeout": 0}, "timeout > 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        analyze(_docs(10), progress=False, **kwargs)


def test_an_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="empty dataset"):
        analyze([], [seqlen()], progress=False)


def test_vectorised_built_ins_equal_their_per_sample_definitions_bit_for_bit():
    docs = _docs(150)
    fast = vocab_rarity(VOCAB)
    (hist,) = fast.requires
    slow_hist = AccumulatedMetric(name=hist.name, fn=hist.fn, size=hist.size)
    slow = SampleMetric(
        name="vocab_rarity",
        fn=fast.fn,
        dtype="float64",
        requires=(slow_hist,),
        prepare=fast.prepare,
    )
    a = analyze(docs, [fast, seqlen()], progress=False, chunk_size=32)
    b = analyze(docs, [slow, SampleMetric(name="seqlen", fn=len)], progress=False, chunk_size=32)
    for name in ("vocab_rarity", "seqlen", "token_histogram"):
        x, y = a[name], b[name]
        x_arr = x.values if isinstance(x, MetricIndex) else x
        y_arr = y.values if isinstance(y, MetricIndex) else y
        assert x_arr.tobytes() == y_arr.tobytes(), name


def _stuck_on_three(doc: list[int]) -> int:
    if doc[0] == 3:
        time.sleep(60)
    return len(doc)


def test_a_stuck_worker_fails_the_run_within_the_timeout():
    begin = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=1.0s"):
        analyze(
            [[i] for i in range(8)],
            [SampleMetric(name="stuck", fn=_stuck_on_three)],
            num_workers=1,
            chunk_size=1,
            timeout=1.0,
            progress=False,
        )
    assert time.monotonic() - begin < 20  # not the 60 s the stuck worker would take


def _ignores_sigterm_on_three(doc: list[int]) -> int:
    if doc[0] == 3:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    return len(doc)


def _stops_itself_on_three(doc: list[int]) -> int:
    if doc[0] == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    return len(doc)


def _killed_on_three(doc: list[int]) -> int:
    if doc[0] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return len(doc)


@pytest.mark.parametrize(
    ("fn", "error", "match"),
    [
        (_ignores_sigterm_on_three, TimeoutError, "timeout=1.5s"),
        (_stops_itself_on_three, TimeoutError, "timeout=1.5s"),
        (_killed_on_three, WorkerError, "exited unexpectedly with exit code -9"),
    ],
)
def test_stuck_stopped_or_killed_worker_fails_within_timeout_plus_one_second(fn, error, match):
    begin = time.monotonic()
    with pytest.raises(error, match=match):
        analyze(
            [[i] for i in range(8)],
            [SampleMetric(name="m", fn=fn)],
            num_workers=2,
            chunk_size=1,
            timeout=1.5,
            progress=False,
        )
    assert time.monotonic() - begin < 1.5 + 1.0 + 0.5  # + the workers' start
    assert multiprocessing.active_children() == []


def test_workers_beyond_the_cores_are_not_started(monkeypatch):
    import meshfeed.curriculum.analyzer as analyzer_module

    started = []
    real = analyzer_module.PassService

    def spy(num_workers, **kwargs):
        started.append(num_workers)
        return real(num_workers, **kwargs)

    monkeypatch.setattr(analyzer_module, "PassService", spy)
    monkeypatch.setattr(analyzer_module, "available_cores", lambda: 2)
    docs = [[1] * (i % 5 + 1) for i in range(40)]
    wide = analyze(docs, [seqlen()], num_workers=8, chunk_size=4, progress=False)
    assert started == [2]
    ref = analyze(docs, [seqlen()], num_workers=0, chunk_size=4, progress=False)
    assert wide["seqlen"].values.tobytes() == ref["seqlen"].values.tobytes()


def test_the_progress_bar_counts_each_sample_once_per_named_pass(capsys):
    docs = _docs(50)
    analyze(docs, [vocab_rarity(VOCAB)], chunk_size=16)  # two passes: histogram, then rarity
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert [line.split(":")[0] for line in lines] == ["analyze pass 1/2", "analyze pass 2/2"]
    assert all(" 50/50 " in line for line in lines), lines
    analyze(docs, [seqlen()], chunk_size=16)  # one pass: no pass number
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert line.startswith("analyze: ") and " 50/50 " in line, line


@pytest.mark.parametrize(
    ("requested", "cores", "chunks", "started"),
    [
        (0, 2, 10, 0),  # -j 0: in this process
        (1, 2, 10, 1),
        (2, 2, 10, 2),
        (3, 2, 10, 2),  # beyond the cores: clamped, so never slower than -j cores
        (8, 2, 10, 2),
        (64, 16, 10, 10),  # never more workers than chunks
        (4, 1, 10, 1),
    ],
)
def test_worker_count_is_clamped_to_the_cores_and_the_chunks(requested, cores, chunks, started):
    from meshfeed.curriculum.analyzer import worker_count

    assert worker_count(requested, cores=cores, chunks=chunks) == started


def test_default_chunk_size_depends_on_the_length_only_and_stays_in_bounds():
    from meshfeed.curriculum.analyzer import default_chunk_size

    assert default_chunk_size(1) == 256
    assert default_chunk_size(40_000) == 625  # 64 chunks
    assert default_chunk_size(200_000) == 3125
    assert default_chunk_size(10_000_000) == 4096
    for n in (1, 255, 256, 16_383, 16_385, 40_000, 262_144, 10**9):
        size = default_chunk_size(n)
        assert 256 <= size <= 4096
        assert -(-n // size) <= 64 or size == 4096


def test_default_chunking_gives_identical_bytes_for_every_worker_count():
    docs = _docs(3000, seed=5)
    runs = [analyze(docs, METRICS, num_workers=j, progress=False) for j in (0, 1, 2, 5)]
    for run in runs[1:]:
        for name in ("mean", "seqlen", "vocab_rarity"):
            assert run[name].values.tobytes() == runs[0][name].values.tobytes()
            assert run[name].order.tobytes() == runs[0][name].order.tobytes()
        assert run["token_histogram"].tobytes() == runs[0]["token_histogram"].tobytes()


def _slow_in_worker_zero(doc: np.ndarray) -> int:
    # worker 0 stands for a worker that the machine's other load keeps from running
    if multiprocessing.current_process().name.endswith("-0"):
        time.sleep(0.05)
    return len(doc)


@pytest.mark.slow
def test_a_slow_worker_takes_fewer_chunks_and_the_output_keeps_chunk_order(monkeypatch):
    import meshfeed.curriculum.analyzer as analyzer_module
    import meshfeed.services.passes as passes_module

    taken: list[tuple[int, int]] = []
    real = passes_module.WorkerPool.send

    def spy(pool, w, task):
        if task[0] != "pass":
            taken.append((w, task[0]))
        return real(pool, w, task)

    monkeypatch.setattr(passes_module.WorkerPool, "send", spy)
    monkeypatch.setattr(analyzer_module, "available_cores", lambda: 2)
    docs = _docs(400, seed=2)
    metric = SampleMetric(name="slow", fn=_slow_in_worker_zero)
    out = analyze(docs, [metric], num_workers=2, chunk_size=10, progress=False)
    assert out["slow"].values.tolist() == [len(d) for d in docs]
    per_worker = [sum(1 for w, _ in taken if w == v) for v in (0, 1)]
    assert sum(per_worker) == 40
    # round-robin would give each 20; worker 0 sleeps 0.5 s a chunk, worker 1 does not
    assert per_worker[0] <= 10 < per_worker[1], per_worker


def _add_big(acc: np.ndarray, doc: np.ndarray) -> None:
    with np.errstate(over="ignore"):  # wraps past 2**63 within a few docs, on purpose
        acc[int(doc[0]) % 3] += np.int64(2**61 + len(doc))


def test_integer_accumulations_summed_per_worker_equal_the_in_process_bytes_even_when_they_wrap():
    docs = _docs(500, seed=7)
    big = AccumulatedMetric(name="big", fn=_add_big, size=3, dtype="int64")
    runs = [
        analyze(docs, [big, vocab_rarity(VOCAB)], num_workers=j, chunk_size=11, progress=False)
        for j in (0, 1, 3)
    ]
    want = np.zeros(3, np.int64)
    for d in docs:
        _add_big(want, d)
    for run in runs:
        assert run["big"].tobytes() == want.tobytes()
        assert run["token_histogram"].tobytes() == runs[0]["token_histogram"].tobytes()
        assert run["vocab_rarity"].values.tobytes() == runs[0]["vocab_rarity"].values.tobytes()


@pytest.mark.slow
def test_spawned_workers_run_both_passes_and_agree_with_the_in_process_bytes():
    # under spawn the metrics and the dataset are pickled to each worker (importable functions)
    docs = _docs(300, seed=3)
    ref = analyze(docs, METRICS, num_workers=0, chunk_size=32, progress=False)
    got = analyze(docs, METRICS, num_workers=2, chunk_size=32, progress=False, mp_context="spawn")
    for name in ("mean", "seqlen", "vocab_rarity"):
        assert got[name].values.tobytes() == ref[name].values.tobytes()
    assert got["token_histogram"].tobytes() == ref["token_histogram"].tobytes()
    assert multiprocessing.active_children() == []


def _closure_context(hist: np.ndarray):
    top = int(hist.argmax())
    return lambda doc: int((np.asarray(doc) == top).sum())  # not picklable: a local function


def test_a_context_that_cannot_be_pickled_reaches_fresh_workers_of_the_second_pass():
    from meshfeed.curriculum.metrics import token_histogram

    docs = _docs(200, seed=4)
    metric = SampleMetric(
        name="top_count",
        fn=lambda doc, count: count(doc),
        requires=(token_histogram(VOCAB),),
        prepare=_closure_context,
    )
    ref = analyze(docs, [metric], num_workers=0, chunk_size=16, progress=False)
    got = analyze(docs, [metric], num_workers=2, chunk_size=16, progress=False)
    assert got["top_count"].values.tobytes() == ref["top_count"].values.tobytes()
    top = int(ref["token_histogram"].argmax())
    assert ref["top_count"].values.tolist() == [int((d == top).sum()) for d in docs]
