"""PackedSamples: a dataset of packed rows planned from the samples' lengths alone.

The plan is pure: samples are visited in a seeded permutation, cut into windows of ``window``
consecutive positions, and each window is packed (best fit decreasing or first fit) into rows
of at most ``max_tokens`` tokens, or of at most ``max_cost`` under a :class:`CostModel` (the
token-budget batches RL trainers use). The emptiest row of a window is packed again with the
next window, so only the last window leaves a partly filled row. Row ``r`` is a function of
``(seed, lengths, r)`` and the options; no sample is ever buffered. So a
:class:`~meshfeed.DataLoader` over it keeps its state a position, resumes exactly mid-epoch,
with workers, and on another data-parallel size with the same global batch of rows (the same
global token budget). The loader reshuffles the rows every epoch; which samples share a row
is the same every epoch (it depends on ``seed``, not on the epoch).

A sample longer than a row follows ``long_samples`` (see :mod:`meshfeed.balance.long_documents`):
``"refuse"`` names it, ``"truncate"`` keeps its head, ``"split"`` cuts it into pieces packed as
samples of their own (position ids keep counting). Samples without tokens are left out; each
sample whose length says 0 is read once at construction to confirm it is empty (one that holds
tokens is an error naming it, as a wrong length is when its row is read).

>>> rows = PackedSamples(samples, max_tokens=4096, lengths=lengths)  # doctest: +SKIP
>>> loader = DataLoader(rows, batch_size=1, collate_fn=merge_rows, mesh={"dp": 8})  # doctest: +SKIP
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from meshfeed.balance.cost import CostModel
from meshfeed.balance.long_documents import check_policy, piece_numbers
from meshfeed.balance.packing import (
    _check_budget,
    as_lengths,
    check_int,
    check_method,
    pack_windows,
)
from meshfeed.balance.samples import POSITION_IDS, SampleFields, assemble
from meshfeed.collate import PadCollate
from meshfeed.keys import DOCUMENT_IDS
from meshfeed.order.permutation import Permutation, check_seed, derive_seed
from meshfeed.protocols import FingerprintedSource, ItemsSource

__all__ = ["OUTPUTS", "PackedSamples", "SampleLengths"]

#: ``"packed"``: one row, fields concatenated with ``cu_seqlens``; ``"padded"``: the row's
#: samples as a ``[samples, longest]`` batch (:func:`~meshfeed.pad_collate`), for models without
#: variable-length attention.
OUTPUTS: tuple[str, ...] = ("packed", "padded")
#: Samples of length 0 read together when PackedSamples checks that they are empty.
_EMPTY_READS = 1024


@runtime_checkable
class SampleLengths(Protocol):
    """A dataset that reports its samples' token counts cheaply (e.g. ``TokenDocuments``)."""

    @property
    def lengths(self) -> Any: ...


def _resolve_lengths(dataset: Any, lengths: Any) -> np.ndarray:
    n = len(dataset)
    if lengths is None:
        if not isinstance(dataset, SampleLengths):
            raise ValueError(
                f"PackedSamples plans from the samples' lengths and {type(dataset).__name__} "
                "reports none; pass lengths=<array of tokens per sample> or lengths=<callable "
                "index -> tokens>, or give the dataset a .lengths property"
            )
        lengths = dataset.lengths
    elif callable(lengths):
        lengths = np.fromiter((int(lengths(i)) for i in range(n)), np.int64, n)
    arr = as_lengths(lengths, "lengths")
    if arr.size != n:
        raise ValueError(
            f"lengths has {arr.size} entries for a dataset of {n} samples; give one per sample"
        )
    return arr


def _longest_within(cost: CostModel, max_cost: float, max_tokens: int) -> int:
    """The longest sample whose cost is at most ``max_cost`` (capped at ``max_tokens``)."""
    a, q = cost.linear, cost.quadratic
    guess = max_cost / a if q == 0 else (-a + math.sqrt(a * a + 4 * q * max_cost)) / (2 * q)
    n = max_tokens if not guess < max_tokens else int(guess) + 1  # inf: every length fits
    while n > 0 and float(cost.work(np.array([n]))[0]) > max_cost:
        n -= 1
    return n


def _check_max_cost(max_cost: Any) -> float:
    """``max_cost`` as a float, or ValueError unless it is a finite number > 0."""
    if (
        isinstance(max_cost, bool)
        or not isinstance(max_cost, (int, float, np.integer, np.floating))
        or not math.isfinite(max_cost)
        or max_cost <= 0
    ):
        raise ValueError(
            f"max_cost must be a finite number > 0 (got {max_cost=!r}); pass the cost one row "
            "may hold under cost (e.g. cost.work([max_tokens])[0]), or pass neither cost nor "
            "max_cost for a token budget"
        )
    return float(max_cost)


def _units(lengths: np.ndarray, order: np.ndarray, limit: int, policy: str) -> tuple[Any, ...]:
    """The pieces to pack, in visiting order: (sample, start, length, position of the sample)."""
    s = lengths[order]
    over = np.flatnonzero(s > limit)
    if over.size and policy == "refuse":
        i = int(order[over[0]])
        raise ValueError(
            f"sample {i} has {int(lengths[i])} tokens, more than a row holds ({limit}); "
            "pass long_samples='split' or 'truncate', or raise the budget (max_tokens / max_cost)"
        )
    if policy == "truncate":
        s = np.minimum(s, limit)
    n = np.maximum(1, -(-s // limit)) if policy == "split" else np.ones(s.size, np.int64)
    n[s == 0] = 0  # samples without tokens are left out
    pos, k = piece_numbers(n)
    start = k * limit
    size = np.minimum(np.repeat(s, n) - start, limit)
    return order[pos], start, size, pos


class PackedSamples:
    """Packed rows of ``dataset``'s samples, planned at construction (see the module doc).

    ``dataset`` is map-style (``__len__``, ``__getitem__``, optionally ``__getitems__``) and
    yields mappings of fields named by ``fields``. Lengths come from ``lengths`` (an array or a
    callable ``index -> tokens``, called once per sample here) or the dataset's ``.lengths``;
    a sample whose first token field disagrees with them is an error naming it. ``window``
    samples are packed together (larger: fuller rows, more planning); ``method`` is
    ``"best_fit"`` (best fit decreasing) or ``"first_fit"`` (in order). With ``cost`` (a
    :class:`CostModel`) and ``max_cost``, rows hold samples whose summed cost fits ``max_cost``
    (``max_tokens`` then only bounds one sample). ``output="padded"`` gives each row as a
    padded batch of its samples instead (token fields only; one per loader step, as widths
    differ): a token-budget batch whose size varies. Planning costs O(n log window) once; an
    item costs one read of its samples and one concatenation per field.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        max_tokens: int,
        fields: SampleFields | None = None,
        lengths: Sequence[int] | np.ndarray | Callable[[int], int] | None = None,
        window: int = 1024,
        method: str = "best_fit",
        seed: int = 0,
        shuffle: bool = True,
        long_samples: str = "refuse",
        cost: CostModel | None = None,
        max_cost: float | None = None,
        output: str = "packed",
    ) -> None:
        self.dataset = dataset
        self.fields = SampleFields() if fields is None else fields
        if output not in OUTPUTS:
            raise ValueError(f"output={output!r} is not one of {OUTPUTS}")
        if output == "padded" and self.fields.carried:
            raise ValueError(
                "output='padded' pads token fields only; use output='packed' to carry "
                f"{list(self.fields.sample_fields + self.fields.concat_fields)}"
            )
        self.output = output
        self.max_tokens = _check_budget(max_tokens)
        self.method = check_method(method)
        self.policy = check_policy(long_samples)
        if self.fields.carried and self.policy != "refuse":
            raise ValueError(
                f"long_samples={long_samples!r} would cut samples away from their per-sample "
                f"fields {list(self.fields.sample_fields + self.fields.concat_fields)}; use "
                "long_samples='refuse' and a max_tokens that holds the longest sample"
            )
        self.seed = check_seed(seed)
        check_int("window", window, fix="; it is how many samples are packed together")
        self.window = window
        self.lengths = _resolve_lengths(dataset, lengths)
        if (cost is None) != (max_cost is None):
            raise ValueError(
                f"cost and max_cost go together (got {cost=}, {max_cost=}); pass both for a "
                "cost budget, or neither for a token budget"
            )
        limit = self.max_tokens
        if cost is not None and max_cost is not None:
            limit = _longest_within(cost, _check_max_cost(max_cost), self.max_tokens)
            if limit < 1:
                raise ValueError(f"max_cost={max_cost} is less than one token costs; raise it")
        order = np.arange(self.lengths.size, dtype=np.int64)
        if shuffle and order.size:
            order = Permutation(order.size, derive_seed(self.seed, 0))[order]
        self._check_empty(np.flatnonzero(self.lengths == 0))
        self._sample, self._start, size, pos = _units(self.lengths, order, limit, self.policy)
        self._size = size
        weights = size if cost is None else cost.work(size)
        bounds = np.searchsorted(pos, np.arange(0, order.size, window, dtype=np.int64))
        self._rows, self._members = pack_windows(
            weights,
            budget=self.max_tokens if max_cost is None else float(max_cost),
            window=window,
            method=method,
            bounds=np.append(bounds, size.size) if size.size else [0],
            carry=True,
        )
        digest = zlib.crc32(self.lengths.tobytes())
        self._key = (
            f"{self.max_tokens}:{window}:{method}:{self.seed}:{shuffle}:{self.policy}:"
            f"{cost}:{max_cost}:{output}:{digest:08x}"
        )

    def __len__(self) -> int:
        return int(self._rows.size - 1)

    def __repr__(self) -> str:
        return f"PackedSamples({len(self)} rows of {self.lengths.size} samples, {self._key})"

    @property
    def fingerprint(self) -> str:
        inner = self.dataset
        base = (
            inner.fingerprint
            if isinstance(inner, FingerprintedSource)
            else f"{type(inner).__name__}:{len(inner)}"
        )
        return f"packed:{base}:{self._key}"

    def row_units(self, r: int) -> np.ndarray:
        """The pieces of row ``r`` (indices into the plan), in packing order."""
        if not 0 <= r < len(self):
            raise IndexError(f"row {r} is out of range for {len(self)} packed rows")
        return self._members[self._rows[r] : self._rows[r + 1]]

    def row_samples(self, r: int) -> list[tuple[int, int, int]]:
        """Row ``r`` as ``(sample index, first token, end token)`` triples (no sample read)."""
        u = self.row_units(r)
        starts, sizes = self._start[u], self._size[u]
        return list(
            zip(self._sample[u].tolist(), starts.tolist(), (starts + sizes).tolist(), strict=True)
        )

    def __getitem__(self, r: int) -> dict[str, Any]:
        return self.__getitems__([r])[0]

    def __getitems__(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        plans = [self.row_samples(int(r)) for r in rows]
        wanted = sorted({i for plan in plans for i, _, _ in plan})
        samples = self._read(wanted)
        if self.output == "padded":
            return [self._padded(samples, plan) for plan in plans]
        return [
            assemble(
                [samples[i] for i, _, _ in plan],
                self.fields,
                ids=[i for i, _, _ in plan],
                spans=[(a, b) for _, a, b in plan],
            )
            for plan in plans
        ]

    def _read(self, wanted: list[int]) -> dict[int, Any]:
        """Samples ``wanted`` as mappings, each checked against its length."""
        read = (
            self.dataset.__getitems__(wanted)
            if isinstance(self.dataset, ItemsSource)
            else [self.dataset[i] for i in wanted]
        )
        samples = {i: self.fields.as_mapping(x, i) for i, x in zip(wanted, read, strict=True)}
        for i, sample in samples.items():
            n = self.fields.length(sample, i)
            if n != int(self.lengths[i]):
                raise ValueError(
                    f"sample {i} has {n} tokens in {self.fields.token_fields[0]!r} but its "
                    f"length says {int(self.lengths[i])}; the lengths must count that field"
                    + (
                        " (a sample of length 0 is left out of every row: PackedSamples reads "
                        "it once when it is built to confirm it is empty)"
                        if self.lengths[i] == 0
                        else ""
                    )
                )
        return samples

    def _check_empty(self, empty: np.ndarray) -> None:
        """Read the samples whose length is 0, which no row reads, to confirm they are empty:
        a wrong length of 0 would leave a sample's tokens out of every row."""
        for start in range(0, empty.size, _EMPTY_READS):
            self._read(empty[start : start + _EMPTY_READS].tolist())

    def _padded(self, samples: dict[int, Any], plan: list[tuple[int, int, int]]) -> dict[str, Any]:
        items = [
            {k: torch.as_tensor(samples[i][k])[a:b] for k in self.fields.token_fields}
            for i, a, b in plan
        ]
        made = POSITION_IDS not in self.fields.token_fields
        if made:
            # As in the packed output: a piece of a split sample keeps counting from its start
            # (PadCollate alone would restart every piece at 0).
            for item, (_, a, b) in zip(items, plan, strict=True):
                item[POSITION_IDS] = torch.arange(a, b, dtype=torch.int64)
        out = PadCollate()(items)
        if made:  # the key order PadCollate gives when it makes them
            out[POSITION_IDS] = out.pop(POSITION_IDS)
        out[DOCUMENT_IDS] = torch.tensor([i for i, _, _ in plan], dtype=torch.int64)
        return out
