"""The ``.bin`` maps' LRU (#32): a mixture of more corpora than the descriptor limit reads every
corpus, and a file changed while its map was closed is refused by name when mapped again."""

from __future__ import annotations

import contextlib
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_maps import max_open_maps
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows
from tests.process_checks import run_python


@pytest.fixture
def one_map() -> Iterator[None]:
    previous = max_open_maps(1)
    try:
        yield
    finally:
        max_open_maps(previous)


def test_max_open_maps_refuses_a_bad_limit_by_name() -> None:
    with pytest.raises(ValueError, match=r"positive integer \(got limit=0\)"):
        max_open_maps(0)
    with pytest.raises(ValueError, match=r"got limit=True"):
        max_open_maps(True)
    assert max_open_maps() >= 1


def test_an_open_corpus_holds_no_descriptor_until_read(tmp_path: Path, one_map: None) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to count descriptors")
    write_indexed(tmp_path / "c", [[1, 2, 3]])
    before = len(os.listdir("/proc/self/fd"))
    corpora = [TokenCorpus.open(tmp_path / "c") for _ in range(50)]
    assert len(os.listdir("/proc/self/fd")) == before
    assert all(c.document(0).tolist() == [1, 2, 3] for c in corpora)
    assert corpora[0].fingerprint == corpora[-1].fingerprint


def test_an_evicted_map_is_reopened_and_a_changed_file_refused_by_name(
    tmp_path: Path, one_map: None
) -> None:
    a = TokenDocuments(write_indexed(tmp_path / "a", [[1, 2, 3], [4, 5]], "int32"))
    b = TokenDocuments(write_indexed(tmp_path / "b", [[7, 8]], "int32"))
    assert a[1].tolist() == [4, 5]
    assert b[0].tolist() == [7, 8]  # a's map leaves the LRU
    assert a.fetch_batch(np.array([0, 1]))["tokens"].tolist() == [1, 2, 3, 4, 5]  # re-mapped
    assert b[0].tolist() == [7, 8]
    raw = bytearray((tmp_path / "a.bin").read_bytes())
    raw[0] = 9  # rewritten in place, same size, while a's map is closed
    os.utime(tmp_path / "a.bin", ns=(1, 1))  # a coarse clock must still see a change
    (tmp_path / "a.bin").write_bytes(bytes(raw))
    with pytest.raises(SourceError, match=r"a\.bin was rewritten or replaced since"):
        a[0]
    with open(tmp_path / "b.bin", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(SourceError, match=r"b\.bin changed size while open \(8 bytes .*, 16"):
        b.fetch_batch(np.array([0]))


def test_a_removed_bin_is_refused_by_name(tmp_path: Path, one_map: None) -> None:
    corpus = write_indexed(tmp_path / "c", [[1, 2]], "int32")
    (tmp_path / "c.bin").unlink()
    with pytest.raises(SourceError, match=r"c\.bin was removed since its corpus was opened"):
        corpus.document(0)


@pytest.fixture
def four_maps() -> Iterator[None]:
    previous = max_open_maps(4)  # two kept by their corpora, two in the LRU
    try:
        yield
    finally:
        max_open_maps(previous)


def _open_under(folder: Path) -> int:
    """Descriptors this process holds on files under ``folder`` (each open map holds one)."""
    fds = Path("/proc/self/fd")
    links = []
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            links.append(os.readlink(fds / fd))
    return sum(link.startswith(str(folder)) for link in links)


def test_the_first_corpora_read_keep_their_maps_the_rest_share_the_lru(
    tmp_path: Path, four_maps: None
) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to count descriptors")
    corpora = [write_indexed(tmp_path / f"c{k}", [[k, k + 1]], "int32") for k in range(6)]
    assert _open_under(tmp_path) == 0
    for _ in range(2):
        assert [c.document(0).tolist() for c in corpora] == [[k, k + 1] for k in range(6)]
    assert [c.keeps_map for c in corpora] == [True, True, False, False, False, False]
    assert _open_under(tmp_path) == 4  # two kept, two in the LRU: the limit
    max_open_maps(4)  # a new limit takes the kept maps back
    assert not any(c.keeps_map for c in corpora)
    assert _open_under(tmp_path) == 2  # the kept maps closed: nothing else held them
    assert corpora[5].document(0).tolist() == [5, 6]
    assert corpora[5].keeps_map  # granted again on its next read


def test_windows_read_the_same_through_a_kept_map_and_through_the_lru(
    tmp_path: Path, one_map: None
) -> None:
    docs = [list(range(k, k + 50)) for k in range(0, 2000, 50)]
    lru = TokenWindows(write_indexed(tmp_path / "a", docs, "int32"), seq_len=16)
    idx = np.array([3, 0, 7, 3, len(lru) - 1])
    through_lru = lru.fetch_batch(idx)
    assert not lru.corpus.keeps_map  # a limit of one map keeps none
    max_open_maps(4)
    kept = TokenWindows(lru.corpus, seq_len=16)
    assert kept.fetch_batch(idx).equal(through_lru)
    assert kept.corpus.keeps_map
    assert kept.fetch_batch(idx[::-1]).equal(through_lru.flip(0))  # the kept view, reused
    assert through_lru[:, 0].tolist() == (idx * 16).tolist()


def test_a_kept_map_still_refuses_a_truncated_bin_by_name(tmp_path: Path, four_maps: None) -> None:
    windows = TokenWindows(write_indexed(tmp_path / "t", [list(range(100))], "int32"), seq_len=8)
    assert windows.fetch_batch(np.array([1]))[0, 0].item() == 8
    assert windows.corpus.keeps_map
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(200)
    with pytest.raises(SourceError, match=r"t\.bin changed size while open \(400 bytes .*, 200"):
        windows.fetch_batch(np.array([1]))


_MANY = """
import os, resource
import numpy as np
import meshfeed
from meshfeed.sources.tokens.indexed_maps import max_open_maps
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows

N = 300  # corpora: more than the soft limit below, which the old two maps each exhausted
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
max_open_maps(32)
for k in range(N):
    write_indexed(f"c{k}", [[k, k + 1], [k + 2]], "int32")
sources = {f"c{k}": TokenDocuments(write_indexed(f"c{k}", [[k, k + 1], [k + 2]], "int32"))
           for k in range(N)}
mix = meshfeed.Mixture(sources, dict.fromkeys(sources, 1), seed=0)
print("fingerprint", len(mix.fingerprint))
# documents are views of their maps: a reader that kept all 600 would keep 300 maps open
got = [x.tolist() for lo in range(0, len(mix), 20) for x in mix.__getitems__(range(lo, lo + 20))]
want = [d for k in range(N) for d in ([k, k + 1], [k + 2])]
assert got == want, "wrong tokens"
loader = meshfeed.DataLoader(mix, batch_size=20, collate_fn=lambda b: [x.tolist() for x in b])
seen = [x for batch in loader for x in batch]
assert len(seen) == len(mix) and all(x in want for x in seen), "loader"
open_fds = len(os.listdir("/proc/self/fd"))
assert open_fds < 128, open_fds
print("read", len(got), "fds", open_fds)
"""


def test_a_mixture_of_more_corpora_than_the_descriptor_limit_reads_every_corpus(
    tmp_path: Path,
) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd and RLIMIT_NOFILE")
    (tmp_path / "many.py").write_text(textwrap.dedent(_MANY))
    done = run_python(tmp_path / "many.py", cwd=tmp_path, timeout=240)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert "read 600 fds" in done.stdout, done.stdout
