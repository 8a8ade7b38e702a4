"""Metric definitions for the analyzer: per-sample values and accumulated (reduced) metrics.

A :class:`SampleMetric` maps one sample to one number of any numeric dtype. An
:class:`AccumulatedMetric` adds each sample's contribution into a fixed-size array (a token
histogram); a sample metric may ``require`` accumulated ones, which makes the analysis two
passes: the accumulated arrays are reduced first, ``prepare(*arrays)`` turns them into a
context once per rank, in the main process, and that context is sent to the workers; then
``fn(sample, context)`` runs per sample.

Metric functions run in worker processes: with the default ``fork`` start method anything
works; with ``spawn`` they must be picklable (module-level functions, ``functools.partial``),
and so must the context ``prepare`` returns, which is pickled once into each worker.

Built in: :func:`seqlen`, :func:`token_histogram` and :func:`vocab_rarity` (DeepSpeed's
"vocabulary rarity": ``sum(-log p(token))`` with ``p`` from the corpus token histogram).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

__all__ = ["AccumulatedMetric", "SampleMetric", "seqlen", "token_histogram", "vocab_rarity"]


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(
            f"metric name must be non-empty letters, digits, '_', '-' or '.' (got {name=}); "
            "it names the index directory"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class AccumulatedMetric:
    """``fn(acc, sample)`` adds ``sample``'s contribution into ``acc`` (shape ``(size,)``).

    ``batch_fn(acc, samples)``, when given, does the same for a list of samples at once (the
    analyzer then calls it once per chunk); it must add exactly what ``fn`` would.
    """

    name: str
    fn: Callable[[np.ndarray, Any], None] = field(repr=False)
    size: int
    dtype: str = "int64"
    batch_fn: Callable[[np.ndarray, list[Any]], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_name(self.name)
        if self.size < 1:
            raise ValueError(f"accumulated metric {self.name!r} needs size >= 1 (got {self.size=})")


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleMetric:
    """``fn(sample)`` (or ``fn(sample, context)`` with ``requires``) -> one number of ``dtype``.

    ``batch_fn(samples)`` (or ``batch_fn(samples, context)``), when given, returns the values of
    a list of samples at once, vectorised; it must equal ``fn`` sample by sample.

    ``prepare(*required_arrays)``, when given, builds the context: the analyzer calls it once
    per rank in the main process and sends the result to every worker (without it the context
    is the required array, or a tuple of them).
    """

    name: str
    fn: Callable[..., Any] = field(repr=False)
    dtype: str = "int64"
    requires: tuple[AccumulatedMetric, ...] = ()
    prepare: Callable[..., Any] | None = field(default=None, repr=False)
    batch_fn: Callable[..., Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_name(self.name)
        if np.dtype(self.dtype).kind not in "iuf":
            raise TypeError(
                f"metric {self.name!r} dtype must be numeric (got {self.dtype=}); use e.g. "
                "'int64' or 'float64'"
            )

    def context(self, accumulated: dict[str, np.ndarray]) -> Any:
        """The second argument of ``fn`` once the required accumulated arrays are known."""
        arrays = [accumulated[a.name] for a in self.requires]
        if self.prepare is not None:
            return self.prepare(*arrays)
        return arrays[0] if len(arrays) == 1 else tuple(arrays)


def _field(sample: Any, key: str | None) -> Any:
    return sample if key is None else sample[key]


def _len(sample: Any, *, key: str | None) -> int:
    return len(_field(sample, key))


def _check_vocab(tokens: np.ndarray, vocab_size: int, sizes: np.ndarray | None = None) -> None:
    """Refuse ids outside ``[0, vocab_size)``; ``sizes`` splits ``tokens`` into samples."""
    if tokens.size and int(tokens.min()) < 0:
        k = int(np.argmin(tokens))  # the first smallest
        at = f"token {k} of the sample"
        if sizes is not None:
            ends = np.cumsum(sizes)
            j = int(np.searchsorted(ends, k, side="right"))
            start = int(ends[j] - sizes[j])
            at = f"token {k - start} of sample {j} of the analysed chunk of {len(sizes)} samples"
        raise ValueError(
            f"token id {int(tokens[k])} (the smallest, at {at}) is negative; token ids must be "
            ">= 0 for vocab_rarity / token_histogram, which count ids in [0, vocab_size) "
            "(no vocabulary size takes a negative id): fix or drop the negative ids"
        )
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"token ids span [{int(tokens.min())}, {int(tokens.max())}], outside the "
            f"vocabulary [0, {vocab_size}); pass vocab_size > {int(tokens.max())} to "
            "token_histogram() / vocab_rarity()"
        )


def _tokens(sample: Any, key: str | None) -> np.ndarray:
    tokens = np.asarray(_field(sample, key)).ravel()
    # ``np.asarray([])`` is float64; an empty document is zero tokens, not a float index.
    return tokens if tokens.size else np.empty(0, dtype=np.int64)


def _count_tokens(acc: np.ndarray, sample: Any, *, key: str | None) -> None:
    tokens = _tokens(sample, key)
    _check_vocab(tokens, len(acc))
    np.add.at(acc, tokens, 1)


def _lens(samples: list[Any], *, key: str | None) -> np.ndarray:
    return np.fromiter((len(_field(x, key)) for x in samples), dtype=np.int64, count=len(samples))


def _flat_tokens(samples: list[Any], key: str | None) -> tuple[np.ndarray, np.ndarray]:
    parts = [_tokens(x, key) for x in samples]
    sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return flat, sizes


def _count_tokens_batch(acc: np.ndarray, samples: list[Any], *, key: str | None) -> None:
    flat, sizes = _flat_tokens(samples, key)
    _check_vocab(flat, len(acc), sizes)
    acc += np.bincount(flat, minlength=len(acc)).astype(acc.dtype)


def _neg_log_p(histogram: np.ndarray) -> np.ndarray:
    total = histogram.sum()
    with np.errstate(divide="ignore"):
        # Tokens never seen get +inf; they cannot occur in the analysed corpus anyway.
        return np.where(histogram > 0, -np.log(histogram / max(total, 1)), np.inf)


def _rarity(sample: Any, neg_log_p: np.ndarray, *, key: str | None) -> float:
    return float(neg_log_p[_tokens(sample, key)].sum())


def _rarity_batch(samples: list[Any], neg_log_p: np.ndarray, *, key: str | None) -> np.ndarray:
    flat, sizes = _flat_tokens(samples, key)
    out = np.zeros(len(samples), dtype=np.float64)
    for i, part in enumerate(np.split(neg_log_p[flat], np.cumsum(sizes)[:-1])):
        out[i] = part.sum()  # the same pairwise sum as ``_rarity``, so values match bit for bit
    return out


def seqlen(*, key: str | None = None, name: str = "seqlen") -> SampleMetric:
    """The sample's length: ``len(sample)`` or ``len(sample[key])``."""
    return SampleMetric(
        name=name, fn=partial(_len, key=key), dtype="int64", batch_fn=partial(_lens, key=key)
    )


def token_histogram(
    vocab_size: int, *, key: str | None = None, name: str = "token_histogram"
) -> AccumulatedMetric:
    """How often each token id in ``range(vocab_size)`` occurs in the corpus."""
    return AccumulatedMetric(
        name=name,
        fn=partial(_count_tokens, key=key),
        size=int(vocab_size),
        dtype="int64",
        batch_fn=partial(_count_tokens_batch, key=key),
    )


def vocab_rarity(
    vocab_size: int, *, key: str | None = None, name: str = "vocab_rarity"
) -> SampleMetric:
    """DeepSpeed's vocabulary rarity: ``sum(-log p(token))`` over the sample (two passes)."""
    return SampleMetric(
        name=name,
        fn=partial(_rarity, key=key),
        dtype="float64",
        requires=(token_histogram(vocab_size, key=key),),
        prepare=_neg_log_p,
        batch_fn=partial(_rarity_batch, key=key),
    )
