"""``analyze`` writing metric indexes to a URL and the curriculum reading them back, on moto's S3."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshfeed.curriculum import (
    MetricIndex,
    SampleMetric,
    analyze,
    from_deepspeed_config,
    load_accumulated,
    seqlen,
    vocab_rarity,
)
from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenWindows
from tests.storage.conftest import S3, use_env_endpoint

VOCAB = 64


def _corpus(s3: S3, tmp: Path, key: str = "corpora/c") -> tuple[Path, str]:
    rng = np.random.default_rng(4)
    docs = [rng.zipf(1.4, size=int(n)).clip(1, VOCAB - 1) for n in rng.integers(5, 60, 40)]
    local = tmp / "local" / "c"
    write_indexed(local, docs, "uint16")
    for ext in (".bin", ".idx"):
        s3.put(key + ext, Path(str(local) + ext).read_bytes())
    return local, s3.url(key)


def _ds_config(path: str) -> dict[str, Any]:
    metric = {
        "index_to_metric_path": path,
        "difficulty_type": "percentile",
        "clustering_type": "schedule_based",
        "min_difficulty": 10,
        "max_difficulty": 100,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 10},
    }
    on = {"enabled": True}
    sampling = {**on, "curriculum_learning": {**on, "curriculum_metrics": {"vocab_rarity": metric}}}
    return {"data_efficiency": {**on, "data_sampling": sampling}}


def _uploads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs analyze uploads, in order (the real upload still runs)."""
    import meshfeed.storage.output as output_module  # every writer's uploads go through it

    seen: list[str] = []
    real = output_module.upload_file

    def spy(local: Any, url: str, **kwargs: Any) -> None:
        seen.append(url)
        real(local, url, **kwargs)

    monkeypatch.setattr(output_module, "upload_file", spy)
    return seen


def test_analyze_to_a_url_gives_the_curriculum_the_order_of_a_local_analysis(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, corpus_url = _corpus(s3, tmp_path)
    remote = {"cache_dir": str(tmp_path / "cache"), "storage_options": s3.options}
    windows = TokenWindows(corpus_url, seq_len=8, **remote)  # the input is a URL too
    metrics = [seqlen(), vocab_rarity(VOCAB)]
    uploads = _uploads(monkeypatch)
    out = s3.url("runs/metrics")
    analyze(
        windows,
        metrics,
        output_dir=out,
        storage_options=s3.options,
        num_workers=2,
        chunk_size=16,
        progress=False,
    )
    local_windows = TokenWindows(local, seq_len=8)
    analyze(local_windows, metrics, output_dir=tmp_path / "metrics", progress=False)

    # one upload per file, every meta.json after every data file
    folders = ("seqlen", "token_histogram", "vocab_rarity")
    assert len(uploads) == len(set(uploads)) == 3 + 1 + 3 + 3
    metas = [i for i, u in enumerate(uploads) if u.endswith("/meta.json")]
    assert metas == [7, 8, 9] and {u.rsplit("/", 2)[1] for u in uploads} == set(folders)
    keys = {o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]}
    for f in folders:
        for p in (tmp_path / "metrics" / f).iterdir():
            body = s3.client.get_object(Bucket=s3.bucket, Key=f"runs/metrics/{f}/{p.name}")
            assert body["Body"].read() == p.read_bytes(), (f, p.name)  # meta.json too
            keys.discard(f"runs/metrics/{f}/{p.name}")
    assert keys == {"corpora/c.bin", "corpora/c.idx"}  # nothing else was written

    cache = {"cache_dir": tmp_path / "cache2", "storage_options": s3.options}
    index = MetricIndex.load(f"{out}/vocab_rarity", dataset=local_windows, **cache)
    there = MetricIndex.load(tmp_path / "metrics" / "vocab_rarity")
    assert index.values.tobytes() == there.values.tobytes()
    assert index.order.tobytes() == there.order.tobytes()
    clone = pickle.loads(pickle.dumps(index))  # the values travel, the cache's holds do not
    assert clone.values.tobytes() == there.values.tobytes() and clone._cache is None
    histogram = load_accumulated(f"{out}/token_histogram", dataset=local_windows, **cache)
    assert (
        histogram.tobytes() == load_accumulated(tmp_path / "metrics" / "token_histogram").tobytes()
    )

    n = len(local_windows)
    from_url = from_deepspeed_config(_ds_config(f"{out}/vocab_rarity"), **cache)
    from_dir = from_deepspeed_config(_ds_config(str(tmp_path / "metrics" / "vocab_rarity")))
    a = from_url.make_order(dataset_length=n, global_batch_size=4, seed=5)
    b = from_dir.make_order(dataset_length=n, global_batch_size=4, seed=5)
    assert a.pool_order.tolist() == b.pool_order.tolist()
    for step in range(12):
        positions = np.arange(step * 4, step * 4 + 4)
        assert a.indices(0, positions).tolist() == b.indices(0, positions).tolist(), step
    gets = dict(s3.proxy.object_gets)
    assert all(gets[f"/{s3.bucket}/runs/metrics/vocab_rarity/{name}"] == 1 for name in
               ("meta.json", "values.npy", "order.npy", "percentiles.npy"))  # fmt: skip


def test_a_metric_being_overwritten_is_refused_by_name_not_read_mixed(
    s3: S3, tmp_path: Path
) -> None:
    docs = [np.arange(n) % VOCAB for n in range(1, 30)]
    for name, scale in (("old", 1), ("new", 3)):
        metric = SampleMetric(name="m", fn=lambda d, s=scale: len(d) * s)
        analyze(docs, [metric], output_dir=tmp_path / name, progress=False)
    url = s3.url("metrics/m")
    for p in (tmp_path / "old" / "m").iterdir():
        s3.put(f"metrics/m/{p.name}", p.read_bytes())
    s3.put("metrics/m/values.npy", (tmp_path / "new" / "m" / "values.npy").read_bytes())
    with pytest.raises(ValueError, match=rf"{url}/values.npy is not the file {url}/meta.json"):
        MetricIndex.load(url, cache_dir=tmp_path / "cache", storage_options=s3.options)


def test_a_bad_output_url_fails_before_the_analysis_naming_the_url(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    metric = SampleMetric(name="m", fn=lambda d: calls.append(1) or len(d))
    docs = [[1, 2], [3]]
    with pytest.raises(
        ValueError, match=r"cannot write the analysis to nope://bucket/m: .*Protocol not known"
    ):
        analyze(docs, [metric], output_dir="nope://bucket/m", progress=False)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_keys = {k: v for k, v in s3.options.items() if k not in ("key", "secret")}
    url = s3.url("metrics")
    with pytest.raises(SourceError, match=rf"cannot write the analysis to {url}: NoCredentials"):
        analyze(docs, [metric], output_dir=url, storage_options=no_keys, progress=False)
    assert calls == []  # refused before any sample was read
    missing = "s3://no-such-bucket-here/metrics"
    with pytest.raises(FileNotFoundError, match=rf"{missing}: the bucket 'no-such-bucket-here'"):
        analyze(docs, [metric], output_dir=missing, storage_options=s3.options, progress=False)
    assert calls == []

    def drop_the_bucket(doc: list[int]) -> int:  # gone between the check and the upload
        if not calls:
            s3.client.delete_bucket(Bucket=s3.bucket)
        calls.append(1)
        return len(doc)

    late = SampleMetric(name="m", fn=drop_the_bucket)
    with pytest.raises(SourceError, match=rf"cannot upload {url}/m/order.npy: FileNotFound"):
        analyze(docs, [late], output_dir=url, storage_options=s3.options, progress=False)
    assert calls == [1, 1]


def test_reading_a_missing_or_unreachable_index_names_the_url(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3.url("nothing/here")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=rf"{url} is not a meshfeed metric index"):
        MetricIndex.load(url, cache_dir=cache, storage_options=s3.options)
    analyze([[1], [2, 3]], [seqlen()], output_dir=s3.url("m"), storage_options=s3.options)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    no_keys = {k: v for k, v in s3.options.items() if k not in ("key", "secret")}
    seqlen_url = s3.url("m/seqlen")
    with pytest.raises(SourceError, match=rf"cannot read the metric index {seqlen_url}: NoCred"):
        MetricIndex.load(seqlen_url, cache_dir=cache, storage_options=no_keys)
    index = MetricIndex.load(seqlen_url, cache_dir=cache, storage_options=s3.options)
    assert index.values.tolist() == [1, 2]


def test_a_file_url_output_is_written_in_place(tmp_path: Path) -> None:
    analyze([[1, 2, 3], [4]], [seqlen()], output_dir=f"file://{tmp_path}/m", progress=False)
    assert MetricIndex.load(tmp_path / "m" / "seqlen").values.tolist() == [3, 1]
    assert MetricIndex.load(f"file://{tmp_path}/m/seqlen").order.tolist() == [1, 0]


def test_the_analyze_command_reads_and_writes_urls(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshfeed.cli import main

    local, corpus_url = _corpus(s3, tmp_path, key="cli/corpus")
    use_env_endpoint(s3, monkeypatch)
    out = s3.url("cli/metrics")
    argv = ["analyze", corpus_url, "--windows", "8", "-o", out, "-m", "vocab_rarity", "-q"]
    argv += ["--vocab-size", str(VOCAB)]
    assert main([*argv, "-j", "0", "--cache-dir", str(tmp_path / "cache")]) == 0
    windows = TokenWindows(local, seq_len=8)
    want = analyze(windows, [vocab_rarity(VOCAB)], progress=False)["vocab_rarity"]
    got = MetricIndex.load(
        f"{out}/vocab_rarity", dataset=windows, cache_dir=tmp_path / "c2", storage_options=None
    )
    assert isinstance(want, MetricIndex)
    assert got.values.tobytes() == want.values.tobytes()
    bad = ["analyze", corpus_url, "-o", "nope://x/m", "-q", "--cache-dir", str(tmp_path / "cache")]
    assert main(bad) == 2
