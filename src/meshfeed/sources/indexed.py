"""Megatron-LM / DeepSpeed indexed token corpora (``PREFIX.bin`` + ``PREFIX.idx``), read and written.

The format, exactly as ``megatron/core/datasets/indexed_dataset.py`` writes it (little endian):

- ``.idx``: magic ``b"MMIDIDX\\x00\\x00"``, version ``<Q`` (1), dtype code ``<B`` (1 uint8, 2 int8,
  3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), sequence count ``<Q``, document
  count ``<Q``, then ``int32 sizes[sequence count]`` (tokens per sequence), ``int64
  pointers[sequence count]`` (byte offsets into ``.bin``), ``int64 document_indices[document
  count]`` (sequence ranges ``[d[k], d[k+1])``; it starts at 0, so it has one entry more than
  there are Megatron documents). A multimodal index appends ``int8 modes[sequence count]``.
- ``.bin``: the token ids of every sequence, back to back, in the dtype of the header.

**Document means sequence.** In meshfeed a document is one entry of ``sizes`` (a Megatron
"sequence"), which is also how Megatron's own GPT dataset counts documents. Megatron's coarser
``document_indices`` (sentence-split corpora group several sequences into one document) are
exposed unchanged as :attr:`TokenCorpus.document_index` for callers that need them.

Everything is a read-only ``numpy`` view of a memory map: opening costs O(1) beyond reading the
header, and :meth:`TokenCorpus.document` copies nothing. A corpus pickles as its prefix (worker
processes re-open the files instead of receiving gigabytes).
"""

from __future__ import annotations

import array
import hashlib
import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from meshfeed.progress import Progress

__all__ = ["IndexedFormatError", "IndexedWriter", "TokenCorpus", "write_indexed"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
HEADER_SIZE = _HEADER.size  # 34 bytes

DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
_INT32_MAX = np.iinfo(np.int32).max
_FINGERPRINT_PROBE = 4096  # bytes hashed at each end of each file


class IndexedFormatError(ValueError):
    """A ``.idx`` / ``.bin`` pair that is not a valid indexed corpus; the message names the file."""


def _paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    p = os.fspath(prefix)
    for ext in (".bin", ".idx"):
        if p.endswith(ext):  # accept either file name as well as the bare prefix
            p = p[: -len(ext)]
    return Path(p + ".idx"), Path(p + ".bin")


def dtype_code(dtype: DTypeLike) -> int:
    """The Megatron dtype code of ``dtype``; raises ``ValueError`` for unsupported dtypes."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        names = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise ValueError(f"dtype {dt} has no Megatron code (got {dtype=}); use one of {names}")
    return _CODE_OF[dt]


def _map(path: Path) -> mmap.mmap | bytes:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""  # mmap refuses empty files; an empty buffer behaves the same
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class TokenCorpus:
    """A memory-mapped Megatron indexed corpus: ``document(i)`` is a zero-copy numpy view.

    >>> corpus = TokenCorpus.open("data/wiki_text_document")  # doctest: +SKIP
    >>> corpus.num_documents, corpus.num_tokens, corpus.dtype  # doctest: +SKIP
    (1000, 523412, dtype('uint16'))

    ``sizes`` (int32), ``pointers`` (int64 byte offsets) and ``document_index`` are read-only
    views of the ``.idx`` file. ``tokens`` is the whole ``.bin`` as one flat array, so any
    contiguous token range (a training window across document boundaries) is a single slice.
    Opening validates the header and the file lengths; :meth:`validate` additionally checks
    every pointer (O(number of documents)).
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        idx_path, bin_path = _paths(prefix)
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise FileNotFoundError(
                    f"indexed corpus file {path} does not exist; pass the prefix shared by "
                    f"PREFIX.bin and PREFIX.idx (got {os.fspath(prefix)!r})"
                )
        self.prefix = os.fspath(idx_path)[: -len(".idx")]
        self.idx_path, self.bin_path = idx_path, bin_path
        self._idx = _map(idx_path)
        idx_len = len(self._idx)
        if idx_len < HEADER_SIZE:
            raise IndexedFormatError(
                f"{idx_path} is truncated: {idx_len} bytes, shorter than the {HEADER_SIZE}-byte "
                "header; rewrite it (meshfeed convert or write_indexed)"
            )
        magic, version, code, n_seq, n_doc = _HEADER.unpack_from(self._idx, 0)
        if magic != MAGIC:
            raise IndexedFormatError(
                f"{idx_path} has bad magic {magic!r} (expected {MAGIC!r}); it is not a "
                "Megatron MMIDIDX index (old lazy/cached formats are not supported)"
            )
        if version != VERSION:
            raise IndexedFormatError(
                f"{idx_path} has index version {version} (expected {VERSION}); re-export it "
                "with Megatron-LM or meshfeed convert"
            )
        if code not in DTYPE_CODES:
            raise IndexedFormatError(
                f"{idx_path} has unknown dtype code {code} (known: {sorted(DTYPE_CODES)})"
            )
        self.dtype: np.dtype[Any] = DTYPE_CODES[code]
        body = HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if idx_len not in (body, body + n_seq):  # + n_seq: multimodal int8 modes
            raise IndexedFormatError(
                f"{idx_path} is {idx_len} bytes but its header ({n_seq} sequences, {n_doc} "
                f"document indices) implies {body} (or {body + n_seq} with modes); the file is "
                "truncated or corrupt"
            )
        if n_doc < 1:
            raise IndexedFormatError(
                f"{idx_path} has an empty document index (document count 0); a valid index "
                "starts with 0"
            )
        self.sizes: np.ndarray = np.frombuffer(self._idx, np.int32, n_seq, HEADER_SIZE)
        self.pointers: np.ndarray = np.frombuffer(
            self._idx, np.int64, n_seq, HEADER_SIZE + 4 * n_seq
        )
        self.document_index: np.ndarray = np.frombuffer(
            self._idx, np.int64, n_doc, HEADER_SIZE + 12 * n_seq
        )
        if self.document_index[0] != 0 or self.document_index[-1] != n_seq:
            raise IndexedFormatError(
                f"{idx_path} has a document index from {int(self.document_index[0])} to "
                f"{int(self.document_index[-1])}; it must run from 0 to the sequence count "
                f"{n_seq}"
            )
        self._bin = _map(bin_path)
        bin_len = len(self._bin)
        item = self.dtype.itemsize
        if bin_len % item:
            raise IndexedFormatError(
                f"{bin_path} is {bin_len} bytes, not a multiple of the {self.dtype} item size "
                f"{item}; the file is truncated or corrupt"
            )
        end = int(self.pointers[-1]) + item * int(self.sizes[-1]) if n_seq else 0
        if end > bin_len:
            raise IndexedFormatError(
                f"{bin_path} is {bin_len} bytes but {idx_path} points up to byte {end}; the "
                ".bin is truncated or belongs to another index"
            )
        self.tokens: np.ndarray = np.frombuffer(self._bin, self.dtype, bin_len // item)
        self._contiguous: bool | None = None
        self._num_tokens: int | None = None
        self._fingerprint: str | None = None

    @classmethod
    def open(cls, prefix: str | os.PathLike[str]) -> TokenCorpus:
        """Open ``PREFIX.idx`` and ``PREFIX.bin`` (a path ending in either also works)."""
        return cls(prefix)

    def __reduce__(self) -> tuple[Any, ...]:
        # a prefix and the facts already checked, never the mapped data; the fingerprint
        # makes the receiving process refuse files that changed in between
        return (_reopen, (self.prefix, self.fingerprint, self._contiguous, self._num_tokens))

    def __repr__(self) -> str:
        return (
            f"TokenCorpus({self.prefix!r}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )

    def __len__(self) -> int:
        return self.num_documents

    @property
    def num_documents(self) -> int:
        """Number of documents (= Megatron sequences, the entries of ``sizes``)."""
        return int(self.sizes.shape[0])

    @property
    def num_tokens(self) -> int:
        """Total tokens over all documents (the ``.bin`` length for a contiguous corpus)."""
        if self._num_tokens is None:
            self._num_tokens = int(self.sizes.sum(dtype=np.int64))
        return self._num_tokens

    def document(self, i: int) -> np.ndarray:
        """The tokens of document ``i`` (negative indices count from the end); a read-only view."""
        n = self.num_documents
        if not -n <= i < n:
            raise IndexError(f"document index {i} out of range for {n} documents")
        i %= n
        return np.frombuffer(self._bin, self.dtype, int(self.sizes[i]), int(self.pointers[i]))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.document(i)

    @property
    def is_contiguous(self) -> bool:
        """True when documents are back to back in ``.bin`` in order (as every writer produces).

        Only then is the concatenated token stream the flat ``tokens`` array. Checked once,
        vectorised, in chunks (O(documents) time, O(1) extra memory).
        """
        if self._contiguous is None:
            self._contiguous = self._check_contiguous()
        return self._contiguous

    def _check_contiguous(self, chunk: int = 1 << 20) -> bool:
        item = self.dtype.itemsize
        expected = 0
        for lo in range(0, self.num_documents, chunk):
            sizes = self.sizes[lo : lo + chunk].astype(np.int64)
            starts = expected + item * (np.cumsum(sizes) - sizes)
            if not np.array_equal(starts, self.pointers[lo : lo + chunk]):
                return False
            expected = int(starts[-1] + item * sizes[-1])
        return expected == self.tokens.shape[0] * item

    def validate(self) -> None:
        """Check every size and pointer against ``.bin``; raise :class:`IndexedFormatError`."""
        if self.num_documents and int(self.sizes.min()) < 0:
            raise IndexedFormatError(f"{self.idx_path} has negative sizes; the file is corrupt")
        ends = self.pointers + self.dtype.itemsize * self.sizes.astype(np.int64)
        if self.num_documents and (
            int(self.pointers.min()) < 0 or int(ends.max()) > len(self._bin)
        ):
            raise IndexedFormatError(
                f"{self.idx_path} has pointers outside {self.bin_path} ({len(self._bin)} bytes); "
                "the pair is corrupt or mismatched"
            )
        if np.any(np.diff(self.document_index) < 0):
            raise IndexedFormatError(f"{self.idx_path} has a decreasing document index")

    @property
    def fingerprint(self) -> str:
        """A cheap identity: header, file lengths, and a hash of the first/last 4 KB of each file.

        Independent of the path, so a moved corpus keeps its fingerprint; a rewritten one
        almost surely does not. Checkpoints store it to refuse a state from another corpus.
        """
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=12)
            for buf in (self._idx, self._bin):
                h.update(len(buf).to_bytes(8, "little"))
                h.update(buf[:_FINGERPRINT_PROBE])
                h.update(buf[max(0, len(buf) - _FINGERPRINT_PROBE) :])
            self._fingerprint = (
                f"megatron:{self.dtype}:{self.num_documents}:{self.document_index.shape[0]}:"
                f"{len(self._bin)}:{h.hexdigest()}"
            )
        return self._fingerprint


def _reopen(
    prefix: str, fingerprint: str, contiguous: bool | None, num_tokens: int | None
) -> TokenCorpus:
    corpus = TokenCorpus(prefix)
    if corpus.fingerprint != fingerprint:
        raise ValueError(
            f"the indexed corpus at {prefix} changed since it was opened (fingerprint "
            f"{fingerprint!r}, now {corpus.fingerprint!r}); do not rewrite a corpus while a "
            "loader reads it"
        )
    corpus._contiguous, corpus._num_tokens = contiguous, num_tokens
    return corpus


class IndexedWriter:
    """Streams documents into ``PREFIX.bin`` / ``PREFIX.idx`` without holding the corpus in memory.

    Memory is 8 bytes per document (the sizes). Files are written under temporary names and
    renamed on :meth:`close`, so readers never see a half-written corpus; leaving the ``with``
    block through an exception deletes them. Each document becomes one sequence and one
    Megatron document (``document_indices = 0..n``).

    >>> with IndexedWriter("/tmp/demo", dtype="uint16") as w:  # doctest: +SKIP
    ...     w.add([1, 2, 3])
    """

    def __init__(self, prefix: str | os.PathLike[str], *, dtype: DTypeLike = np.uint16) -> None:
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.idx_path, self.bin_path = _paths(prefix)
        self.prefix = os.fspath(self.idx_path)[: -len(".idx")]
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._tmp_idx = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._sizes = array.array("q")
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def add(self, tokens: ArrayLike) -> None:
        """Append one document (any 1-D array-like of token ids that fits the dtype)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(
                f"document {len(self._sizes)} has shape {arr.shape}; pass a 1-D sequence of "
                "token ids per document"
            )
        if arr.size > _INT32_MAX:
            raise ValueError(
                f"document {len(self._sizes)} has {arr.size} tokens, more than the int32 size "
                "field of the format allows; split it"
            )
        if self._limits is not None and arr.size:
            if arr.dtype.kind not in "iub":
                raise TypeError(
                    f"document {len(self._sizes)} has dtype {arr.dtype}; token ids must be "
                    f"integers for a {self.dtype} corpus"
                )
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._limits.min or hi > self._limits.max:
                raise ValueError(
                    f"document {len(self._sizes)} has token ids in [{lo}, {hi}], outside "
                    f"{self.dtype} [{self._limits.min}, {self._limits.max}]; choose a wider "
                    "dtype (e.g. int32)"
                )
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self._sizes.append(arr.size)

    def close(self) -> TokenCorpus:
        """Write the index, publish both files and return the opened corpus."""
        self._bin.close()
        sizes = np.frombuffer(self._sizes, np.int64) if self._sizes else np.zeros(0, np.int64)
        pointers = (np.cumsum(sizes) - sizes) * self.dtype.itemsize
        n = sizes.shape[0]
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, n, n + 1))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.arange(n + 1, dtype="<i8").tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)
        return TokenCorpus(self.prefix)

    def abort(self) -> None:
        """Discard everything written so far."""
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            p.unlink(missing_ok=True)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_indexed(
    prefix: str | os.PathLike[str],
    documents: Iterable[ArrayLike],
    dtype: DTypeLike = np.uint16,
    *,
    progress: bool = False,
) -> TokenCorpus:
    """Write ``documents`` (an iterable of 1-D token-id sequences) as a Megatron indexed corpus.

    Streams: only the current document and 8 bytes per document are held in memory. Returns
    the opened :class:`TokenCorpus`. Token ids must fit ``dtype`` (``ValueError`` otherwise).

    >>> corpus = write_indexed("/tmp/tiny", [[1, 2, 3], [4, 5]], "uint16")  # doctest: +SKIP
    >>> corpus.document(1).tolist()  # doctest: +SKIP
    [4, 5]
    """
    with (
        IndexedWriter(prefix, dtype=dtype) as writer,
        Progress(desc=f"write {os.fspath(prefix)}", unit="doc", enabled=progress) as bar,
    ):
        for doc in documents:
            writer.add(doc)
            bar.update()
    return TokenCorpus(writer.prefix)
