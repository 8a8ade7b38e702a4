"""Documents longer than a DP x CP group can hold: refuse them, truncate them or split them.

:func:`max_document_tokens` is the longest document :func:`~meshfeed.balance.schedule_documents`
can place (every rank of the largest allowed CP group holding ``max_tokens``, after padding).
A policy decides what happens to a longer one:

- ``"refuse"``: an error naming the document (its corpus id where the sample carries them);
- ``"truncate"``: its first ``limit`` tokens are kept, the rest dropped;
- ``"split"``: it becomes consecutive pieces of at most ``limit`` tokens, in order, each a
  document of its own (attention does not cross pieces; ``position_ids`` keep counting).

:func:`fit_lengths` applies a policy to lengths (the ``plan`` CLI), :func:`fit_sample` to a
packed sample (what :class:`~meshfeed.balance.BalancedBatches` does before balancing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from meshfeed.balance.document_fields import split_fields
from meshfeed.balance.packing import check_int
from meshfeed.balance.schedule import _candidate_sizes
from meshfeed.keys import DOCUMENT_IDS

__all__ = [
    "DOCUMENT_IDS",
    "LONG_DOCUMENT_POLICIES",
    "LongDocumentPolicy",
    "fit_lengths",
    "fit_sample",
    "max_document_tokens",
]

LongDocumentPolicy = Literal["refuse", "truncate", "split"]
LONG_DOCUMENT_POLICIES: tuple[str, ...] = ("refuse", "truncate", "split")


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`LONG_DOCUMENT_POLICIES`, else ValueError naming them."""
    if policy not in LONG_DOCUMENT_POLICIES:
        raise ValueError(
            f"long_documents={policy!r} is not a policy; use one of "
            f"{', '.join(map(repr, LONG_DOCUMENT_POLICIES))}"
        )
    return policy


def max_document_tokens(
    *, num_ranks: int, max_tokens: int, cp_sizes: str | Sequence[int] = "any", tp: int = 1
) -> int:
    """The longest document ``schedule_documents`` places with these arguments.

    >>> max_document_tokens(num_ranks=3, max_tokens=32768)
    98304
    """
    check_int("num_ranks", num_ranks, fix="; count the ranks of the DP x CP group")
    check_int("max_tokens", max_tokens, fix="; pass the per-rank token budget")
    check_int("tp", tp, fix="; use 1 without sequence parallelism")
    sizes = _candidate_sizes(cp_sizes, int(num_ranks))[0][0]
    unit = np.where(sizes > 1, 2 * sizes * int(tp), int(tp))
    return int(((int(max_tokens) * sizes) // unit * unit).max())


def _pieces(lengths: np.ndarray, limit: int) -> np.ndarray:
    """How many pieces of at most ``limit`` tokens each document becomes (at least 1)."""
    return np.maximum(1, -(-lengths // limit))


def piece_numbers(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``n[i]`` pieces of document ``i``, in order: each piece's document and its number."""
    doc = np.repeat(np.arange(n.size, dtype=np.int64), n)
    return doc, np.arange(doc.size, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)


def fit_lengths(lengths: Any, limit: int, policy: str) -> np.ndarray:
    """Lengths after the policy: truncated to ``limit``, or split into pieces in order.

    >>> fit_lengths([5, 12], 4, "split").tolist()
    [4, 1, 4, 4, 4]
    """
    s = np.asarray(lengths, dtype=np.int64)
    check_policy(policy)
    if policy == "refuse" or s.max(initial=0) <= limit:
        return s
    if policy == "truncate":
        return np.minimum(s, limit)
    doc, k = piece_numbers(_pieces(s, limit))
    return np.minimum(s[doc] - k * limit, limit)


def fit_sample(
    sample: Mapping[str, Any],
    keys: Sequence[str],
    limit: int,
    policy: str,
    document_fields: Sequence[str] = (),
) -> Mapping[str, Any]:
    """A packed sample with documents over ``limit`` tokens truncated or split (refuse: as is).

    Per-token ``keys`` lose the truncated tokens; ``cu_seqlens`` gains the piece boundaries;
    ``document_ids`` (when present) repeat the corpus id for every piece, and every piece
    holds all of its document's rows of each of ``document_fields`` (a truncated document
    keeps them all).
    """
    check_policy(policy)
    cu = np.asarray(torch.as_tensor(sample["cu_seqlens"]).cpu(), dtype=np.int64).ravel()
    lengths = np.diff(cu)
    if policy == "refuse" or lengths.max(initial=0) <= limit:
        return sample
    out = dict(sample)
    if policy == "split":
        n = _pieces(lengths, limit)
        doc, piece = piece_numbers(n)
        starts = cu[doc] + limit * piece
        out["cu_seqlens"] = torch.from_numpy(np.append(starts, cu[-1]).astype(np.int32))
        repeat = torch.from_numpy(n)
        split_fields(out, document_fields, doc)
    else:
        pos = np.arange(int(cu[-1])) - np.repeat(cu[:-1], lengths)
        keep = torch.from_numpy(pos < limit)
        for k in keys:
            out[k] = sample[k][keep]
        kept = np.minimum(lengths, limit)
        out["cu_seqlens"] = torch.from_numpy(np.append(0, np.cumsum(kept)).astype(np.int32))
        repeat = torch.ones(lengths.size, dtype=torch.int64)
    if DOCUMENT_IDS in sample:
        ids = torch.as_tensor(sample[DOCUMENT_IDS])
        out[DOCUMENT_IDS] = torch.repeat_interleave(ids, repeat)
    return out
