"""The consistency checks a :class:`~meshfeed.sources.tokens.indexed.TokenCorpus` makes on open.

Every size, pointer and document index against each other and against the ``.bin`` length,
vectorised in bounded chunks (split from :mod:`meshfeed.sources.tokens.indexed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.sources.tokens.indexed_format import (
    _CODE_OF,
    _HEADER,
    DTYPE_CODES,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    IndexedFormatError,
)

__all__ = ["LayoutChecks"]

_CHUNK = 1 << 20  # documents checked per vectorised step on open (bounded temporary memory)


class LayoutChecks:
    """The layout checks, mixed into the corpus that has these attributes."""

    sizes: np.ndarray
    pointers: np.ndarray
    document_index: np.ndarray
    dtype: np.dtype[Any]
    idx_path: Path
    bin_path: Path | str
    _idx: bytes
    _n_docs: int  # documents (= Megatron sequences, the entries of ``sizes``)

    def _read_header(self, idx_path: Path) -> tuple[int, int]:
        """Check the ``.idx`` header and length and set ``dtype``; the sequence and
        document-index counts."""
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
        return n_seq, n_doc

    def _check_layout(self, bin_len: int, chunk: int = _CHUNK) -> None:
        """Every size, pointer and document index consistent with each other and with ``.bin``.

        Vectorised in chunks of ``chunk`` documents: O(documents) time, O(chunk) memory.
        """
        self._check_document_order(chunk)
        self._check_dtype_fits(bin_len)
        expected = 0  # byte where the next document must start
        for lo in range(0, self._n_docs, chunk):
            expected = self._check_pointers(lo, chunk, expected, bin_len)
        if expected != bin_len:
            raise IndexedFormatError(
                f"{self.bin_path} is {bin_len} bytes but {self.idx_path} accounts for "
                f"{expected} bytes ({self._n_docs} documents of {self.dtype}); the dtype "
                "code disagrees with the .bin, or the .bin belongs to another index: write the "
                "pair together"
            )

    def _check_document_order(self, chunk: int) -> None:
        """The document index never decreases."""
        d = self.document_index
        for lo in range(0, d.shape[0] - 1, chunk):
            bad = np.flatnonzero(np.diff(d[lo : lo + chunk + 1]) < 0)
            if bad.size:
                k = lo + int(bad[0])
                raise IndexedFormatError(
                    f"{self.idx_path} has a decreasing document index at entry {k + 1} "
                    f"({int(d[k])} then {int(d[k + 1])}); the index is corrupt, rewrite it"
                )

    def _check_dtype_fits(self, bin_len: int) -> None:
        """Raise when the last document ends short of or past the .bin's end but another
        token size would fit it exactly: the dtype code is wrong."""
        item = self.dtype.itemsize
        if not self._n_docs:
            return
        last, size = int(self.pointers[-1]), int(self.sizes[-1])
        if last + item * size == bin_len:
            return
        head = self.sizes[:_CHUNK].astype(np.int64)
        fits = [
            k
            for k in (1, 2, 4, 8)
            if k != item
            and last + k * size == bin_len
            and np.array_equal(k * (np.cumsum(head) - head), self.pointers[: head.shape[0]])
        ]
        if fits:
            raise IndexedFormatError(
                f"{self.idx_path} has dtype code {_CODE_OF[self.dtype]} ({self.dtype}, {item} "
                f"bytes per token), but its pointers and the {bin_len}-byte {self.bin_path} fit "
                f"{fits[0]}-byte tokens; the dtype code disagrees with the .bin: re-export "
                "the corpus or fix the code"
            )

    def _check_pointers(self, lo: int, chunk: int, expected: int, bin_len: int) -> int:
        """Check documents ``lo`` to ``lo + chunk`` (sizes, pointers, back to back from byte
        ``expected``); return the byte where the next document must start."""
        idx, bin_ = self.idx_path, self.bin_path
        item = self.dtype.itemsize
        sizes = self.sizes[lo : lo + chunk].astype(np.int64)
        pointers = self.pointers[lo : lo + chunk]
        if int(sizes.min()) < 0:
            i = lo + int(np.argmax(sizes < 0))
            raise IndexedFormatError(
                f"{idx} gives document {i} the negative size {int(self.sizes[i])}; the "
                "index is corrupt, rewrite it"
            )
        outside = (pointers < 0) | (pointers > bin_len)
        if outside.any():
            i = lo + int(np.argmax(outside))
            raise IndexedFormatError(
                f"{idx} has pointers outside {bin_} ({bin_len} bytes): document {i} starts "
                f"at byte {int(self.pointers[i])}; the pair is corrupt or mismatched"
            )
        ends = pointers + item * sizes  # no overflow: pointers <= bin_len, sizes < 2**31
        if int(ends.max()) > bin_len:
            i = lo + int(np.argmax(ends > bin_len))
            raise IndexedFormatError(
                f"{bin_} is {bin_len} bytes but {idx} points up to byte "
                f"{int(ends[i - lo])} (document {i}); the .bin is truncated or belongs to "
                "another index"
            )
        starts = expected + item * (np.cumsum(sizes) - sizes)
        wrong = starts != pointers
        if wrong.any():
            i = lo + int(np.argmax(wrong))
            raise IndexedFormatError(
                f"{idx} points document {i} at byte {int(self.pointers[i])}, but the "
                f"documents before it end at byte {int(starts[i - lo])}; documents must lie "
                "back to back (as every Megatron and meshfeed writer stores them), so the "
                "index is corrupt: rewrite it"
            )
        return int(starts[-1] + item * sizes[-1])
