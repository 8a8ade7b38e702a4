"""TokenCorpus / write_indexed: the Megatron .bin/.idx format, read and written exactly."""

from __future__ import annotations

import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from meshfeed.sources.tokens.indexed import HEADER_SIZE, IndexedFormatError, TokenCorpus
from meshfeed.sources.tokens.indexed_write import IndexedWriter, write_indexed
from tests.optional import given, settings, st


def megatron_files(
    prefix: Path,
    sequences: list[list[int]],
    *,
    dtype: str = "uint16",
    code: int = 8,
    document_indices: list[int] | None = None,
    modes: bool = False,
) -> None:
    """Write a corpus by hand with struct, independently of meshfeed's writer."""
    arrays = [np.asarray(s, dtype=dtype) for s in sequences]
    item = np.dtype(dtype).itemsize
    sizes = [a.size for a in arrays]
    pointers = list(np.cumsum([0, *sizes[:-1]]) * item) if sizes else []
    docs = document_indices if document_indices is not None else list(range(len(sizes) + 1))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(docs)))
        f.write(np.asarray(sizes, "<i4").tobytes())
        f.write(np.asarray(pointers, "<i8").tobytes())
        f.write(np.asarray(docs, "<i8").tobytes())
        if modes:
            f.write(np.zeros(len(sizes), "<i1").tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        for a in arrays:
            f.write(a.tobytes())


def test_reads_a_hand_written_megatron_corpus(tmp_path: Path) -> None:
    seqs = [[1, 2, 3], [], [7, 8], [65535]]
    megatron_files(tmp_path / "c", seqs)
    corpus = TokenCorpus.open(tmp_path / "c")
    assert corpus.num_documents == 4
    assert corpus.num_tokens == 6
    assert corpus.dtype == np.uint16
    assert corpus.sizes.tolist() == [3, 0, 2, 1]
    assert [corpus.document(i).tolist() for i in range(4)] == seqs
    assert corpus.document(-1).tolist() == [65535]
    assert corpus.is_contiguous


@pytest.mark.parametrize(
    ("dtype", "code"),
    [
        ("uint8", 1),
        ("int8", 2),
        ("int16", 3),
        ("int32", 4),
        ("int64", 5),
        ("float64", 6),
        ("float32", 7),
        ("uint16", 8),
    ],
)
def test_every_megatron_dtype_code_round_trips(tmp_path: Path, dtype: str, code: int) -> None:
    megatron_files(tmp_path / "c", [[1, 2], [3]], dtype=dtype, code=code)
    corpus = TokenCorpus.open(tmp_path / "c")
    assert corpus.dtype == np.dtype(dtype)
    assert corpus.document(0).tolist() == [1, 2]
    written = write_indexed(tmp_path / "w", [[1, 2], [3]], dtype)
    assert (tmp_path / "w.idx").read_bytes() == (tmp_path / "c.idx").read_bytes()
    assert (tmp_path / "w.bin").read_bytes() == (tmp_path / "c.bin").read_bytes()
    assert written.fingerprint == corpus.fingerprint


def test_document_means_sequence_and_megatron_document_index_is_exposed(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1], [2, 3], [4]], document_indices=[0, 2, 3])
    corpus = TokenCorpus.open(tmp_path / "c")
    assert corpus.num_documents == 3
    assert corpus.document_index.tolist() == [0, 2, 3]


def test_multimodal_index_with_modes_is_accepted(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1], [2, 3]], modes=True)
    assert TokenCorpus.open(tmp_path / "c").document(1).tolist() == [2, 3]


def test_documents_are_zero_copy_read_only_views(tmp_path: Path) -> None:
    corpus = write_indexed(tmp_path / "c", [[5, 6, 7]], "int32")
    doc = corpus.document(0)
    assert not doc.flags.writeable
    assert np.shares_memory(doc, corpus.tokens)


@settings(max_examples=40, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 65535), max_size=20), max_size=15),
    dtype=st.sampled_from(["uint16", "int32", "int64"]),
)
def test_write_then_open_returns_the_same_documents(
    tmp_path_factory: pytest.TempPathFactory, docs: list[list[int]], dtype: str
) -> None:
    prefix = tmp_path_factory.mktemp("w") / "c"
    corpus = write_indexed(prefix, docs, dtype)
    reopened = TokenCorpus.open(prefix)
    assert reopened.num_documents == len(docs)
    assert reopened.num_tokens == sum(map(len, docs))
    assert [reopened.document(i).tolist() for i in range(len(docs))] == docs
    assert reopened.is_contiguous
    reopened.validate()
    assert corpus.fingerprint == reopened.fingerprint


def test_prefix_may_name_either_file(tmp_path: Path) -> None:
    write_indexed(tmp_path / "c", [[1, 2]])
    for name in ("c", "c.bin", "c.idx"):
        assert TokenCorpus.open(tmp_path / name).document(0).tolist() == [1, 2]


def test_pickles_as_its_prefix_not_its_data(tmp_path: Path) -> None:
    corpus = write_indexed(tmp_path / "c", [np.arange(100_000) % 60_000])
    blob = pickle.dumps(corpus)
    assert len(blob) < 1_000
    again = pickle.loads(blob)
    assert np.array_equal(again.document(0), corpus.document(0))


def test_fingerprint_survives_a_move_and_changes_with_content(tmp_path: Path) -> None:
    a = write_indexed(tmp_path / "a", [[1, 2, 3], [4]])
    (tmp_path / "moved").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(tmp_path / f"a{ext}", tmp_path / "moved" / f"a{ext}")
    assert TokenCorpus.open(tmp_path / "moved" / "a").fingerprint == a.fingerprint
    assert write_indexed(tmp_path / "b", [[1, 2, 9], [4]]).fingerprint != a.fingerprint
    assert write_indexed(tmp_path / "c", [[1, 2], [3, 4]]).fingerprint != a.fingerprint


def test_empty_corpus_opens(tmp_path: Path) -> None:
    corpus = write_indexed(tmp_path / "c", [])
    assert corpus.num_documents == 0 and corpus.num_tokens == 0
    with pytest.raises(IndexError, match="out of range"):
        corpus.document(0)


def test_writer_rejects_ids_that_do_not_fit_the_dtype(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"token ids in \[0, 70000\].*uint16.*wider dtype"):
        write_indexed(tmp_path / "c", [[1], [0, 70000]], "uint16")
    assert not list(tmp_path.iterdir()), "a failed write leaves no files behind"


def test_writer_rejects_non_integer_and_nested_documents(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="must be integers"):
        write_indexed(tmp_path / "c", [[1.5]], "uint16")
    with pytest.raises(ValueError, match="1-D sequence"):
        write_indexed(tmp_path / "c", [[[1, 2]]], "uint16")
    with pytest.raises(ValueError, match="no Megatron code"):
        IndexedWriter(tmp_path / "c", dtype="uint32")


def test_writer_publishes_files_only_on_close(tmp_path: Path) -> None:
    writer = IndexedWriter(tmp_path / "c", dtype="uint16")
    writer.add([1, 2])
    assert not (tmp_path / "c.bin").exists() and not (tmp_path / "c.idx").exists()
    corpus = writer.close()
    assert corpus.document(0).tolist() == [1, 2]


def test_missing_file_is_named(tmp_path: Path) -> None:
    write_indexed(tmp_path / "c", [[1]])
    (tmp_path / "c.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"c\.bin does not exist"):
        TokenCorpus.open(tmp_path / "c")


def _corrupt(tmp_path: Path, offset: int, data: bytes) -> Path:
    write_indexed(tmp_path / "c", [[1, 2, 3], [4, 5]])
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[offset : offset + len(data)] = data
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    return tmp_path / "c"


def test_bad_magic_is_reported_with_the_file(tmp_path: Path) -> None:
    prefix = _corrupt(tmp_path, 0, b"NOTANIDX!")
    with pytest.raises(IndexedFormatError, match=r"c\.idx has bad magic"):
        TokenCorpus.open(prefix)


def test_wrong_version_is_reported(tmp_path: Path) -> None:
    prefix = _corrupt(tmp_path, 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedFormatError, match=r"c\.idx has index version 2 \(expected 1\)"):
        TokenCorpus.open(prefix)


def test_unknown_dtype_code_is_reported(tmp_path: Path) -> None:
    prefix = _corrupt(tmp_path, 17, struct.pack("<B", 42))
    with pytest.raises(IndexedFormatError, match="unknown dtype code 42"):
        TokenCorpus.open(prefix)


def test_truncated_index_is_reported(tmp_path: Path) -> None:
    write_indexed(tmp_path / "c", [[1, 2, 3], [4, 5]])
    raw = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(raw[:-3])
    with pytest.raises(IndexedFormatError, match=r"c\.idx is \d+ bytes but its header"):
        TokenCorpus.open(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(raw[: HEADER_SIZE - 1])
    with pytest.raises(IndexedFormatError, match="shorter than the 34-byte header"):
        TokenCorpus.open(tmp_path / "c")


def test_sequence_count_that_disagrees_with_the_file_length_is_reported(tmp_path: Path) -> None:
    prefix = _corrupt(tmp_path, 18, struct.pack("<Q", 3))
    with pytest.raises(IndexedFormatError, match="3 sequences"):
        TokenCorpus.open(prefix)


def test_truncated_bin_is_reported(tmp_path: Path) -> None:
    write_indexed(tmp_path / "c", [[1, 2, 3], [4, 5]])
    raw = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(raw[:-2])
    with pytest.raises(IndexedFormatError, match=r"c\.bin is 8 bytes but .* up to byte 10"):
        TokenCorpus.open(tmp_path / "c")
    (tmp_path / "c.bin").write_bytes(raw[:-1])
    with pytest.raises(IndexedFormatError, match="not a multiple of the uint16 item size"):
        TokenCorpus.open(tmp_path / "c")


def test_document_index_that_does_not_cover_the_sequences_is_reported(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1], [2]], document_indices=[0, 1])
    with pytest.raises(IndexedFormatError, match="document index from 0 to 1"):
        TokenCorpus.open(tmp_path / "c")


def test_non_contiguous_corpus_is_refused_on_open(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1, 2], [3, 4]])
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    # point both sequences at the first one: document 1 would read document 0's tokens
    raw[HEADER_SIZE + 8 + 8 : HEADER_SIZE + 8 + 16] = struct.pack("<q", 0)
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(
        IndexedFormatError,
        match=r"c\.idx points document 1 at byte 0, but the documents before it end at byte 4",
    ):
        TokenCorpus.open(tmp_path / "c")


def test_validate_catches_pointers_outside_the_bin(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1, 2], [3, 4]])
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[HEADER_SIZE + 8 : HEADER_SIZE + 16] = struct.pack("<q", 1000)
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedFormatError, match="pointers outside"):
        TokenCorpus.open(tmp_path / "c").validate()
    # now refused on open already, naming the document
    with pytest.raises(IndexedFormatError, match="document 0 starts at byte 1000"):
        TokenCorpus.open(tmp_path / "c")


def test_unpickling_refuses_a_corpus_rewritten_in_between(tmp_path: Path) -> None:
    corpus = write_indexed(tmp_path / "c", [[1, 2, 3]])
    assert corpus.is_contiguous
    blob = pickle.dumps(corpus)
    assert pickle.loads(blob).is_contiguous
    del corpus
    write_indexed(tmp_path / "c", [[1, 2, 4]])
    with pytest.raises(ValueError, match="changed since it was opened"):
        pickle.loads(blob)


# ----------------------------------------------------------------- integrity (issue 11.2 / 11.7)
def _documents(corpus: TokenCorpus) -> list[list[int]]:
    return [corpus.document(i).tolist() for i in range(corpus.num_documents)]


def test_negative_size_is_refused_naming_the_document(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1, 2], [3, 4], [5]])
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[HEADER_SIZE + 4 : HEADER_SIZE + 8] = struct.pack("<i", -2)
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedFormatError, match=r"c\.idx gives document 1 the negative size -2"):
        TokenCorpus.open(tmp_path / "c")


def test_shrunken_size_of_an_inner_document_is_refused(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1, 2], [3, 4], [5]])
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[HEADER_SIZE : HEADER_SIZE + 4] = struct.pack("<i", 1)  # document 0 would lose a token
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(
        IndexedFormatError, match="points document 1 at byte 4, but .* end at byte 2"
    ):
        TokenCorpus.open(tmp_path / "c")


def test_uint8_code_over_uint16_data_is_refused(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1, 2, 3], [300, 400]], dtype="uint16", code=1)
    with pytest.raises(
        IndexedFormatError, match=r"c\.idx has dtype code 1 \(uint8, 1 bytes.*fit 2-byte tokens"
    ):
        TokenCorpus.open(tmp_path / "c")


def test_decreasing_document_index_is_refused_on_open(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1], [2], [3]], document_indices=[0, 2, 1, 3])
    with pytest.raises(
        IndexedFormatError, match=r"decreasing document index at entry 2 \(2 then 1\)"
    ):
        TokenCorpus.open(tmp_path / "c")


def test_new_bin_with_old_idx_is_refused(tmp_path: Path) -> None:
    write_indexed(tmp_path / "old", [[1, 2, 3], [4, 5]])
    write_indexed(tmp_path / "new", [[1, 2, 3], [4, 5], [6]])
    shutil.copy(tmp_path / "new.bin", tmp_path / "old.bin")  # a reader between two renames
    with pytest.raises(IndexedFormatError, match="accounts for 10 bytes"):
        TokenCorpus.open(tmp_path / "old")


def test_megatron_files_with_modes_still_open(tmp_path: Path) -> None:
    megatron_files(tmp_path / "c", [[1, 2], [3]], modes=True)
    assert _documents(TokenCorpus.open(tmp_path / "c")) == [[1, 2], [3]]


def test_400_single_bit_flips_never_open_with_wrong_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 60000, rng.integers(0, 40)).tolist() for _ in range(50)]
    good = write_indexed(tmp_path / "good", docs)
    want, want_dtype = _documents(good), good.dtype
    raw = (tmp_path / "good.idx").read_bytes()
    shutil.copy(tmp_path / "good.bin", tmp_path / "bad.bin")
    outcomes = {"refused": 0, "identical": 0}
    for _ in range(400):
        bit = int(rng.integers(0, len(raw) * 8))
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (tmp_path / "bad.idx").write_bytes(bytes(flipped))
        try:
            corpus = TokenCorpus.open(tmp_path / "bad")
        except IndexedFormatError:
            outcomes["refused"] += 1
            continue
        # anything else raised fails the test; an open must give exactly the original tokens
        assert corpus.dtype == want_dtype and _documents(corpus) == want, f"bit {bit}"
        outcomes["identical"] += 1
    assert outcomes["refused"] + outcomes["identical"] == 400
    assert outcomes["refused"] > 300  # most bits matter (the document index of 0..n can move)


def test_writer_uses_unique_temp_names_and_creates_folders(tmp_path: Path) -> None:
    prefix = tmp_path / "a" / "b" / "c"
    one, two = IndexedWriter(prefix), IndexedWriter(prefix)
    assert one._tmp_bin != two._tmp_bin and one._tmp_bin.parent == prefix.parent
    one.add([1, 2])
    two.add([3])
    two.close()
    assert _documents(one.close()) == [[1, 2]]
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["c.bin", "c.idx"]


def test_failed_write_leaves_no_temp_files(tmp_path: Path) -> None:
    def documents():
        yield [1, 2]
        raise RuntimeError("tokenizer failed")

    with pytest.raises(RuntimeError, match="tokenizer failed"):
        write_indexed(tmp_path / "c", documents())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="token ids in"):
        write_indexed(tmp_path / "c", [[1], [70000]])
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_never_publish_a_mix(tmp_path: Path) -> None:
    import threading

    # same total size, different document boundaries: a mixed pair would pass a size check
    corpora = {"a": [[1, 2], [3]], "b": [[4], [5, 6]]}
    prefix = tmp_path / "c"
    for _ in range(20):
        writers = {k: IndexedWriter(prefix) for k in corpora}
        for k, w in writers.items():
            for doc in corpora[k]:
                w.add(doc)
        threads = [threading.Thread(target=w.close) for w in writers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert _documents(TokenCorpus.open(prefix)) in list(corpora.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx"]


def test_the_writer_is_imported_from_its_own_module_not_the_reader() -> None:
    # indexed.py re-exported the writer lazily, an import circle with indexed_write (#32)
    from meshfeed import sources
    from meshfeed.sources.tokens import indexed, indexed_write

    assert sources.write_indexed is indexed_write.write_indexed
    assert sources.IndexedWriter is indexed_write.IndexedWriter
    with pytest.raises(AttributeError, match="write_indexed"):
        indexed.write_indexed


def test_an_unreadable_bin_is_a_source_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .bin that cannot be opened (permissions, I/O) raised a bare PermissionError, which a
    loader reading batches would substitute as bad samples; it is a SourceError naming it.
    Permissions are not enforced for root, so the open is made to fail as for another user."""
    import os

    from meshfeed.errors import SourceError
    from meshfeed.sources.tokens import indexed_maps

    corpus = write_indexed(tmp_path / "c", [[5, 6, 7], [8, 9]], "int32")
    real = os.open

    def denied(path, flags, *args):  # type: ignore[no-untyped-def]
        if os.fspath(path).endswith(".bin"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, flags, *args)

    monkeypatch.setattr(indexed_maps.os, "open", denied)
    with pytest.raises(SourceError, match=r"cannot read .*c\.bin: \[Errno 13\] Permission"):
        _ = corpus.fingerprint  # reads the .bin's ends
