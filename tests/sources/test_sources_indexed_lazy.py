"""Corpora opened on first use (#32): a corpus given its fingerprint reads nothing until a read
needs its files, then is checked as any other and against that fingerprint."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows

DOCS = [list(range(k, k + 7 + k % 5)) for k in range(0, 300, 10)]


@pytest.fixture
def eager(tmp_path: Path) -> TokenCorpus:
    return write_indexed(tmp_path / "c", DOCS, "int32")


def test_a_corpus_given_its_fingerprint_reads_no_file_until_a_document_is_read(
    tmp_path: Path, eager: TokenCorpus
) -> None:
    fingerprint = eager.fingerprint
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for ext in (".idx", ".bin"):
        (tmp_path / f"c{ext}").rename(moved / f"c{ext}")
    lazy = TokenCorpus.open(tmp_path / "c", fingerprint=fingerprint)  # no files there
    assert (len(lazy), lazy.num_tokens, lazy.dtype) == (len(DOCS), eager.num_tokens, eager.dtype)
    assert lazy.fingerprint == fingerprint and not lazy.keeps_map
    assert len(TokenDocuments(lazy)) == len(DOCS)  # a view opens nothing either
    assert len(TokenWindows(lazy, seq_len=4)) == (eager.num_tokens - 1) // 4
    assert not lazy.opened
    with pytest.raises(FileNotFoundError, match=r"c\.idx does not exist"):
        lazy.document(0)
    for ext in (".idx", ".bin"):
        (moved / f"c{ext}").rename(tmp_path / f"c{ext}")
    assert [lazy.document(i).tolist() for i in range(len(DOCS))] == DOCS  # opened now
    assert lazy.opened


def test_a_corpus_rewritten_after_its_fingerprint_is_refused_by_name_at_every_read(
    tmp_path: Path, eager: TokenCorpus
) -> None:
    fingerprint = eager.fingerprint
    write_indexed(tmp_path / "c", [[d + 1 for d in doc] for doc in DOCS], "int32")  # same sizes
    lazy = TokenDocuments(TokenCorpus(tmp_path / "c", fingerprint=fingerprint))
    for _ in range(2):
        with pytest.raises(SourceError, match=r"c\.idx and .*c\.bin are not the corpus recorded"):
            lazy.fetch_batch(np.array([0]))
    write_indexed(tmp_path / "c", DOCS, "int32")  # the recorded corpus again
    assert lazy.fetch_batch(np.array([1]))["tokens"].tolist() == DOCS[1]


def test_a_malformed_fingerprint_is_refused_by_name(tmp_path: Path, eager: TokenCorpus) -> None:
    for bad in ("megatron:int32:3", "shards:x:1:2:3:4", eager.fingerprint.replace("int32", "S3")):
        with pytest.raises(ValueError, match=r"must be a TokenCorpus fingerprint.*got fingerp"):
            TokenCorpus(tmp_path / "c", fingerprint=bad)


def test_windows_and_documents_read_the_same_through_a_deferred_corpus(
    tmp_path: Path, eager: TokenCorpus
) -> None:
    idx = np.array([0, 5, 2, 5])
    lazy = TokenCorpus(tmp_path / "c", fingerprint=eager.fingerprint)
    got = TokenWindows(lazy, seq_len=8).fetch_batch(idx)
    assert got.equal(TokenWindows(eager, seq_len=8).fetch_batch(idx))
    lazy = TokenCorpus(tmp_path / "c", fingerprint=eager.fingerprint)
    docs = TokenDocuments(lazy).fetch_batch(idx)
    assert docs["tokens"].tolist() == [t for i in idx.tolist() for t in DOCS[i]]


def test_a_deferred_corpus_pickles_unopened_and_opens_in_the_receiver(
    tmp_path: Path, eager: TokenCorpus
) -> None:
    lazy = TokenCorpus(tmp_path / "c", fingerprint=eager.fingerprint)
    copy = pickle.loads(pickle.dumps(lazy))
    assert "_pending" in copy.__dict__  # still deferred: nothing read to pickle it
    assert copy.document(3).tolist() == DOCS[3]
    again = pickle.loads(pickle.dumps(copy))  # an opened one pickles as any corpus
    assert again.document(4).tolist() == DOCS[4] and again.fingerprint == eager.fingerprint


def test_threads_reading_a_deferred_corpus_at_once_open_it_once_and_read_right(
    tmp_path: Path, eager: TokenCorpus
) -> None:
    lazy = TokenDocuments(TokenCorpus(tmp_path / "c", fingerprint=eager.fingerprint))
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def read(i: int) -> None:
        try:
            start.wait(timeout=30)
            got[i] = lazy.fetch_batch(np.array([i]))["tokens"].tolist()
        except BaseException as e:  # reported below, with the thread's index
            errors.append(e)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and got == {i: DOCS[i] for i in range(8)}


def test_a_thread_waiting_on_another_threads_opening_gives_up_with_a_message(
    tmp_path: Path, eager: TokenCorpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshfeed.sources.tokens import indexed_lazy

    monkeypatch.setattr(indexed_lazy, "OPEN_WAIT_S", 0.2)
    lazy = TokenCorpus(tmp_path / "c", fingerprint=eager.fingerprint)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # another thread in the middle of an opening
        with indexed_lazy._opening:
            held.set()
            release.wait(timeout=30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(timeout=30)
        with pytest.raises(TimeoutError, match=r"waited 0 s for another thread to open"):
            lazy.document(0)
    finally:
        release.set()
        holder.join(timeout=30)
    assert lazy.document(0).tolist() == DOCS[0]  # and opens once the other is done


def test_a_thread_never_sees_a_half_opened_corpus(
    tmp_path: Path, eager: TokenCorpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one thread opens a deferred corpus (here held inside the opening), another that
    reads a field the opening sets waits for it and reads its final value, never the reset
    one (it read ``None`` and failed an internal check, now and then, in a full run)."""
    from meshfeed.sources.tokens import indexed

    inside, go = threading.Event(), threading.Event()
    real = indexed.file_identity

    def slow_identity(path):  # called while the opening is under way
        inside.set()
        go.wait(timeout=30)
        return real(path)

    monkeypatch.setattr(indexed, "file_identity", slow_identity)
    lazy = TokenCorpus(tmp_path / "c", fingerprint=eager.fingerprint)
    opener = threading.Thread(target=lambda: lazy.document(0))
    opener.start()
    assert inside.wait(timeout=30)
    seen: list[object] = []
    reader = threading.Thread(target=lambda: seen.append(lazy._bin_identity))
    reader.start()
    reader.join(timeout=0.5)
    go.set()
    opener.join(timeout=30)
    reader.join(timeout=30)
    assert seen == [eager._bin_identity] and seen[0] is not None
