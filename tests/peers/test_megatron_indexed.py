"""Megatron's own IndexedDataset/IndexedDatasetBuilder and meshfeed's indexed corpora, both ways.

Runs megatron-core's code (``pip install -e .[peers]``); skipped with the reason otherwise.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import numpy as np
import pytest
import torch

indexed_dataset = pytest.importorskip(
    "megatron.core.datasets.indexed_dataset",
    reason="megatron-core is not installed; pip install -e .[peers] runs Megatron's own code",
)

from meshfeed.sources import TokenCorpus, write_indexed  # noqa: E402

DTYPES = [np.uint8, np.uint16, np.int32, np.int64]


def _documents(seed: int, dtype: type) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    high = min(int(np.iinfo(dtype).max), 60_000)
    lengths = rng.integers(0, 300, size=int(rng.integers(1, 60)))
    lengths[rng.random(lengths.size) < 0.1] = 0  # empty documents are legal in both
    return [rng.integers(0, high, size=n).astype(dtype) for n in lengths]


def _megatron_write(prefix: Path, docs: list[np.ndarray], dtype: type) -> None:
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_megatron_reads_what_meshfeed_writes(tmp_path, dtype, seed):
    docs = _documents(seed, dtype)
    write_indexed(tmp_path / "mf", docs, dtype)
    ds = indexed_dataset.IndexedDataset(str(tmp_path / "mf"))
    assert len(ds) == len(docs)
    assert ds.sequence_lengths.tolist() == [d.size for d in docs]
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        got = ds[i]
        assert got.dtype == np.dtype(dtype) and np.array_equal(got, d), i


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_meshfeed_reads_what_megatron_writes(tmp_path, dtype, seed):
    docs = _documents(seed, dtype)
    _megatron_write(tmp_path / "mg", docs, dtype)
    corpus = TokenCorpus.open(tmp_path / "mg")
    corpus.validate()
    assert corpus.num_documents == len(docs) and corpus.dtype == np.dtype(dtype)
    assert corpus.num_tokens == sum(d.size for d in docs)
    for i, d in enumerate(docs):
        assert np.array_equal(corpus.document(i), d), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_writers_produce_the_same_bytes(tmp_path, dtype):
    docs = _documents(7, dtype)
    write_indexed(tmp_path / "mf", docs, dtype)
    _megatron_write(tmp_path / "mg", docs, dtype)
    assert filecmp.cmp(tmp_path / "mf.bin", tmp_path / "mg.bin", shallow=False)
    assert filecmp.cmp(tmp_path / "mf.idx", tmp_path / "mg.idx", shallow=False)


def test_convert_writes_what_megatron_preprocess_data_writes(tmp_path):
    """``meshfeed convert --tokenizer tokenizer.json --append-eod -j 2`` against the bytes of
    Megatron's builder fed as ``tools/preprocess_data.py`` feeds it (one sentence per document,
    eod appended to the document and counted in its last sentence)."""
    import json

    pytest.importorskip("tokenizers", reason="pip install tokenizers (the test extra)")
    from meshfeed.sources.converters.convert import convert
    from tests.sources.test_sources_tokenizer import EOD, stdlib_texts, train_bpe

    texts = stdlib_texts(80)
    tok = train_bpe(texts, tmp_path / "tokenizer.json")
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    convert(
        src,
        tmp_path / "mf",
        tokenizer=str(tmp_path / "tokenizer.json"),
        append_eod=True,
        num_workers=2,
        progress=False,
    )
    eod = tok.token_to_id(EOD)
    builder = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "mg.bin"), dtype=np.uint16)
    for text in texts:
        doc_ids = list(tok.encode(text).ids)
        sentence_lens = [len(doc_ids)]
        doc_ids.append(eod)
        sentence_lens[-1] += 1
        builder.add_document(doc_ids, sentence_lens)
    builder.finalize(str(tmp_path / "mg.idx"))
    assert filecmp.cmp(tmp_path / "mf.bin", tmp_path / "mg.bin", shallow=False)
    assert filecmp.cmp(tmp_path / "mf.idx", tmp_path / "mg.idx", shallow=False)
