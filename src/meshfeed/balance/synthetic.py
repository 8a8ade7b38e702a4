"""Synthetic document-length distributions for planning experiments and the ``plan`` CLI.

Two heavy-tailed families: ``lognormal`` (web text) and ``longtail`` (many 512 to 4k documents
with a few 32k to 128k ones, as in long-context mixtures). A batch is drawn until its tokens
reach a target, so every batch fills about the same number of micro-steps.

>>> lengths = sample_batch("longtail", tokens=100_000, seed=0)
>>> int(lengths.sum()) >= 100_000
True
"""

from __future__ import annotations

import numpy as np

from meshfeed.order.permutation import derive_seed

__all__ = ["DISTRIBUTIONS", "sample_batch", "sample_lengths"]

DISTRIBUTIONS = ("lognormal", "longtail")


def sample_lengths(
    kind: str,
    n: int,
    *,
    seed: int = 0,
    max_length: int = 131_072,
    median: int = 1024,
    sigma: float = 1.0,
    long_fraction: float = 0.01,
) -> np.ndarray:
    """``n`` document lengths (int64, 1 .. max_length) from distribution ``kind``.

    ``lognormal``: median ``median``, log-space spread ``sigma``. ``longtail``: a fraction
    ``long_fraction`` uniform in [32k, 128k] (capped at ``max_length``), the rest log-uniform
    in [512, 4096].
    """
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {kind!r}; choose from {DISTRIBUTIONS}")
    if n < 0:
        raise ValueError(f"n must be >= 0 (got {n=})")
    rng = np.random.default_rng(derive_seed(seed, DISTRIBUTIONS.index(kind)))
    if kind == "lognormal":
        x = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    else:
        short = np.exp(rng.uniform(np.log(512), np.log(4096), size=n))
        long = rng.uniform(32_768, 131_072, size=n)
        x = np.where(rng.random(n) < long_fraction, long, short)
    return np.clip(np.rint(x), 1, max_length).astype(np.int64)


def sample_batch(kind: str, *, tokens: int, seed: int = 0, **kwargs: float) -> np.ndarray:
    """Draw documents from ``kind`` until their lengths sum to at least ``tokens``."""
    if tokens < 1:
        raise ValueError(f"tokens must be positive (got {tokens=})")
    draw = max(16, tokens // 1000)
    out = sample_lengths(kind, draw, seed=seed, **kwargs)  # type: ignore[arg-type]
    part = 1
    while out.sum() < tokens:
        more = sample_lengths(kind, draw, seed=derive_seed(seed, part), **kwargs)  # type: ignore[arg-type]
        out = np.concatenate([out, more])
        part += 1
    stop = int(np.searchsorted(np.cumsum(out), tokens)) + 1
    return out[:stop]
