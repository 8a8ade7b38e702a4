"""Map-style views of a :class:`~meshfeed.sources.tokens.indexed.TokenCorpus` for the DataLoader.

- :class:`TokenWindows`: fixed windows of ``seq_len + 1`` tokens over the concatenated token
  stream, across document boundaries (GPT pretraining). Window ``i`` is the token range
  ``[i * seq_len, i * seq_len + seq_len + 1)``: consecutive windows share one token (the last
  label of one is the first input of the next), as in Megatron's GPT dataset. Positions are
  pure arithmetic; no index is built or cached.
- :class:`TokenDocuments`: one item per document, variable length.

Both implement ``__len__``, ``__getitem__``, ``__getitems__`` (torch's batched protocol) and
``fetch_batch(indices)``, meshfeed's already-collated batch hook: one preallocated array filled
by one memmap slice per sample and handed to torch without a further copy. Every read first
checks that the corpus files kept their size (:meth:`TokenCorpus.check_unchanged`, ~1 µs per
file): a ``.bin`` truncated under a running loader is a ``SourceError`` naming it, not SIGBUS.
A corpus whose ``.bin`` is read by ranges (``ranged=``, or a ``.bin`` larger than
``cache_limit``) gathers a batch from blocks fetched once for the batch (a shuffled epoch
refetches blocks; whole files are one GET per file per node); a rewritten or truncated object
is a ``SourceError`` naming it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from meshfeed.order.distinct import distinct
from meshfeed.runtime.lifeline import in_worker
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_ranged import RangedTokens
from meshfeed.storage import Ranged, StorageOptions

__all__ = ["TokenDocuments", "TokenWindows"]

CorpusLike = TokenCorpus | str | os.PathLike[str]


def _as_indices(indices: Any, n: int) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise TypeError(
            f"indices must be a 1-D integer array (got shape {idx.shape}, dtype {idx.dtype})"
        )
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(
            f"indices span [{int(idx.min())}, {int(idx.max())}], outside [0, {n}) for this dataset"
        )
    return idx


_NUMPY_OF: dict[torch.dtype, np.dtype[Any]] = {}  # a mixture makes 10,000 views (#32)


def _torch_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (got {dtype!r}); e.g. torch.int64")
    np_dtype = _NUMPY_OF.get(dtype)
    if np_dtype is None:
        np_dtype = _NUMPY_OF[dtype] = np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)
    if np_dtype.kind not in "iu":
        raise ValueError(
            f"token ids are integers, so dtype must be an integer torch dtype (got {dtype=}); "
            "use torch.int64 (what embedding layers take), torch.int32 or torch.uint16"
        )
    return np_dtype


def _narrows(corpus: TokenCorpus, np_dtype: np.dtype[Any]) -> bool:
    """Whether casting the corpus's ids to ``np_dtype`` could wrap some (int32 to uint16,
    uint16 to int16): such reads check their values; a wider or equal dtype costs nothing."""
    return not np.can_cast(corpus.dtype, np_dtype, "safe")


def _check_fits(
    values: np.ndarray,
    np_dtype: np.dtype[Any],
    corpus: TokenCorpus,
    where: Callable[[int], str],
) -> None:
    """Refuse ``values`` (a batch in the corpus's dtype) holding an id ``np_dtype`` cannot:
    one vectorised min/max pass; ``where(k)`` names the item of flat position ``k``."""
    if not values.size:
        return
    info = np.iinfo(np_dtype)
    lo, hi = int(values.min()), int(values.max())
    if info.min <= lo and hi <= info.max:
        return
    flat = values.reshape(-1)
    k = int(np.flatnonzero((flat < info.min) | (flat > info.max))[0])
    fix = "torch.int64 (the default)"
    if corpus.dtype.itemsize < 8:
        fix += f" or torch.{corpus.dtype} (the corpus's dtype)"
    raise ValueError(
        f"{where(k)} holds token id {int(flat[k])}, which dtype=torch.{np_dtype} cannot hold "
        f"({info.min}..{info.max}; {corpus.bin_path} stores {corpus.dtype}): it would "
        f"wrap to another id; pass a dtype that holds every id, e.g. dtype={fix}"
    )


def _integer_corpus(corpus: CorpusLike, **remote: Any) -> TokenCorpus:
    """``corpus`` opened (a prefix path or URL, with ``remote`` options) and checked to hold
    integer token ids."""
    if isinstance(corpus, (str, os.PathLike)):
        corpus = TokenCorpus.open(corpus, **remote)
    elif not isinstance(corpus, TokenCorpus):
        raise TypeError(
            f"corpus must be a TokenCorpus or a PREFIX path (got {type(corpus).__name__}); "
            "open it with TokenCorpus.open(prefix)"
        )
    if corpus.dtype.kind not in "iu":
        raise ValueError(
            f"{corpus.bin_path} stores {corpus.dtype} values, but token corpora are integer "
            "corpora (token ids); write it with an integer dtype, e.g. meshfeed convert "
            "--dtype uint16 (vocabularies up to 65,536) or --dtype int32"
        )
    return corpus


# torch lacks (or barely supports) some unsigned dtypes: gather through a signed type of the
# same width and reinterpret the bytes afterwards
_GATHER_AS = {np.dtype(np.uint16): np.dtype(np.int16)}


def _window_matrix(stream: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """A zero-copy ``[n, seq_len + 1]`` tensor whose row ``i`` starts at token ``i * seq_len``."""
    flat = stream.view(_GATHER_AS.get(stream.dtype, stream.dtype))
    with warnings.catch_warnings():
        # the memmap is read-only and only ever read through this tensor
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(flat)
    return (
        tensor.as_strided((n, seq_len + 1), (seq_len, 1)) if n else tensor[:0].view(0, seq_len + 1)
    )


class TokenWindows:
    """Windows of ``seq_len + 1`` consecutive tokens, the GPT pretraining sample.

    ``len(windows) == (num_tokens - 1) // seq_len``; window ``i`` covers tokens
    ``[i * seq_len, (i + 1) * seq_len + 1)`` of the flat ``.bin`` (documents are contiguous
    there, so a window that spans documents is still one slice). Items are torch tensors of
    ``dtype`` (default ``torch.int64``, what embedding layers take; pass ``torch.int32`` or
    ``torch.uint16`` to move fewer bytes and widen on the device; a dtype narrower than the
    corpus's checks each read's ids fit, one min/max pass per batch, and raises ``ValueError``
    naming the id and its window rather than wrap it). The corpus must be an
    integer corpus (contiguous: ``TokenCorpus.open`` refuses any other) and hold at least one
    window.

    ``pin_memory=True`` makes ``fetch_batch`` allocate its output in page-locked memory, so
    the gather writes there directly and the host-to-device copy can be asynchronous; the
    loader's own pinning step then has nothing left to copy. Without CUDA it is a no-op
    (ordinary memory; CPU builds of torch cannot pin), and so it is in a loader's worker
    processes, whose batches reach the training process through shared memory (give the
    loader ``pin_memory=True`` there).

    ``corpus`` may be a URL prefix (``s3://bucket/corpus``): both files are downloaded whole
    into the node's shard cache at ``cache_dir`` (once per node; ``storage_options`` go to
    fsspec), see :mod:`meshfeed.storage`, unless ``ranged`` (or a ``.bin`` larger than
    ``cache_limit``) has the ``.bin`` read by ranged GETs of blocks, held in a bounded
    per-process LRU (:mod:`meshfeed.sources.tokens.indexed_ranged`): the same tokens, but a shuffled
    epoch then fetches about one block per window that misses, every epoch, where whole files
    are one GET per file per node.

    >>> windows = TokenWindows(corpus, seq_len=2048)  # doctest: +SKIP
    >>> windows.fetch_batch(np.array([0, 5, 9])).shape  # doctest: +SKIP
    torch.Size([3, 2049])
    """

    def __init__(
        self,
        corpus: CorpusLike,
        *,
        seq_len: int,
        dtype: torch.dtype = torch.int64,
        pin_memory: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        storage_options: StorageOptions | None = None,
        ranged: Ranged = None,
    ) -> None:
        if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer (got {seq_len=})")
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool (got {pin_memory=!r})")
        self._np_dtype = _torch_dtype(dtype)
        # Contiguity needs no check here: TokenCorpus proves it on open (IndexedFormatError
        # otherwise), and is_contiguous can only be True.
        self.corpus = _integer_corpus(
            corpus,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            storage_options=storage_options,
            ranged=ranged,
        )
        self.seq_len = int(seq_len)
        self.dtype = dtype
        self.pin_memory = pin_memory
        num_tokens = self.corpus.num_tokens
        if num_tokens < self.seq_len + 1:
            raise ValueError(
                f"the corpus {self.corpus.prefix} has {num_tokens} tokens, shorter than one "
                f"window of seq_len+1 = {self.seq_len + 1}; use a smaller seq_len or a larger "
                "corpus"
            )
        self._len = (num_tokens - 1) // self.seq_len
        self._doc_starts: np.ndarray | None = None
        # the windows are views of the .bin's map, taken per read (holding them would keep
        # its descriptor open past the LRU's bound, #32); by ranges, through the block cache
        # an opened corpus is mapped now, so a corpus replaced by rename after this keeps
        # serving the file opened; one opened on first read (a manifest's) maps then
        tokens = self.corpus.tokens if self.corpus.opened or self.corpus.ranged else None
        self._ranged = tokens if isinstance(tokens, RangedTokens) else None
        # the strided view of the last map read, kept only while the corpus keeps that map
        self._kept: tuple[object, np.ndarray] | None = None
        # the gather writes the corpus's bytes; widen (or narrow) only when dtype differs
        self._same_dtype = self.corpus.dtype == self._np_dtype
        # a narrower dtype checks each read's ids fit (one min/max pass), never wraps them
        self._narrows = _narrows(self.corpus, self._np_dtype)

    def _stream(self) -> np.ndarray:
        return self.corpus.tokens[: self._len * self.seq_len + 1]

    def _checked_rows(self) -> np.ndarray:
        """The windows' strided view of the ``.bin``'s map, checked unchanged in size.

        The hot path: while the corpus keeps its map (the common case, a few corpora per
        process) the view is built once and kept; otherwise it is built per read (~1 us), so a
        map the LRU dropped is not held open by it (#32).
        """
        buf = self.corpus.tokens_map()
        kept = self._kept
        if kept is not None and kept[0] is buf:
            return kept[1]
        rows = self._rows(np.frombuffer(buf, self.corpus.dtype, self._len * self.seq_len + 1))
        self._kept = (buf, rows) if self.corpus.keeps_map else None
        return rows

    def _rows(self, stream: np.ndarray) -> np.ndarray:
        """The windows as a read-only strided numpy view (they overlap by one token); built
        per read (~1 us: the ndarray constructor, not as_strided's ~20 us)."""
        return np.ndarray(
            (self._len, self.seq_len + 1),
            stream.dtype,
            buffer=stream,
            strides=(self.seq_len * stream.itemsize, stream.itemsize),
        )

    def __getstate__(self) -> dict[str, Any]:
        # the corpus pickles as its prefix; the memmap slice and caches are rebuilt on load
        return {
            "corpus": self.corpus,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "pin_memory": self.pin_memory,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["corpus"],
            seq_len=state["seq_len"],
            dtype=state["dtype"],
            pin_memory=state.get("pin_memory", False),
        )

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"TokenWindows({self.corpus!r}, seq_len={self.seq_len}, windows={self._len})"

    @property
    def fingerprint(self) -> str:
        return f"windows:{self.seq_len}:{self.corpus.fingerprint}"

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self._len <= i < self._len:
            raise IndexError(f"window index {i} out of range for {self._len} windows")
        self.corpus.check_unchanged(tokens_only=True)
        start = (i % self._len) * self.seq_len
        stream = self._stream() if self._ranged is None else self._ranged
        window = stream[start : start + self.seq_len + 1]
        if self._narrows:
            self._check_fits(window, np.array([i % self._len]))
        return torch.from_numpy(window.astype(self._np_dtype))

    def _check_fits(self, rows: np.ndarray, idx: np.ndarray) -> None:
        """Refuse windows ``rows`` (at ``idx``) holding an id ``dtype`` cannot hold."""
        width = self.seq_len + 1

        def where(k: int) -> str:
            w, at = int(idx[k // width]), k % width
            return f"window {w} (token {at} of it, {w * self.seq_len + at} of the corpus)"

        _check_fits(rows, self._np_dtype, self.corpus, where)

    def __getitems__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        return list(self.fetch_batch(np.asarray(indices, dtype=np.int64)).unbind(0))

    def _pins(self) -> bool:
        """Whether ``fetch_batch`` writes into pinned memory: with ``pin_memory`` and CUDA, in
        the training process only. In a worker process (:func:`in_worker`) the batch goes
        back through a shared-memory slot anyway, and page-locking there would make a CUDA
        context per worker, or fail in a worker forked after its parent used CUDA; the
        loader's ``pin_memory=True`` pins it in the training process."""
        return self.pin_memory and not in_worker() and torch.cuda.is_available()

    def fetch_batch(self, indices: np.ndarray) -> torch.Tensor:
        """The windows at ``indices`` as one fresh ``[len(indices), seq_len + 1]`` tensor.

        Every call returns a new tensor that the caller may keep; no per-window Python. One
        numpy fancy-index gather of whole rows from a strided view of the memmap (the windows
        overlap by one token, so the view has stride ``seq_len``) makes the batch in the
        corpus's dtype; another ``dtype`` is one cast of that batch while it is still in
        cache. With ``pin_memory`` (and CUDA) the last step writes into pinned memory: a
        ``torch.index_select`` straight from the memmap, or the widening copy.
        """
        idx = indices if isinstance(indices, np.ndarray) else np.asarray(indices)
        if idx.dtype != np.int64 or idx.ndim != 1:
            idx = _as_indices(idx, self._len)
        if idx.shape[0] and min(idx.tolist()) < 0:
            _as_indices(idx, self._len)  # numpy would wrap a negative index: refuse it by name
        if self._ranged is not None:
            return self._fetch_ranged(self._ranged, idx)
        if self._pins():
            self.corpus.check_unchanged(tokens_only=True)
            return self._fetch_pinned(idx)
        try:
            # a truncated .bin would fault (SIGBUS) in the gather: checked, with no .idx read
            rows = self._checked_rows()[idx]
        except IndexError:
            _as_indices(idx, self._len)  # raises the IndexError that names the range
            raise
        if not self._same_dtype:
            if self._narrows:
                self._check_fits(rows, idx)
            rows = rows.astype(self._np_dtype)
        return torch.from_numpy(rows)

    def _fetch_ranged(self, tokens: RangedTokens, idx: np.ndarray) -> torch.Tensor:
        """The batch by ranges: the blocks its windows touch, fetched once for the batch."""
        idx = _as_indices(idx, self._len)
        rows = tokens.windows(idx * self.seq_len, self.seq_len + 1)
        if self._narrows:
            self._check_fits(rows, idx)
        if self._pins():
            out = torch.empty(rows.shape, dtype=self.dtype, pin_memory=True)
            return out.copy_(torch.from_numpy(rows.astype(self._np_dtype, copy=False)))
        return torch.from_numpy(rows if self._same_dtype else rows.astype(self._np_dtype))

    def _fetch_pinned(self, idx: np.ndarray) -> torch.Tensor:
        idx = _as_indices(idx, self._len)  # names an index out of range before torch or numpy
        shape = (idx.shape[0], self.seq_len + 1)
        if not self._same_dtype:
            rows = self._rows(self._stream())[idx]
            if self._narrows:
                self._check_fits(rows, idx)
            out = torch.empty(shape, dtype=self.dtype, pin_memory=True)
            return out.copy_(torch.from_numpy(rows))
        if not (idx.flags.c_contiguous and idx.flags.writeable):
            idx = idx.copy()  # torch.from_numpy wants positive strides and warns on read-only
        windows = _window_matrix(self._stream(), self._len, self.seq_len)
        out = torch.empty(shape, dtype=windows.dtype, pin_memory=True)
        torch.index_select(windows, 0, torch.from_numpy(idx), out=out)
        return out.view(self.dtype)

    def document_starts(self, i: int) -> np.ndarray:
        """Offsets inside window ``i`` where a document begins (for position ids / doc masks).

        Found by ``searchsorted`` on the cumulative sizes, computed once on first use
        (8 bytes per document). Empty documents occupy no offset.
        """
        if not 0 <= i < self._len:
            raise IndexError(f"window index {i} out of range for {self._len} windows")
        if self._doc_starts is None:
            sizes = self.corpus.sizes.astype(np.int64)
            self._doc_starts = np.cumsum(sizes) - sizes
        lo = i * self.seq_len
        hi = lo + self.seq_len + 1
        a, b = np.searchsorted(self._doc_starts, [lo, hi], side="left")
        # empty documents share a start with their successor: report each offset once
        return distinct(self._doc_starts[a:b] - lo)


class TokenDocuments:
    """One item per document: ``documents[i]`` is a read-only numpy view of its tokens (zero copy).

    Views, not tensors, because most consumers (packing, balancing) read ``lengths`` and
    concatenate slices themselves; ``torch.from_numpy`` would warn on the read-only memmap.
    ``fetch_batch`` returns the varlen-attention layout: ``{"tokens": 1-D tensor of all
    documents back to back, "lengths": int64 [B], "cu_seqlens": int32 [B + 1]}``.

    ``fetch_batch``'s tokens are of ``dtype``; a dtype narrower than the corpus's checks the
    batch's ids fit (``ValueError`` naming the id and its document, never a wrapped id).
    A URL ``corpus`` takes ``cache_dir``, ``cache_limit``, ``storage_options`` and ``ranged`` as
    :class:`TokenWindows` does; by ranges, items are fresh arrays and a batch's documents are
    read with one pass over the blocks they touch.
    """

    def __init__(
        self,
        corpus: CorpusLike,
        *,
        dtype: torch.dtype = torch.int64,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        storage_options: StorageOptions | None = None,
        ranged: Ranged = None,
    ) -> None:
        self._np_dtype = _torch_dtype(dtype)
        self.corpus = _integer_corpus(
            corpus,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            storage_options=storage_options,
            ranged=ranged,
        )
        self.dtype = dtype
        # a narrower dtype checks each batch's ids fit (one min/max pass), never wraps them
        self._narrows = _narrows(self.corpus, self._np_dtype)

    def __len__(self) -> int:
        return self.corpus.num_documents

    def __repr__(self) -> str:
        return f"TokenDocuments({self.corpus!r})"

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document (int32, read-only, a view of the ``.idx``)."""
        return self.corpus.sizes

    @property
    def fingerprint(self) -> str:
        return f"documents:{self.corpus.fingerprint}"

    def __getitem__(self, i: int) -> np.ndarray:
        self.corpus.check_unchanged()
        return self.corpus.document(i)

    def __getitems__(self, indices: Sequence[int]) -> list[np.ndarray]:
        idx = _as_indices(np.asarray(indices, dtype=np.int64), len(self))
        self.corpus.check_unchanged()
        return self._spans(self.corpus.tokens, idx)

    def _spans(self, tokens: np.ndarray | RangedTokens, idx: np.ndarray) -> list[np.ndarray]:
        """The tokens of the documents at ``idx``: views of the map, or by ranges (one pass
        over the blocks they touch)."""
        starts = (self.corpus.pointers[idx] // self.corpus.dtype.itemsize).tolist()
        lengths = self.corpus.sizes[idx].tolist()
        if isinstance(tokens, RangedTokens):
            return tokens.spans(starts, lengths)
        return [tokens[a : a + n] for a, n in zip(starts, lengths, strict=True)]

    def fetch_batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """The documents at ``indices`` concatenated, with their lengths and cumulative offsets."""
        idx = _as_indices(indices, len(self))
        self.corpus.check_unchanged()
        lengths = self.corpus.sizes[idx].astype(np.int64)
        cu = np.zeros(idx.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=cu[1:])
        narrows = self._narrows
        # narrowing, the batch is gathered in the corpus's dtype and checked before the cast
        out = np.empty(int(cu[-1]), dtype=self.corpus.dtype if narrows else self._np_dtype)
        docs = self._spans(self.corpus.tokens, idx)
        for doc, lo, hi in zip(docs, cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            out[lo:hi] = doc
        if narrows:

            def where(k: int) -> str:
                j = int(np.searchsorted(cu, k, side="right")) - 1
                return f"document {int(idx[j])} (token {k - int(cu[j])} of it)"

            _check_fits(out, self._np_dtype, self.corpus, where)
            out = out.astype(self._np_dtype)
        return {
            "tokens": torch.from_numpy(out),
            "lengths": torch.from_numpy(lengths),
            "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
        }
