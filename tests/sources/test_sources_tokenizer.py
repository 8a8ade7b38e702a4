"""meshfeed convert with real tokenizers: a trained HF BPE, folders, worker processes, eod."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshfeed import LazyDataset
from meshfeed.sources.converters.convert import convert
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.tokenizer import load_tokenizer, token_ids

tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers (the test extra)")

ROOT = Path(__file__).resolve().parents[2]
EOD = "<|endoftext|>"


def stdlib_texts(limit: int = 200) -> list[str]:
    """Python's standard library source: real text nobody here wrote."""
    files = sorted(Path(json.__file__).parent.parent.glob("*.py"))[:limit]
    return [f.read_text(encoding="utf-8", errors="replace")[:4000] for f in files]


def train_bpe(texts: list[str], path: Path, *, vocab_size: int = 800, eod: str | None = EOD):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = [eod] if eod else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, list[str]]:
    folder = tmp_path_factory.mktemp("bpe")
    texts = stdlib_texts()
    tok = train_bpe(texts, folder / "tokenizer.json")
    return folder / "tokenizer.json", tok, texts


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.mark.parametrize("transformers", ["hidden", "installed"])
def test_tokenizer_json_and_folder_encode_as_the_tokenizer_does(
    tmp_path: Path, bpe, transformers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder loads through transformers.AutoTokenizer where it is installed, else its
    # tokenizer.json is read: either way the same ids and the same end-of-document id (a folder
    # with no tokenizer_config.json gives transformers no eos_token_id: found in the vocabulary).
    if transformers == "hidden":
        monkeypatch.setitem(sys.modules, "transformers", None)  # as where it is not installed
    else:
        pytest.importorskip("transformers", reason="the folder path through transformers")
    path, tok, texts = bpe
    src = write_jsonl(tmp_path / "d.jsonl", texts[:20])
    corpus = convert(src, tmp_path / "c", tokenizer=str(path), append_eod=True, progress=False)
    eod = tok.token_to_id(EOD)
    assert eod is not None
    for i, text in enumerate(texts[:20]):
        assert corpus.document(i).tolist() == [*tok.encode(text).ids, eod]
    # the folder a tokenizer was saved in
    folder = convert(
        src, tmp_path / "f", tokenizer=str(path.parent), append_eod=True, progress=False
    )
    assert np.array_equal(folder.tokens, corpus.tokens)
    assert load_tokenizer(path.parent).eod_id == eod


def test_output_is_byte_identical_for_every_worker_count(
    tmp_path: Path, bpe, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _, texts = bpe
    # many small chunks, so workers finish out of order
    monkeypatch.setattr(sys.modules["meshfeed.sources.converters.inputs"], "CHUNK_RECORDS", 7)
    src = write_jsonl(tmp_path / "d.jsonl", texts[:60])
    kw = {"tokenizer": str(path), "append_eod": True, "progress": False}
    convert(src, tmp_path / "j1", num_workers=1, **kw)
    for n in (2, 3):
        convert(src, tmp_path / f"j{n}", num_workers=n, **kw)
        assert filecmp.cmp(tmp_path / "j1.bin", tmp_path / f"j{n}.bin", shallow=False)
        assert filecmp.cmp(tmp_path / "j1.idx", tmp_path / f"j{n}.idx", shallow=False)


def test_an_error_in_a_worker_names_the_line_and_leaves_no_output(tmp_path: Path, bpe) -> None:
    path, _, texts = bpe
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": texts[0]}) + "\n{broken\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"d\.jsonl:2 is not valid JSON"):
        convert(src, tmp_path / "c", tokenizer=str(path), num_workers=2, progress=False)
    assert not list(tmp_path.glob("c.*"))


def test_append_eod_without_an_eod_token_asks_for_eod_id(tmp_path: Path) -> None:
    texts = stdlib_texts(20)
    train_bpe(texts, tmp_path / "noeod.json", eod=None)
    src = write_jsonl(tmp_path / "d.jsonl", texts[:2])
    with pytest.raises(ValueError, match="pass --eod-id N"):
        convert(src, tmp_path / "c", tokenizer=str(tmp_path / "noeod.json"), append_eod=True)
    corpus = convert(
        src, tmp_path / "c", tokenizer="bytes", eod_id=7, append_eod=True, progress=False
    )
    assert corpus.document(0)[-1] == 7 and corpus.document(1)[-1] == 7


@pytest.mark.slow
def test_cli_with_workers_and_append_eod(tmp_path: Path, bpe) -> None:
    path, tok, texts = bpe
    src = write_jsonl(tmp_path / "d.jsonl", texts[:10])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshfeed.cli",
            "convert",
            str(src),
            "-o",
            str(tmp_path / "c"),
            "--tokenizer",
            str(path),
            "--append-eod",
            "-j",
            "2",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    corpus = TokenCorpus.open(tmp_path / "c")
    assert corpus.num_documents == 10
    assert corpus.document(3).tolist() == [*tok.encode(texts[3]).ids, tok.token_to_id(EOD)]


def test_lazy_dataset_encodes_with_an_hf_tokenizer(bpe) -> None:
    _, tok, texts = bpe
    ds = LazyDataset(texts[:3]).encode(tok)
    assert ds[1].tolist() == tok.encode(texts[1]).ids

    class Encoding:
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

    class Wrapped:
        def encode(self, text: str) -> Encoding:
            return Encoding([len(text), 1])

    assert LazyDataset(["abc"]).encode(Wrapped())[0].tolist() == [3, 1]
    assert token_ids({"input_ids": [4, 5]}).tolist() == [4, 5]


def test_a_class_that_needs_arguments_is_explained() -> None:
    with pytest.raises(ValueError, match=r"'tokenizers:Tokenizer' names a class .*tokenizer\.json"):
        load_tokenizer("tokenizers:Tokenizer")


def test_workers_leave_the_callers_tokenizers_parallelism_alone(
    tmp_path: Path, bpe, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    path, _, texts = bpe
    src = write_jsonl(tmp_path / "d.jsonl", texts[:4])
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    convert(src, tmp_path / "c", tokenizer=str(path), num_workers=2, progress=False)
    assert "TOKENIZERS_PARALLELISM" not in os.environ
