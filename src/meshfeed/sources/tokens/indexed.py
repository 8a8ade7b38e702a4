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

The ``.idx`` arrays are read into memory (12 bytes per document) and the ``.bin`` is memory-mapped
when first read, through a per-process LRU of at most :func:`~meshfeed.sources.tokens.indexed_maps.max_open_maps`
open maps (re-mapped on demand, checked against the file recorded on open), so an open corpus
holds no file descriptor and a mixture of 10,000 corpora fits any descriptor limit (#32).
:meth:`TokenCorpus.document` copies nothing. Opening checks every size, pointer and document index against each other and against
the ``.bin`` length (vectorised, O(documents), in bounded chunks): documents must lie back to
back, as every Megatron and meshfeed writer stores them, and the last one must end exactly at
the end of ``.bin``. So the ``.bin`` size is recorded in the ``.idx`` without changing a byte of
the format, a dtype code that disagrees with the ``.bin`` (uint8 over uint16 data) and a
``.bin`` from another index are refused by name, and a damaged index never yields wrong tokens.
A file that changes size after opening (truncated or rewritten in place) is a
:class:`~meshfeed.errors.SourceError` at the next batch read (:meth:`TokenCorpus.check_unchanged`),
not SIGBUS. A corpus pickles as its prefix (worker processes re-open the files instead of
receiving gigabytes).

A URL prefix is read through the node's shard cache; a ``.bin`` too large to cache (or any,
with ``ranged=True``) is read by ranged GETs of blocks instead, at the cost of refetching
blocks that a shuffled read misses (see :mod:`meshfeed.sources.tokens.indexed_ranged`).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed_checks import LayoutChecks
from meshfeed.sources.tokens.indexed_format import (  # re-exported: they were defined here
    _HEADER as _HEADER,
)
from meshfeed.sources.tokens.indexed_format import (
    DTYPE_CODES as DTYPE_CODES,
)
from meshfeed.sources.tokens.indexed_format import (
    HEADER_SIZE,
    IndexedFormatError,
    _paths,
    _publish_lock,
)
from meshfeed.sources.tokens.indexed_format import (
    MAGIC as MAGIC,
)
from meshfeed.sources.tokens.indexed_format import (
    VERSION as VERSION,
)
from meshfeed.sources.tokens.indexed_format import (
    dtype_code as dtype_code,
)
from meshfeed.sources.tokens.indexed_lazy import DeferredOpen
from meshfeed.sources.tokens.indexed_maps import (
    FileIdentity,
    MapHolder,
    file_identity,
    map_checked,
    read_ends,
)
from meshfeed.sources.tokens.indexed_ranged import RangedTokens, open_remote
from meshfeed.storage import (
    Ranged,
    RangedFile,
    ShardCache,
    StorageOptions,
    is_url,
    local_path_of,
)
from meshfeed.storage.ranged import check_ranged

__all__ = ["IndexedFormatError", "TokenCorpus"]


_FINGERPRINT_PROBE = 4096  # bytes hashed at each end of each file


class TokenCorpus(LayoutChecks, DeferredOpen):
    """A memory-mapped Megatron indexed corpus: ``document(i)`` is a zero-copy numpy view.

    >>> corpus = TokenCorpus.open("data/wiki_text_document")  # doctest: +SKIP
    >>> corpus.num_documents, corpus.num_tokens, corpus.dtype  # doctest: +SKIP
    (1000, 523412, dtype('uint16'))

    ``sizes`` (int32), ``pointers`` (int64 byte offsets) and ``document_index`` are read-only
    views of the ``.idx`` file. ``tokens`` is the whole ``.bin`` as one flat array, so any
    contiguous token range (a training window across document boundaries) is a single slice.
    Opening validates the header, the file lengths and every size and pointer (O(number of
    documents)); :meth:`validate` runs those checks again.

    A URL prefix (``s3://bucket/corpus``) is read through the node's shard cache (``cache_dir``,
    ``cache_limit``, ``storage_options``): the ``.idx`` cached whole, the ``.bin`` too unless
    ``ranged`` says otherwise (see :mod:`meshfeed.sources.tokens.indexed_ranged`): ``None`` (default)
    whole unless larger than ``cache_limit``, ``True`` or a :class:`~meshfeed.storage.RangeReads`
    always by ranged GETs of blocks, ``False`` always whole. By ranges, :attr:`ranged` is True,
    ``tokens`` is a :class:`~meshfeed.sources.tokens.indexed_ranged.RangedTokens` (slices are fresh
    arrays) and :meth:`document` returns a fresh array. ``version``: the ``.bin``'s remote
    version a job recorded (:attr:`version`); another one is refused by name.

    ``fingerprint``: the :attr:`fingerprint` the corpus must have (from a corpora manifest,
    :func:`~meshfeed.sources.tokens.manifest.open_corpora`). Then nothing is read until a read
    needs the files: length, dtype and token count come from the fingerprint; opened, the
    corpus is checked as usual and refused by name unless it still has that fingerprint
    (:mod:`~meshfeed.sources.tokens.indexed_lazy`).
    """

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        storage_options: StorageOptions | None = None,
        ranged: Ranged = None,
        version: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        check_ranged(ranged)
        self._held = MapHolder()  # the map itself once granted (no LRU lookup per read)
        options: dict[str, Any] = dict(
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            storage_options=storage_options,
            ranged=ranged,
            version=version,
        )
        if fingerprint is None:
            self._open(prefix, **options)
        else:
            self._defer(prefix, fingerprint, options)

    def _open(
        self,
        prefix: str | os.PathLike[str],
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        storage_options: StorageOptions | None,
        ranged: Ranged,
        version: str | None,
    ) -> None:
        """Read the ``.idx``, check it against the ``.bin``'s length and record the ``.bin``."""
        # a URL prefix (s3://bucket/corpus) is read through the node's shard cache: the files
        # cached whole are held while this object lives; a .bin read by ranges is not cached
        self._remote: dict[str, Any] | None = None
        self._cache: ShardCache | None = None
        self._ranged: RangedFile | None = None
        prefix = local_path_of(os.fspath(prefix)) or prefix  # file:// needs no cache
        if is_url(os.fspath(prefix)):
            remote: dict[str, Any] = dict(
                cache_dir=cache_dir, cache_limit=cache_limit, storage_options=storage_options
            )
            self._remote = {"url": os.fspath(prefix), **remote}
            self._cache = ShardCache(**remote)
            prefix, self._ranged = open_remote(os.fspath(prefix), self._cache, ranged, version)
            if self._ranged is not None:  # a worker reads by ranges too, and the same version
                self._remote.update(ranged=self._ranged.reads, version=self._ranged.version)
        idx_path, bin_path = _paths(prefix)
        for path in (idx_path, bin_path if self._ranged is None else None):
            if path is not None and not path.is_file():
                raise FileNotFoundError(
                    f"indexed corpus file {path} does not exist; pass the prefix shared by "
                    f"PREFIX.bin and PREFIX.idx (got {os.fspath(prefix)!r})"
                )
        self.prefix = os.fspath(idx_path)[: -len(".idx")]
        self.idx_path = idx_path
        self.bin_path: Path | str = bin_path
        # the .idx is read into memory (12 bytes per document) and the .bin only stat'ed: an
        # open corpus holds no descriptor; the .bin is mapped when read, through a bounded
        # per-process LRU that checks it is still this file (indexed_maps, #32)
        self._bin_identity: FileIdentity | None = None
        with _publish_lock(idx_path.parent, exclusive=False):
            self._idx = idx_path.read_bytes()
            if self._ranged is None:
                self._bin_identity = file_identity(bin_path)
                # the .bin's length on open: every later read is checked against it
                self._bin_size: int = self._bin_identity[2]
        if self._ranged is not None:
            self.bin_path = self._ranged.url  # named in errors: there is no local .bin
            self._bin_size = len(self._ranged)
        n_seq, n_doc = self._read_header(idx_path)
        self._n_docs = n_seq
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
        item = self.dtype.itemsize
        if self._bin_size % item:
            raise IndexedFormatError(
                f"{bin_path} is {self._bin_size} bytes, not a multiple of the {self.dtype} item "
                f"size {item}; the file is truncated or corrupt"
            )
        self._check_layout(self._bin_size)
        self._contiguous = True  # _check_layout proved it
        self._num_tokens: int | None = None
        self._fingerprint: str | None = None

    def _bin(self) -> mmap.mmap | bytes | RangedFile:
        """The ``.bin``'s bytes: its map (mapped now if the LRU dropped it) or ranged reads."""
        buf = self._held.buf
        if buf is not None:
            return buf
        if self._ranged is not None:
            return self._ranged
        assert self._bin_identity is not None  # local: recorded on open
        return map_checked(os.fspath(self.bin_path), self._bin_identity, self._held)

    @property
    def keeps_map(self) -> bool:
        """True while this corpus keeps its ``.bin``'s map itself (see
        :mod:`~meshfeed.sources.tokens.indexed_maps`): a view of it may then be kept too."""
        return self._held.buf is not None

    def tokens_map(self) -> mmap.mmap | bytes:
        """The local ``.bin``'s map, checked to still have its size on open (one ``fstat``).

        The hot path of a batch read: no LRU lookup while the corpus :attr:`keeps_map`. Raises
        :class:`SourceError` like :meth:`check_unchanged`; a ranged corpus has no map.
        """
        buf = self._bin()
        if isinstance(buf, RangedFile):
            raise TypeError(f"{self.bin_path} is read by ranges; it has no map")
        if isinstance(buf, mmap.mmap) and buf.size() != self._bin_size:
            raise SourceError(
                f"{self.bin_path} changed size while open ({self._bin_size} bytes when opened, "
                f"{buf.size()} now): it was truncated or rewritten in place under a running "
                "reader; write corpora under a new prefix or by rename (write_indexed does), "
                "then reopen"
            )
        return buf

    @property
    def tokens(self) -> np.ndarray | RangedTokens:
        """The whole ``.bin`` as one flat array (a view of its map), or ranged reads of it.

        Holding the array keeps the map (one descriptor) open; take it per read rather than
        keeping it, so the LRU can bound a process's open maps.
        """
        if self._ranged is not None:
            return RangedTokens(self._ranged, self.dtype)
        buf = self._bin()
        assert not isinstance(buf, RangedFile)  # local: a map
        return np.frombuffer(buf, self.dtype, self._bin_size // self.dtype.itemsize)

    def check_unchanged(self, *, tokens_only: bool = False) -> None:
        """Raise :class:`SourceError` naming the file if ``.idx`` or ``.bin`` no longer has the
        size it had when opened (``tokens_only``: the ``.bin`` alone, for a read that touches
        nothing of the ``.idx``, such as a batch of windows).

        Reading a mapped page past the end of a file truncated in place kills the process with
        ``SIGBUS`` (no Python exception, no message); the readers of this module call this
        before each batch read, so a corpus rewritten under a running loader is an error that
        names the file. Cost: one ``fstat`` per file (about 1 µs each) on the mappings' own
        descriptors, so a file replaced by rename (the old one still mapped, still whole) is
        not a change. A truncation between this check and the read still faults: rewrite a
        corpus only under a new name, or by rename (as :func:`write_indexed` does).
        """
        if not tokens_only:  # the .idx is in memory, but a changed one means a rewrite
            self._check_idx_size()
        if self._ranged is None:  # by ranges: checked by its version and read lengths instead
            self.tokens_map()  # a map made now was checked against the identity on open

    def _check_idx_size(self) -> None:
        try:
            now = os.stat(self.idx_path).st_size
        except FileNotFoundError:
            now = 0
        if now != len(self._idx):
            raise SourceError(
                f"{self.idx_path} changed size while open ({len(self._idx)} bytes when opened, "
                f"{now} now): it was truncated or rewritten in place under a running reader; "
                "write corpora under a new prefix or by rename (write_indexed does), then reopen"
            )

    @classmethod
    def open(cls, prefix: str | os.PathLike[str], **remote: Any) -> TokenCorpus:
        """Open ``PREFIX.idx`` and ``PREFIX.bin`` (a path ending in either also works).

        A URL prefix (``s3://bucket/corpus``, any fsspec URL) takes ``cache_dir=``,
        ``cache_limit=`` and ``storage_options=`` (see :class:`meshfeed.storage.ShardCache`),
        ``ranged=`` and ``version=``; ``fingerprint=`` defers opening (see the class docstring).
        """
        return cls(prefix, **remote)

    def __reduce__(self) -> tuple[Any, ...]:
        # a prefix (or URL) and the facts already checked, never the mapped data; the
        # fingerprint makes the receiving process refuse files that changed in between
        pending = self.__dict__.get("_pending")
        if pending is not None:  # still unopened: the receiver opens on first use too
            return (_reopen_deferred, (*pending, self._fingerprint))
        return (
            _reopen,
            (self.prefix, self.fingerprint, self._contiguous, self._num_tokens, self._remote),
        )

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
        return self._n_docs

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
        buf = self._bin()
        if isinstance(buf, RangedFile):
            start = int(self.pointers[i]) // self.dtype.itemsize
            return self.tokens[start : start + int(self.sizes[i])]
        return np.frombuffer(buf, self.dtype, int(self.sizes[i]), int(self.pointers[i]))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.document(i)

    @property
    def is_contiguous(self) -> bool:
        """True: documents lie back to back in ``.bin`` in order (checked on open).

        So the concatenated token stream is the flat ``tokens`` array.
        """
        return self._contiguous

    @property
    def ranged(self) -> bool:
        """True where the ``.bin`` is read by ranged GETs (a URL corpus), not a local file."""
        return self._ranged is not None

    @property
    def version(self) -> str | None:
        """The remote ``.bin``'s version when read by ranges (size and ETag), else None."""
        return None if self._ranged is None else self._ranged.version

    def validate(self) -> None:
        """Re-run the consistency checks made on open; raise :class:`IndexedFormatError`
        (or :class:`SourceError` if a file changed size since it was opened)."""
        self.check_unchanged()
        self._check_layout(self._bin_size)

    @property
    def fingerprint(self) -> str:
        """A cheap identity: header, file lengths, and a hash of the first/last 4 KB of each file.

        Independent of the path, so a moved corpus keeps its fingerprint; a rewritten one
        almost surely does not. Checkpoints store it to refuse a state from another corpus.
        """
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=12)
            for size, head, tail in (self._ends(self._idx), self._bin_ends()):
                h.update(size.to_bytes(8, "little"))
                h.update(head)
                h.update(tail)
            self._fingerprint = (
                f"megatron:{self.dtype}:{self.num_documents}:{self.document_index.shape[0]}:"
                f"{self._bin_size}:{h.hexdigest()}"
            )
        return self._fingerprint

    @staticmethod
    def _ends(buf: bytes | RangedFile) -> tuple[int, bytes, bytes]:
        n = len(buf)
        return n, bytes(buf[:_FINGERPRINT_PROBE]), bytes(buf[max(0, n - _FINGERPRINT_PROBE) :])

    def _bin_ends(self) -> tuple[int, bytes, bytes]:
        """The ``.bin``'s length and first/last bytes, read without mapping it."""
        if self._ranged is not None:
            return self._ends(self._ranged)
        assert self._bin_identity is not None  # local: recorded on open
        head, tail = read_ends(os.fspath(self.bin_path), self._bin_identity, _FINGERPRINT_PROBE)
        return self._bin_size, head, tail


def _reopen_deferred(
    prefix: str | os.PathLike[str], options: dict[str, Any], fingerprint: str
) -> TokenCorpus:
    return TokenCorpus(prefix, fingerprint=fingerprint, **options)


def _reopen(
    prefix: str,
    fingerprint: str,
    contiguous: bool,
    num_tokens: int | None,
    remote: dict[str, Any] | None = None,
) -> TokenCorpus:
    if remote is not None:
        remote = dict(remote)
        prefix = remote.pop("url")
    corpus = TokenCorpus(prefix, **(remote or {}))
    if corpus.fingerprint != fingerprint:
        raise ValueError(
            f"the indexed corpus at {prefix} changed since it was opened (fingerprint "
            f"{fingerprint!r}, now {corpus.fingerprint!r}); do not rewrite a corpus while a "
            "loader reads it"
        )
    corpus._contiguous, corpus._num_tokens = contiguous, num_tokens
    return corpus
