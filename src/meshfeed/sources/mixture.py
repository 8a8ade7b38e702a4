"""Weighted mixtures of map-style sources with a low-discrepancy, arithmetic interleave.

``Mixture(sources, weights, seed=...)`` is a map-style dataset over the concatenation of its
sources (``len`` = sum of source lengths; index ``i`` routes to the source that holds it) and it
supplies its own order to the :class:`~meshfeed.DataLoader` through ``make_order``:

- The mixture stream is infinite; loader epoch ``e`` covers stream positions
  ``[e * samples_per_epoch, (e + 1) * samples_per_epoch)``. ``samples_per_epoch`` defaults to
  the sum of the source lengths rounded down to a whole number of global batches.
- Stream position ``g`` belongs to source ``source_of(g)``, given by an exact interleave of
  the float weights (:mod:`meshfeed.order.interleave`): every prefix holds each source within
  +-1 of its share (:attr:`Mixture.max_deviation` < 1) for any positive weights and any number
  of sources, with no drift. Simple-fraction weights, any weights of up to three sources and
  most others are pure arithmetic (O(K) per position, no table); the rest (some weightings of
  four or more sources) use Tijdeman's earliest-deadline interleave, which is sequential: a
  position costs a walk from the nearest known point (about 1 us per position). The loader
  walks forward batch by batch and its checkpoint carries the per-source counts, so resume
  stays O(1) in the position; random access far ahead of any known point (``counts(2**40)``)
  costs a walk of that length. Tiny weights keep their share, huge integers are normalised.
- The ``k``-th draw from source ``s`` reads element ``k % len_s`` of a fresh permutation of that
  source for source epoch ``k // len_s``: each source is reshuffled with its own epoch when it
  is exhausted, independently of the others and of the loader epoch.
- Weights may change from a given global step on: pass ``weights={0: {...}, 1000: {...}}`` or
  call ``reweight(step, weights)`` before iterating. Step ``t`` starts at stream position
  ``t * global_batch_size``; each segment restarts its interleave at the change and adds the
  counts reached there, so the +-1 promise holds per segment (for the positions since the
  change, against the segment's shares) and a resume across a change is exact. The whole schedule is in ``describe``
  (``loader.state_dict()["order"]``, with the per-source consumption at the position and at
  each change before it) and a resume with another
  schedule is refused; the fingerprint holds only the step-0 weights, so it does not change when
  ``reweight`` is called after a loader has recorded it. The loader-specific state (global batch
  size, how far it planned) lives in the :class:`MixtureOrder`, not in the mixture.
- A substitute for a bad or filtered sample (see ``on_error``) is drawn from the same source
  (:meth:`Mixture.substitute_span`), so the weights hold through substitutes; it is not gated
  by a curriculum.
- ``close()`` closes every source that has a ``close()`` (a stream's readers, files and held
  shards), all of them even if one raises.
"""

from __future__ import annotations

import hashlib
import json
import math
import reprlib
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshfeed.order.distinct import distinct
from meshfeed.order.interleave import MAX_PERIOD, Interleave, interleave_period, make_interleave
from meshfeed.order.permutation import check_seed
from meshfeed.protocols import ItemsSource, OrderedSource
from meshfeed.sources.mixture_order import MixtureOrder
from meshfeed.state import dataset_fingerprint

__all__ = ["MAX_PERIOD", "Mixture", "MixtureOrder", "interleave_period"]


def _source_lengths(names: list[str], sources: list[Any]) -> np.ndarray:
    """The length of each source, refused unless each is map-style and non-empty."""
    lengths = []
    for name, src in zip(names, sources, strict=True):
        try:
            n = len(src)
        except TypeError:
            raise TypeError(
                f"source {name!r} ({type(src).__name__}) has no len(); mixture sources must "
                "be map-style (__len__ and __getitem__)"
            ) from None
        if n < 1:
            raise ValueError(f"source {name!r} is empty; remove it or give it samples")
        lengths.append(n)
    return np.asarray(lengths, dtype=np.int64)


def _check_samples_per_epoch(samples_per_epoch: Any) -> int | None:
    """``samples_per_epoch`` as an int if it is None or a positive integer (a numpy one
    too; not a bool), else ``ValueError``."""
    if samples_per_epoch is None:
        return None
    if (
        isinstance(samples_per_epoch, bool)
        or not isinstance(samples_per_epoch, (int, np.integer))
        or samples_per_epoch < 1
    ):
        raise ValueError(
            f"samples_per_epoch must be a positive int or None (got {samples_per_epoch=!r})"
        )
    return int(samples_per_epoch)


def _source_names(sources: Mapping[Any, Any]) -> list[str]:
    """The sources' names as strings, refused where two keys give the same one (``1`` and
    ``"1"``): their weights, schedule and stats would merge."""
    names = [str(n) for n in sources]
    if len(set(names)) != len(names):
        same = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"source names {same} each name two sources (keys {list(sources)!r}); give every "
            "source its own name"
        )
    return names


def _weight_number(name: str, w: object) -> int | float:
    """One source's weight as an int (for int and numpy integer weights) or a float."""
    if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
        raise TypeError(f"weight of {name!r} must be a number (got {w!r}); e.g. 0.25")
    return int(w) if isinstance(w, (int, np.integer)) else float(w)


def _weights_usable(vec: list[int | float]) -> bool:
    """Every weight finite and >= 0, and at least one positive."""
    finite = all(not isinstance(w, float) or math.isfinite(w) for w in vec)
    return finite and all(w >= 0 for w in vec) and any(w > 0 for w in vec)


class Mixture:
    """A weighted, deterministic mixture of map-style sources (see the module docstring).

    >>> mix = Mixture({"a": list(range(10)), "b": list(range(100, 120))}, {"a": 1, "b": 3})
    >>> mix.source_of(np.arange(8)).tolist()
    [1, 1, 0, 1, 1, 1, 0, 1]
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | Mapping[int, Mapping[str, float]],
        *,
        seed: int = 0,
        samples_per_epoch: int | None = None,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise TypeError(
                "sources must be a non-empty dict name -> map-style source (got "
                f"{reprlib.repr(sources)}); e.g. Mixture({{'web': web, 'code': code}}, "
                "weights={'web': 3, 'code': 1})"
            )
        self.names = _source_names(sources)
        self.sources = [sources[n] for n in sources]
        self.lengths = _source_lengths(self.names, self.sources)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.seed = check_seed(seed)  # [0, 2**64): refused now, not at the first batch
        self.samples_per_epoch = _check_samples_per_epoch(samples_per_epoch)
        self._schedule: list[tuple[int, list[float]]] = []
        self._segments: list[Interleave] = []
        self._bases_cache: dict[int, np.ndarray] = {}
        # The loaders' orders over this mixture, asked before a reweight (they own their state).
        self._orders: weakref.WeakSet[MixtureOrder] = weakref.WeakSet()
        self._add_table(weights)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (sent to spawned worker processes and Ray actors): the loaders' orders,
        held weakly for ``reweight``, stay in this process."""
        state = dict(self.__dict__)
        state["_orders"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._orders = weakref.WeakSet()

    # ------------------------------------------------------------------ schedule
    def _add_table(self, weights: Mapping[str, float] | Mapping[int, Mapping[str, float]]) -> None:
        """Add the constructor's weights: one dict name -> weight, or a schedule step -> dict
        that starts at step 0."""
        table: Mapping[Any, Any] = weights
        if not isinstance(table, Mapping) or not table:
            raise TypeError(f"weights must be a dict name -> float (got {weights!r})")
        if not all(isinstance(v, Mapping) for v in table.values()):  # one table of weights
            self._add(0, table)
            return
        bad = [k for k in table if isinstance(k, bool) or not isinstance(k, (int, np.integer))]
        if bad:
            raise ValueError(
                f"a weight schedule is a dict step -> weights with int steps (got keys "
                f"{bad!r}); e.g. weights={{0: {{'web': 3, 'code': 1}}, 1000: {{...}}}}"
            )
        steps = sorted(int(k) for k in table)
        table = {int(k): v for k, v in table.items()}
        if steps[0] != 0:
            raise ValueError(
                f"a weight schedule must start at step 0 (got steps {steps}); add the "
                "weights for step 0"
            )
        for step in steps:
            self._add(int(step), table[step])

    def _weights_vector(self, weights: Mapping[str, float]) -> list[int | float]:
        """The weights in source order (ints stay ints), refused unless one number per source,
        finite, >= 0 and not all zero."""
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a dict name -> float (got {weights!r})")
        weights = {str(k): w for k, w in weights.items()}  # keyed as the sources (1 -> "1")
        unknown = set(weights) - set(self.names)
        missing = set(self.names) - set(weights)
        if unknown or missing:
            raise ValueError(
                f"weights name {sorted(map(str, unknown))} which are not sources and miss "
                f"{sorted(missing)}; give one weight per source {self.names}"
            )
        vec = [_weight_number(n, weights[n]) for n in self.names]
        if not _weights_usable(vec):
            raise ValueError(
                f"weights must be finite, >= 0 and not all zero (got {dict(weights)}); "
                "use a positive weight for at least one source"
            )
        return vec

    def _add(self, step: int, weights: Mapping[str, float]) -> None:
        vec = self._weights_vector(weights)
        if self._schedule and step <= self._schedule[-1][0]:
            raise ValueError(
                f"reweight step {step} is not after the last change at step "
                f"{self._schedule[-1][0]}; give changes in increasing step order"
            )
        self._schedule.append((step, vec))
        self._segments.append(make_interleave(vec))
        self._bases_cache.clear()
        for order in list(self._orders):
            order.schedule_changed()

    def _drop_changes_from(self, count: int) -> None:
        """Keep the first ``count`` changes of the schedule (a checkpoint's changes adopted,
        then refused: the mixture as it was)."""
        if len(self._schedule) <= count:
            return
        del self._schedule[count:], self._segments[count:]
        self._bases_cache.clear()
        for order in list(self._orders):
            order.schedule_changed()

    def reweight(self, step: int, weights: Mapping[str, float]) -> None:
        """Use ``weights`` from global step ``step`` on (declare it before iterating past it)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ValueError(f"step must be an int >= 1 (got {step=!r}); step 0 is the start")
        for order in list(self._orders):
            order.check_reweight(int(step))
        self._add(int(step), weights)

    @property
    def schedule(self) -> list[tuple[int, dict[str, float]]]:
        """The weight schedule: ``[(step, {name: weight}), ...]`` starting at step 0."""
        return [(s, dict(zip(self.names, w, strict=True))) for s, w in self._schedule]

    @property
    def shares(self) -> list[dict[str, float]]:
        """The shares each schedule segment holds (normalised weights; see the module doc)."""
        return [
            {n: float(q) for n, q in zip(self.names, seg.shares, strict=True)}
            for seg in self._segments
        ]

    @property
    def max_deviation(self) -> list[float]:
        """Per segment, the proven bound on ``|count - n * share|`` of any source and prefix.

        Always below 1: the +-1 promise holds for every prefix (up to 2**40 positions for
        weights read as simple fractions); see :mod:`meshfeed.order.interleave`.
        """
        return [seg.max_deviation for seg in self._segments]

    def schedule_json(self) -> list[list[Any]]:
        """The weight schedule as JSON values (what a loader checkpoint records)."""
        return [[s, w] for s, w in self._schedule]

    # ------------------------------------------------------------------ map-style access
    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int | np.ndarray) -> tuple[Any, Any]:
        """``(source number, index within that source)`` of a concatenated index."""
        arr = np.asarray(index, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= len(self)):
            raise IndexError(f"mixture index out of range for length {len(self)} (got {index})")
        s = np.searchsorted(self.offsets, arr, side="right") - 1
        local = arr - self.offsets[s]
        if arr.ndim == 0:
            return int(s), int(local)
        return s, local

    def __getitem__(self, index: int) -> Any:
        s, local = self.locate(int(index))
        return self.sources[s][local]

    def substitute_span(self, index: int) -> tuple[int, int]:
        """``(first index, length)`` of the indices a substitute for sample ``index`` is drawn
        from: its source's (a nested mixture's: its own source's), so the weights hold
        through bad samples and filters (see ``on_error``)."""
        s, local = self.locate(int(index))
        lo, n = int(self.offsets[s]), int(self.lengths[s])
        inner = getattr(self.sources[s], "substitute_span", None)
        if callable(inner):
            at, n = inner(local)
            lo += int(at)
        return lo, int(n)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        src, local = self.locate(np.asarray(indices, dtype=np.int64))
        out: list[Any] = [None] * len(indices)
        for s in distinct(src).tolist():
            where = np.flatnonzero(src == s)
            source = self.sources[s]
            ids = local[where].tolist()
            if isinstance(source, ItemsSource):
                items = source.__getitems__(ids)
            else:
                items = [source[i] for i in ids]
            for w, item in zip(where.tolist(), items, strict=True):
                out[w] = item
        return out

    def close(self) -> None:
        """Close every source that has a ``close()`` (a :class:`ShardedStream`'s readers, open
        files and held cached shards; a nested mixture's sources), in this process.

        Every source is closed even if one raises: the first error is raised after the last
        source, naming its source (later errors are added as notes). Calling it again closes
        again, which is a no-op for a closed stream; reading after it re-opens what a stream
        needs, as :meth:`ShardedStream.close` does."""
        first: Exception | None = None
        for name, src in zip(self.names, self.sources, strict=True):
            close = getattr(src, "close", None)
            if not callable(close):
                continue
            try:
                close()
            except Exception as e:  # the other sources are closed all the same
                if first is None:
                    first = e
                    e.add_note(f"raised closing source {name!r} of the Mixture")
                else:
                    first.add_note(f"closing source {name!r} also raised {e!r}")
        if first is not None:
            raise first

    @property
    def fingerprint(self) -> str:
        """Sources, seed, epoch size and step-0 weights.

        Later weight changes are left out: a loader records the fingerprint when it is built,
        and ``reweight`` may follow; the full schedule is checked on resume by
        :meth:`MixtureOrder.validate`.
        """
        h = hashlib.blake2b(digest_size=10)
        for name, src in zip(self.names, self.sources, strict=True):
            h.update(f"{name}={dataset_fingerprint(src)};".encode())
        h.update(json.dumps([self.seed, self.samples_per_epoch, self._schedule[0][1]]).encode())
        return f"mixture:{len(self)}:{h.hexdigest()}"

    # ------------------------------------------------------------------ arithmetic order
    def _segment_starts(self, G: int) -> np.ndarray:
        return np.array([s * G for s, _ in self._schedule], dtype=np.int64)

    def _bases(self, G: int) -> np.ndarray:
        """Per-segment, per-source counts of the stream before each segment starts."""
        cached = self._bases_cache.get(G)
        if cached is not None:
            return cached
        starts = self._segment_starts(G)
        bases = np.zeros((len(starts), len(self.names)), dtype=np.int64)
        for j in range(1, len(starts)):
            bases[j] = bases[j - 1] + self._segments[j - 1].counts(starts[j] - starts[j - 1])
        self._bases_cache[G] = bases
        return bases

    def _ordered_sources(self) -> dict[int, Any]:
        """The sources with an order of their own (a ShardedStream, a nested mixture), by
        index: a :class:`MixtureOrder` walks each of them with it.

        The Protocol check (~50 us) is made once per class, not per source: 10,000 corpora
        of one class cost one check (#32).
        """
        ordered: dict[type, bool] = {}
        out = {}
        for s, src in enumerate(self.sources):
            cls = type(src)
            if cls not in ordered:
                ordered[cls] = isinstance(src, OrderedSource)
            if ordered[cls]:
                out[s] = src
        return out

    def _resolve_g(self, global_batch_size: int | None) -> int:
        if global_batch_size is None and len(self._schedule) > 1:
            raise ValueError(
                "this mixture has a weight schedule in steps; pass global_batch_size= "
                "(or use it through a DataLoader) to place the changes in the stream"
            )
        return 1 if global_batch_size is None else int(global_batch_size)

    def draws(
        self, positions: np.ndarray, *, global_batch_size: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` for stream positions: position g is the k-th draw of its source."""
        G = self._resolve_g(global_batch_size)
        g = np.asarray(positions, dtype=np.int64)
        starts = self._segment_starts(G)
        bases = self._bases(G)
        seg_of = np.searchsorted(starts, g, side="right") - 1
        src = np.empty(g.shape, dtype=np.int64)
        k = np.empty(g.shape, dtype=np.int64)
        for j in distinct(seg_of).tolist():
            where = seg_of == j
            s, rank = self._segments[j].draws(g[where] - starts[j])
            src[where] = s
            k[where] = bases[j][s] + rank
        return src, k

    def source_of(
        self, positions: np.ndarray, *, global_batch_size: int | None = None
    ) -> np.ndarray:
        """The source number of each global stream position (O(1) arithmetic per position)."""
        return self.draws(positions, global_batch_size=global_batch_size)[0]

    def counts(self, position: int, *, global_batch_size: int | None = None) -> dict[str, int]:
        """How many of the first ``position`` stream positions each source supplies."""
        G = self._resolve_g(global_batch_size)
        starts = self._segment_starts(G)
        j = int(np.searchsorted(starts, position, side="right") - 1)
        c = self._bases(G)[j] + self._segments[j].counts(position - starts[j])
        return dict(zip(self.names, c.tolist(), strict=True))

    def make_order(
        self, *, dataset_length: int, global_batch_size: int, seed: int, shuffle: bool = True
    ) -> MixtureOrder:
        """The loader hook: an :class:`MixtureOrder` for this global batch size and seed."""
        if not shuffle:
            raise ValueError(
                "shuffle=False with dataset=Mixture (it has its own order, make_order) would be "
                "ignored: that order is defined by the dataset, not by a shuffle; drop "
                "shuffle=False (for an unshuffled walk use a plain dataset without curriculum)"
            )
        order = MixtureOrder(self, global_batch_size=global_batch_size, seed=seed)
        self._orders.add(order)
        return order
