"""The corpora manifest (#32): ``meshfeed corpora FOLDER`` records every corpus's fingerprint, and
a mixture built from it reads one file to start and opens only the corpora it reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import meshfeed
from meshfeed.cli import main
from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.manifest import MANIFEST_NAME, open_corpora, write_corpora_manifest
from meshfeed.sources.tokens.windows import TokenDocuments
from meshfeed.testing import assert_resume_equivalence
from tests.storage.conftest import S3, moto_endpoint, s3  # noqa: F401  (fixtures)


def _corpora(root: Path, n: int = 6) -> dict[str, list[list[int]]]:
    docs = {f"part{k % 2}/c{k}": [[k, j, j + 1] for j in range(k + 2)] for k in range(n)}
    for name, d in docs.items():
        write_indexed(root / name, d, "int32")
    return docs


def _loader(corpora: dict[str, TokenCorpus], weights: dict[str, int]) -> meshfeed.DataLoader:
    mix = meshfeed.Mixture({n: TokenDocuments(c) for n, c in corpora.items()}, weights, seed=3)
    return meshfeed.DataLoader(
        mix, batch_size=4, seed=1, collate_fn=lambda b: [x.tolist() for x in b]
    )


def test_a_mixture_from_the_manifest_reads_what_eager_corpora_read(tmp_path: Path) -> None:
    docs = _corpora(tmp_path)
    assert write_corpora_manifest(tmp_path) == tmp_path / MANIFEST_NAME
    lazy = open_corpora(tmp_path / MANIFEST_NAME)
    assert sorted(lazy) == sorted(docs)  # prefixes relative to the folder, subfolders too
    eager = {n: TokenCorpus.open(tmp_path / n) for n in lazy}  # the manifest's (sorted) order
    assert {n: c.fingerprint for n, c in lazy.items()} == {
        n: c.fingerprint for n, c in eager.items()
    }
    weights = {n: 1 + k for k, n in enumerate(lazy)}
    want = [b for _, b in zip(range(12), _loader(eager, weights), strict=False)]
    got = [b for _, b in zip(range(12), _loader(open_corpora(tmp_path), weights), strict=False)]
    assert got == want and len({tuple(x) for b in got for x in b}) > 10


def _collate(batch: list[np.ndarray]) -> list[list[int]]:
    return [x.tolist() for x in batch]  # module-level: worker processes pickle it


def test_worker_processes_read_a_mixture_from_the_manifest_as_one_process_does(
    tmp_path: Path,
) -> None:
    docs = _corpora(tmp_path)
    write_corpora_manifest(tmp_path)
    weights = {n: 1 for n in docs}
    batches = []
    for workers in (0, 2):
        mix = meshfeed.Mixture(
            {n: TokenDocuments(c) for n, c in open_corpora(tmp_path).items()}, weights, seed=3
        )
        loader = meshfeed.DataLoader(
            mix, batch_size=4, seed=1, num_workers=workers, collate_fn=_collate
        )
        with loader:
            batches.append(list(loader))
    assert batches[0] == batches[1] and len(batches[0]) == 6


def test_corpora_a_mixture_never_reads_are_never_opened(tmp_path: Path) -> None:
    docs = _corpora(tmp_path)
    write_corpora_manifest(tmp_path)
    for ext in (".idx", ".bin"):  # a corpus of weight 0 is never read: its files may go
        (tmp_path / f"part1/c3{ext}").unlink()
    weights = {n: 0 if n == "part1/c3" else 1 for n in docs}
    seen = [x for batch in _loader(open_corpora(tmp_path), weights) for x in batch]
    assert seen and all(x[0] != 3 for x in seen)


def test_resume_is_exact_for_a_mixture_from_the_manifest(tmp_path: Path) -> None:
    docs = _corpora(tmp_path)
    write_corpora_manifest(tmp_path)
    weights = {n: 1 for n in docs}
    ref = assert_resume_equivalence(lambda: _loader(open_corpora(tmp_path), weights), num_items=8)
    assert len(ref) == 8  # 27 documents, global batch 4: 6 steps an epoch, so it crosses one


def test_a_corpus_rewritten_after_the_manifest_is_refused_by_name_when_read(
    tmp_path: Path,
) -> None:
    docs = _corpora(tmp_path, n=2)
    write_corpora_manifest(tmp_path)
    write_indexed(tmp_path / "part1/c1", [[9, 9, 9]] * 3, "int32")  # same size, other tokens
    corpora = open_corpora(tmp_path)
    assert corpora["part0/c0"].document(0).tolist() == docs["part0/c0"][0]
    with pytest.raises(SourceError, match=r"part1/c1\.idx and .*c1\.bin are not the corpus"):
        corpora["part1/c1"].document(0)


def test_a_bad_manifest_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"corpora\.json does not exist; write it with"):
        open_corpora(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no PREFIX\.idx under"):
        write_corpora_manifest(tmp_path)
    _corpora(tmp_path, n=1)
    good = json.loads(write_corpora_manifest(tmp_path).read_text())
    bad = [
        ({**good, "kind": "x"}, "is not a meshfeed corpora manifest"),
        ({**good, "version": 9}, "has manifest version 9, this meshfeed reads 1"),
        ({**good, "names": ["../c0"]}, r"names a corpus outside its folder \(got '\.\./c0'\)"),
        ({**good, "names": ["a", "b"]}, "has 2 names .* for 1 fingerprints"),
        ({**good, "fingerprints": ["megatron:x"]}, "corpus 'part0/c0': fingerprint must be"),
    ]
    for manifest, message in bad:
        (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match=message):
            open_corpora(tmp_path)


def test_the_cli_writes_the_manifest_and_refuses_a_folder_without_corpora(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _corpora(tmp_path, n=3)
    assert main(["corpora", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / MANIFEST_NAME}: 3 corpora checked" in capsys.readouterr().out
    assert len(open_corpora(tmp_path)) == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["corpora", str(empty)]) == 2
    assert "no PREFIX.idx under" in capsys.readouterr().err
    assert np.array_equal(open_corpora(tmp_path)["part0/c0"].sizes, [3, 3])


def test_a_manifest_in_a_bucket_opens_only_the_corpora_a_batch_reads(
    tmp_path: Path,
    s3: S3,  # noqa: F811
) -> None:
    docs = _corpora(tmp_path / "local")
    write_corpora_manifest(tmp_path / "local")
    for path in sorted((tmp_path / "local").rglob("*")):
        if path.is_file():
            s3.put(f"mix/{path.relative_to(tmp_path / 'local').as_posix()}", path.read_bytes())
    remote = {"cache_dir": tmp_path / "cache", "storage_options": s3.options}
    corpora = open_corpora(s3.url("mix"), **remote)
    assert sorted(corpora) == sorted(docs) and not any(c.keeps_map for c in corpora.values())
    cached = {p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    assert not any(n.endswith((".idx", ".bin")) for n in cached)  # the manifest alone
    weights = {n: 1 + k for k, n in enumerate(corpora)}
    want = [
        b
        for _, b in zip(range(5), _loader(open_corpora(tmp_path / "local"), weights), strict=False)
    ]
    got = [b for _, b in zip(range(5), _loader(corpora, weights), strict=False)]
    assert got == want
    s3.put("mix/part1/c1.bin", bytes(len((tmp_path / "local/part1/c1.bin").read_bytes())))
    again = open_corpora(s3.url("mix"), cache_dir=tmp_path / "cache2", storage_options=s3.options)
    with pytest.raises(SourceError, match=r"c1\.idx and .*c1\.bin are not the corpus recorded"):
        again["part1/c1"].document(0)


def test_a_prefix_named_like_a_corpus_file_is_refused(tmp_path: Path) -> None:
    # Prefix "data.bin" (data.bin.idx / data.bin.bin) opened as the corpus "data": the
    # manifest gave it data's documents.
    write_indexed(tmp_path / "data", [np.array([1, 2, 3])], np.uint16)
    write_indexed(tmp_path / "other", [np.array([7, 8, 9, 10])], np.uint16)
    for suffix in (".bin", ".idx"):  # written by another tool, as Megatron's prefix "data.bin"
        (tmp_path / f"other{suffix}").rename(tmp_path / f"data.bin{suffix}")
    with pytest.raises(ValueError, match=r"\['data.bin'\] .* rename them \(e.g. 'data_bin'\)"):
        write_corpora_manifest(tmp_path)
    assert not (tmp_path / MANIFEST_NAME).exists()
