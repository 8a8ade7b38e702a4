"""TokenWindows / TokenDocuments: map-style views of a token corpus for the DataLoader."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from meshfeed.loader import DataLoader
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows
from meshfeed.testing import assert_resume_equivalence, assert_same
from tests.dist_utils import run_distributed
from tests.optional import given, settings, st


def corpus_of(tmp: Path, lengths: list[int], seed: int = 0) -> tuple[TokenCorpus, np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 50_000, n) for n in lengths]
    corpus = write_indexed(tmp / "c", docs, "uint16")
    flat = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    return corpus, flat


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    seq_len=st.integers(1, 17),
)
def test_window_i_is_the_token_range_from_i_times_seq_len(
    tmp_path_factory: pytest.TempPathFactory, lengths: list[int], seq_len: int
) -> None:
    corpus, flat = corpus_of(tmp_path_factory.mktemp("w"), lengths)
    if flat.size < seq_len + 1:
        with pytest.raises(ValueError, match=f"has {flat.size} tokens, shorter than one window"):
            TokenWindows(corpus, seq_len=seq_len)
        return
    windows = TokenWindows(corpus, seq_len=seq_len)
    assert len(windows) == max(0, (flat.size - 1) // seq_len)
    for i in range(len(windows)):
        want = flat[i * seq_len : i * seq_len + seq_len + 1]
        assert windows[i].tolist() == want.tolist()
    if len(windows):
        idx = np.arange(len(windows))[::-1].copy()
        batch = windows.fetch_batch(idx)
        assert batch.shape == (len(windows), seq_len + 1)
        assert_same(batch, torch.stack([windows[int(i)] for i in idx]))


def test_consecutive_windows_share_one_token(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [100, 37, 5])
    windows = TokenWindows(corpus, seq_len=16)
    for i in range(len(windows) - 1):
        assert windows[i][-1] == windows[i + 1][0]


def test_windows_default_to_int64_and_take_a_narrower_dtype(tmp_path: Path) -> None:
    corpus, flat = corpus_of(tmp_path, [50])
    assert TokenWindows(corpus, seq_len=8)[0].dtype == torch.int64
    narrow = TokenWindows(corpus, seq_len=8, dtype=torch.int32).fetch_batch(np.array([1]))
    assert narrow.dtype == torch.int32
    assert narrow[0].tolist() == flat[8:17].tolist()


def test_a_narrower_dtype_refuses_ids_it_cannot_hold_and_never_wraps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = tmp_path / "c"
    docs = [np.array([1, 2, 3, 4, 5]), np.array([6, 70000, 7, -1]), np.array([8, -2])]
    write_indexed(prefix, docs, np.int32)
    windows = TokenWindows(prefix, seq_len=2, dtype=torch.uint16)  # windows [0..2], [2..4], ...
    assert windows[0].tolist() == [1, 2, 3] and windows[1].dtype == torch.uint16
    assert windows.fetch_batch(np.array([1, 0])).tolist() == [[3, 4, 5], [1, 2, 3]]
    fix = r"pass a dtype that holds every id, e.g. dtype=torch.int64 \(the default\) or torch.int32"
    where = r"window 3 \(token 0 of it, 6 of the corpus\) holds token id 70000"
    what = rf"{where}, which dtype=torch.uint16 cannot hold \(0..65535; .*c\.bin stores int32\)"
    with pytest.raises(ValueError, match=rf"{what}.*{fix}"):
        windows[3]
    with pytest.raises(ValueError, match=where):
        windows.fetch_batch(np.array([0, 3]))
    with pytest.raises(ValueError, match=where):
        windows.__getitems__([3])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the pinned path checks too
    pinned = TokenWindows(prefix, seq_len=2, dtype=torch.int16, pin_memory=True)
    with pytest.raises(ValueError, match=r"window 2 \(token 2 of it, 6 of the corpus\)"):
        pinned.fetch_batch(np.array([2]))
    monkeypatch.undo()
    documents = TokenDocuments(prefix, dtype=torch.int16)
    assert documents.fetch_batch(np.array([0]))["tokens"].tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"document 1 \(token 1 of it\) holds token id 70000"):
        documents.fetch_batch(np.array([0, 1]))
    unsigned = TokenDocuments(prefix, dtype=torch.uint16)
    with pytest.raises(ValueError, match=r"document 2 \(token 1 of it\) holds token id -2"):
        unsigned.fetch_batch(np.array([0, 2]))
    for dtype in (torch.int32, torch.int64):  # as wide or wider: every id as it is
        assert TokenWindows(prefix, seq_len=2, dtype=dtype)[3].tolist() == [70000, 7, -1]
        assert TokenDocuments(prefix, dtype=dtype).fetch_batch(np.array([1]))[
            "tokens"
        ].tolist() == [6, 70000, 7, -1]


def test_a_narrower_dtype_of_the_same_width_checks_the_sign(tmp_path: Path) -> None:
    prefix = tmp_path / "c"
    write_indexed(prefix, [np.array([1, 40000, 2])], np.uint16)
    with pytest.raises(ValueError, match=r"token id 40000, which dtype=torch.int16 cannot hold"):
        TokenWindows(prefix, seq_len=2, dtype=torch.int16)[0]
    assert TokenWindows(prefix, seq_len=2, dtype=torch.int32)[0].tolist() == [1, 40000, 2]


def test_fetch_batch_takes_any_integer_index_array(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [64, 64])
    windows = TokenWindows(corpus, seq_len=10)
    want = torch.stack([windows[4], windows[2], windows[0]])
    read_only = np.array([4, 2, 0])
    read_only.setflags(write=False)
    for idx in (np.array([0, 2, 4])[::-1], np.array([4, 2, 0], np.int32), read_only, [4, 2, 0]):
        assert_same(windows.fetch_batch(idx), want)  # type: ignore[arg-type]
    assert windows.fetch_batch(np.zeros(0, np.int64)).shape == (0, 11)


def test_getitems_matches_getitem(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [64, 64])
    windows = TokenWindows(corpus, seq_len=10)
    items = windows.__getitems__([3, 0, 3])
    assert_same(items, [windows[3], windows[0], windows[3]])


def test_out_of_range_and_bad_indices_are_rejected(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [21])
    windows = TokenWindows(corpus, seq_len=10)
    assert len(windows) == 2
    with pytest.raises(IndexError, match="out of range for 2 windows"):
        windows[2]
    with pytest.raises(IndexError, match=r"outside \[0, 2\)"):
        windows.fetch_batch(np.array([0, 2]))
    with pytest.raises(IndexError, match=r"span \[-1, 0\]"):
        windows.fetch_batch(np.array([0, -1]))
    with pytest.raises(TypeError, match="1-D integer array"):
        windows.fetch_batch(np.array([[0]]))
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        TokenWindows(corpus, seq_len=0)
    with pytest.raises(TypeError, match="torch.dtype"):
        TokenWindows(corpus, seq_len=4, dtype="int64")  # type: ignore[arg-type]


def test_windows_open_a_prefix_and_pickle_small(tmp_path: Path) -> None:
    corpus_of(tmp_path, [10_000])
    windows = TokenWindows(tmp_path / "c", seq_len=128)
    blob = pickle.dumps(windows)
    assert len(blob) < 2_000
    assert_same(pickle.loads(blob)[5], windows[5])


def test_fingerprint_names_seq_len_and_corpus(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [100])
    a = TokenWindows(corpus, seq_len=8).fingerprint
    assert a == TokenWindows(corpus, seq_len=8).fingerprint
    assert a != TokenWindows(corpus, seq_len=9).fingerprint
    assert corpus.fingerprint in a


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=10), seq_len=st.integers(1, 9))
def test_document_starts_are_the_document_boundaries_inside_the_window(
    tmp_path_factory: pytest.TempPathFactory, lengths: list[int], seq_len: int
) -> None:
    corpus, _ = corpus_of(tmp_path_factory.mktemp("d"), lengths)
    if sum(lengths) < seq_len + 1:
        return  # shorter than one window: refused, see test_a_corpus_shorter_than_one_window_...
    windows = TokenWindows(corpus, seq_len=seq_len)
    starts = set(np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist())
    for i in range(len(windows)):
        lo = i * seq_len
        want = sorted(s - lo for s in starts if lo <= s < lo + seq_len + 1)
        assert windows.document_starts(i).tolist() == want


def test_documents_view_returns_each_document_and_lengths(tmp_path: Path) -> None:
    lengths = [3, 0, 7, 1]
    corpus, flat = corpus_of(tmp_path, lengths)
    docs = TokenDocuments(corpus)
    assert len(docs) == 4
    assert docs.lengths.tolist() == lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(4):
        assert docs[i].tolist() == flat[offsets[i] : offsets[i + 1]].tolist()
    assert [d.tolist() for d in docs.__getitems__([2, 0])] == [docs[2].tolist(), docs[0].tolist()]


def test_documents_fetch_batch_is_the_varlen_layout(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [3, 0, 7, 1])
    docs = TokenDocuments(corpus)
    batch = docs.fetch_batch(np.array([2, 1, 0]))
    assert batch["lengths"].tolist() == [7, 0, 3]
    assert batch["cu_seqlens"].tolist() == [0, 7, 7, 10]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["tokens"].tolist() == docs[2].tolist() + docs[0].tolist()
    assert batch["tokens"].dtype == torch.int64


def loader_factory(prefix: Path, **kw: object) -> DataLoader:
    return DataLoader(TokenWindows(prefix, seq_len=8), batch_size=3, seed=7, **kw)  # type: ignore[arg-type]


def test_loader_reads_windows_through_fetch_batch_and_resumes_exactly(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [40, 33, 60])
    ref = assert_resume_equivalence(lambda: loader_factory(tmp_path / "c"), num_items=30)
    assert len(ref) == 30  # crosses epoch boundaries: 16 windows / batch 3 -> 5 steps per epoch
    epoch = [tuple(row) for row in torch.cat(ref[:5]).tolist()]
    windows = TokenWindows(corpus, seq_len=8)
    every = {tuple(windows[i].tolist()) for i in range(len(windows))}
    assert len(set(epoch)) == 15 and set(epoch) <= every  # one epoch: distinct real windows


def _rank_batches(rank: int, world: int, prefix: str) -> tuple[str, list[list[list[int]]]]:
    loader = DataLoader(
        TokenWindows(prefix, seq_len=8), batch_size=2, mesh={"dp": world}, rank=rank, seed=3
    )
    return loader.fingerprint, [b.tolist() for b in loader]


@pytest.mark.slow
def test_ranks_in_separate_processes_agree_on_fingerprint_and_split_the_windows(
    tmp_path: Path,
) -> None:
    corpus_of(tmp_path, [50, 31, 77])
    prefix = str(tmp_path / "c")
    results = run_distributed(_rank_batches, 2, prefix)
    simulated = [_rank_batches(r, 2, prefix) for r in range(2)]
    assert results == simulated
    assert results[0][0] == results[1][0]
    rows = [tuple(w) for _, batches in results for b in batches for w in b]
    assert len(rows) == len(set(rows)), "data ranks never read the same window in one epoch"


@pytest.mark.slow
def test_spawned_loader_workers_reopen_the_corpus_and_match_in_process(tmp_path: Path) -> None:
    corpus_of(tmp_path, [300, 200])
    in_process = [b.tolist() for b in loader_factory(tmp_path / "c")]
    with loader_factory(tmp_path / "c", num_workers=2, multiprocessing_context="spawn") as loader:
        spawned = [b.tolist() for b in loader]
    assert spawned == in_process


def test_a_corpus_shorter_than_one_window_is_refused_with_both_numbers(tmp_path: Path) -> None:
    # before: an empty TokenWindows, then "dataset is empty (len 0)" from the loader
    corpus, _ = corpus_of(tmp_path, [30, 20])
    with pytest.raises(
        ValueError, match=r"has 50 tokens, shorter than one window of seq_len\+1 = 51"
    ):
        TokenWindows(corpus, seq_len=50)
    assert len(TokenWindows(corpus, seq_len=49)) == 1


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_float_corpus_is_refused_where_tokens_are_expected(tmp_path: Path, dtype: str) -> None:
    # before: TokenWindows over a float corpus silently returned int64
    corpus = write_indexed(tmp_path / "f", [np.linspace(0, 1, 40)], dtype)
    for make in (lambda: TokenWindows(corpus, seq_len=8), lambda: TokenDocuments(corpus)):
        with pytest.raises(ValueError, match=f"stores {dtype} values.*integer dtype"):
            make()


def test_a_float_output_dtype_is_refused(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [50])
    with pytest.raises(ValueError, match="must be an integer torch dtype"):
        TokenWindows(corpus, seq_len=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="must be an integer torch dtype"):
        TokenDocuments(corpus, dtype=torch.float16)


@pytest.mark.parametrize("corpus_dtype", ["uint16", "int32", "uint8"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint16])
def test_fetch_batch_matches_getitem_for_every_dtype_pair(
    tmp_path: Path, corpus_dtype: str, dtype: torch.dtype
) -> None:
    rng = np.random.default_rng(1)
    high = {"uint16": 65_535, "int32": 60_000, "uint8": 255}[corpus_dtype]
    docs = [rng.integers(0, high, n) for n in (70, 3, 55)]
    corpus = write_indexed(tmp_path / "c", docs, corpus_dtype)
    windows = TokenWindows(corpus, seq_len=9, dtype=dtype)
    idx = rng.permutation(len(windows))
    batch = windows.fetch_batch(idx)
    assert batch.dtype == dtype and batch.shape == (len(windows), 10)
    flat = np.concatenate(docs)
    want = np.stack([flat[i * 9 : i * 9 + 10] for i in idx]).astype(np.int64)
    assert batch.to(torch.int64).numpy().tolist() == want.tolist()
    assert_same(batch, torch.stack([windows[int(i)] for i in idx]))


def test_pin_memory_is_a_no_op_without_cuda_and_pins_with_it(tmp_path: Path) -> None:
    corpus, _ = corpus_of(tmp_path, [80])
    for dtype in (torch.int64, torch.uint16):
        windows = TokenWindows(corpus, seq_len=8, dtype=dtype, pin_memory=True)
        batch = windows.fetch_batch(np.array([3, 0, 5]))
        assert batch.is_pinned() == torch.cuda.is_available()
        assert_same(batch, TokenWindows(corpus, seq_len=8, dtype=dtype).fetch_batch([3, 0, 5]))
        assert pickle.loads(pickle.dumps(windows)).pin_memory
    with pytest.raises(TypeError, match="pin_memory"):
        TokenWindows(corpus, seq_len=8, pin_memory="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint16])
def test_every_fetch_batch_is_a_fresh_tensor_the_caller_may_keep(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    # the training loop may hold a batch while it asks for the next: no batch may alias the
    # memmap, a buffer of the source, or an earlier batch, whatever the batch sizes
    corpus, flat = corpus_of(tmp_path, [300])
    windows = TokenWindows(corpus, seq_len=7, dtype=dtype)
    picks = [np.array([3, 1, 4]), np.array([1, 5, 9, 2, 6]), np.array([5, 3, 5]), np.array([8])]
    kept = [windows.fetch_batch(idx) for idx in picks]
    for idx, batch in zip(picks, kept, strict=True):
        want = np.stack([flat[i * 7 : i * 7 + 8] for i in idx])
        assert batch.to(torch.int64).tolist() == want.tolist()
    before = [b.clone() for b in kept]
    kept[0].fill_(7)
    for b, want in zip(kept[1:], before[1:], strict=True):
        assert_same(b, want)
    assert_same(windows.fetch_batch(picks[0]), before[0])


def test_fetch_batch_from_concurrent_threads_matches_serial(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    corpus, _ = corpus_of(tmp_path, [5000], seed=3)
    windows = TokenWindows(corpus, seq_len=16, dtype=torch.int64)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, len(windows), 32) for _ in range(200)]
    serial = [windows.fetch_batch(b) for b in batches]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(windows.fetch_batch, batches))
    for a, b in zip(serial, threaded, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint16])
def test_negative_int64_indices_are_refused_not_wrapped(tmp_path: Path, dtype: torch.dtype) -> None:
    corpus, _ = corpus_of(tmp_path, [40])
    windows = TokenWindows(corpus, seq_len=10, dtype=dtype)
    with pytest.raises(IndexError, match=r"span \[-3, 1\]"):
        windows.fetch_batch(np.array([1, -3], np.int64))
    with pytest.raises(IndexError, match=r"span \[0, 3\], outside \[0, 3\)"):
        windows.fetch_batch(np.array([0, 3], np.int64))


class _Pins:
    """Whether the windows would pin, read where the sample is made (a worker or this one)."""

    def __init__(self, windows: TokenWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> bool:
        return self.windows._pins()


def test_workers_leave_pinning_to_the_training_process(tmp_path: Path, monkeypatch) -> None:
    # Page-locking in a worker would make a CUDA context there (or fail in a child forked
    # after its parent used CUDA), and its batch is copied into a shared-memory slot anyway:
    # workers gather into ordinary memory, and the loader's pin_memory=True pins the batch.
    corpus, _ = corpus_of(tmp_path, [50, 70])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # inherited by the workers
    windows = TokenWindows(corpus, seq_len=8, pin_memory=True)
    assert windows._pins()  # here, in the training process
    flags = list(DataLoader(_Pins(windows), batch_size=4, num_workers=1, collate_fn=list))
    assert flags == [[False] * 4]
    # A worker's fetch takes the plain path (on this CPU-only build, the pinned one raises).
    plain = TokenWindows(corpus, seq_len=8)
    kw = {"batch_size": 3, "seed": 2, "drop_last": False}
    assert_same(list(DataLoader(windows, num_workers=2, **kw)), list(DataLoader(plain, **kw)))
