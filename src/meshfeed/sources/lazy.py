"""LazyDataset: per-item preprocessing recorded now, run at fetch time where the data is.

``LazyDataset(source).map(fn).filter(pred).encode(tokenizer)`` records the operations; each
call returns a new, immutable LazyDataset. ``ds[i]`` reads ``source[i]`` and applies them, in
the process that fetches the batch (a worker process or a Ray actor), so nothing is
preprocessed twice or ahead of time. It is map-style (``len`` is the source's), so it shuffles,
shards, resumes and mixes (as a :class:`~meshfeed.Mixture` source) like any other dataset.

- A ``filter`` that rejects an item, or a ``map`` that returns None, makes ``ds[i]`` return
  None: the loader then substitutes a deterministic replacement (``on_error``), so every rank
  still takes the same number of steps with full batches.
- ``random_map(fn)`` calls ``fn(item, rng)`` with a numpy Generator keyed on the loader's
  ``(seed, epoch, index)`` (:func:`meshfeed.sample_rng`): the same on every rank, worker and
  resume. Outside a loader fetch the key uses seed 0, epoch 0. The j-th ``random_map`` of a
  chain uses its own stream.
- ``__getitems__`` reads the source in one batched call when the source supports it and
  reports an item whose operation raised as :class:`~meshfeed.fetch.Failed`, so the rest of
  the batch is kept and no sample is read twice.
- Over a source with an order of its own (a :class:`~meshfeed.Mixture`, a
  :class:`~meshfeed.sources.ShardedStream`) the LazyDataset walks that order: the loader gets
  the source's ``make_order``, so a mixture keeps its weights, schedule, ``reweight`` and
  checkpointed state, and a stream keeps its shard order (#28).
- Functions must be picklable for ``spawn`` workers and Ray (module-level functions or
  ``functools.partial``); with the default ``fork`` workers lambdas work too.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from meshfeed.fetch import Failed
from meshfeed.order.permutation import derive_seed
from meshfeed.protocols import ItemsSource, OrderedSource, Source, TextEncoder
from meshfeed.rng import fetch_info, sample_rng
from meshfeed.sources.tokens.tokenizer import token_ids
from meshfeed.state import dataset_fingerprint

__all__ = ["LazyDataset", "OrderedLazyDataset"]

_RANDOM_OP = 0x524D


class _Encode:
    """Tokenise text with ``tokenizer``: ``.encode(text)`` or ``tokenizer(text)``, returning ids,
    an object with ``.ids`` (HF ``tokenizers.Encoding``) or a mapping with ``"input_ids"``."""

    def __init__(self, tokenizer: Any, field: str, output: str) -> None:
        self.tokenizer, self.field, self.output = tokenizer, field, output
        self._encode = tokenizer.encode if isinstance(tokenizer, TextEncoder) else tokenizer

    def _ids(self, text: Any) -> np.ndarray:
        return token_ids(self._encode(text))

    def __call__(self, item: Any) -> Any:
        if isinstance(item, (str, bytes)):
            return self._ids(item)
        if isinstance(item, Mapping):
            if self.field not in item:
                raise KeyError(
                    f"encode(field={self.field!r}) found no such key in an item with keys "
                    f"{sorted(map(str, item))}; pass the text field as encode(..., field=...)"
                )
            return {**item, self.output: self._ids(item[self.field])}
        raise TypeError(
            f"encode() needs a str or a dict with a {self.field!r} field (got "
            f"{type(item).__name__}); map the item to text first"
        )

    def __repr__(self) -> str:
        return f"encode({type(self.tokenizer).__name__}, field={self.field!r})"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _name(fn: Any) -> str:
    """``fn`` as the same text in every process (it goes into the dataset's fingerprint, which
    a checkpoint is checked against in the next run and on every rank): a function's
    qualified name; a ``functools.partial`` as its function's name and its arguments; another
    callable as its repr, or, where that repr holds a memory address (no ``__repr__`` of its
    own), its class's qualified name and its attributes."""
    if isinstance(fn, functools.partial):
        args = [_value(a) for a in fn.args]
        args += [f"{k}={_value(v)}" for k, v in sorted(fn.keywords.items())]
        return f"partial({', '.join([_name(fn.func), *args])})"
    qualname = getattr(fn, "__qualname__", None)
    if qualname:
        return str(qualname)
    return _value(fn)


def _value(value: Any) -> str:
    """``value``'s repr without memory addresses (see :func:`_name`)."""
    text = repr(value)
    if not _ADDRESS.search(text):
        return text
    if callable(value) and getattr(value, "__qualname__", None):
        return str(value.__qualname__)
    attrs = getattr(value, "__dict__", None)
    described = "" if not attrs else repr(sorted((k, _value(v)) for k, v in attrs.items()))
    return _ADDRESS.sub("", f"{type(value).__qualname__}({described})")


class LazyDataset:
    """A map-style dataset whose items are transformed at fetch time (see the module docstring).

    >>> ds = LazyDataset(range(10)).map(lambda x: x * 10).filter(lambda x: x % 20 == 0)
    >>> len(ds), ds[2], ds[3]
    (10, 20, None)
    """

    __slots__ = ("_ops", "source")
    source: Any
    _ops: tuple[tuple[str, Any], ...]

    def __new__(cls, source: Any = None, _ops: tuple[tuple[str, Any], ...] = ()) -> LazyDataset:
        # Over a source with its own order the dataset is an OrderedLazyDataset, so every
        # caller that asks for an order (loaders, mixtures, Ray actors) gets the source's.
        inner = source.source if isinstance(source, LazyDataset) else source
        if cls is LazyDataset and isinstance(inner, OrderedSource):
            cls = OrderedLazyDataset
        return object.__new__(cls)

    def __init__(self, source: Any, _ops: tuple[tuple[str, Any], ...] = ()) -> None:
        if isinstance(source, LazyDataset):
            source, _ops = source.source, source._ops + _ops
        if not isinstance(source, Source):
            raise TypeError(
                f"LazyDataset needs a map-style source with __len__ and __getitem__ (got "
                f"{type(source).__name__}); wrap streams with meshfeed.sources.ShardedStream"
            )
        self.source = source
        self._ops = _ops

    # ------------------------------------------------------------------ recording
    def _with(self, kind: str, fn: Any) -> LazyDataset:
        if not callable(fn):
            raise TypeError(f"{kind}() needs a callable (got {fn!r})")
        return LazyDataset(self.source, (*self._ops, (kind, fn)))

    def map(self, fn: Callable[[Any], Any]) -> LazyDataset:
        """Apply ``fn(item)``; returning None rejects the item (it is substituted)."""
        return self._with("map", fn)

    def filter(self, pred: Callable[[Any], bool]) -> LazyDataset:
        """Keep items where ``pred(item)`` is true; the others are substituted by the loader."""
        return self._with("filter", pred)

    def random_map(self, fn: Callable[[Any, np.random.Generator], Any]) -> LazyDataset:
        """Apply ``fn(item, rng)`` with ``rng`` keyed on the loader's (seed, epoch, index)."""
        return self._with("random_map", fn)

    def encode(
        self, tokenizer: Any, *, field: str = "text", output: str = "input_ids"
    ) -> LazyDataset:
        """Tokenise: a str item becomes an int64 array; a dict gains ``output`` from ``field``."""
        if not (isinstance(tokenizer, TextEncoder) or callable(tokenizer)):
            raise TypeError(
                f"encode() needs a tokenizer with .encode(text) or a callable (got {tokenizer!r})"
            )
        return self._with("map", _Encode(tokenizer, field, output))

    @property
    def ops(self) -> list[str]:
        """The recorded operations, in order (for logs and fingerprints)."""
        return [f"{kind}({_name(fn)})" for kind, fn in self._ops]

    def __repr__(self) -> str:
        chain = "".join(f".{op}" for op in self.ops)
        return f"LazyDataset({type(self.source).__name__}[{len(self.source)}]){chain}"

    # ------------------------------------------------------------------ map-style access
    def __len__(self) -> int:
        return len(self.source)

    def _apply(self, index: int, item: Any) -> Any:
        random_ops = 0
        for kind, fn in self._ops:
            if item is None:
                return None
            if kind == "map":
                item = fn(item)
            elif kind == "filter":
                if not fn(item):
                    return None
            else:
                key = index if random_ops == 0 else derive_seed(_RANDOM_OP, random_ops, index)
                random_ops += 1
                item = fn(item, _rng(key))
        return item

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        return self._apply(index, self.source[index])

    def __getitems__(self, indices: list[int]) -> list[Any]:
        out: list[Any] = []
        if not isinstance(self.source, ItemsSource):
            for index in indices:
                try:
                    out.append(self[index])
                except Exception as exc:  # one bad item must not cost the rest of the batch
                    out.append(Failed(exc))
            return out
        raw = self.source.__getitems__(indices)
        for index, item in zip(indices, raw, strict=True):
            if isinstance(item, Failed):  # the source already reported it (e.g. a Mixture)
                out.append(item)
                continue
            try:
                out.append(self._apply(int(index), item))
            except Exception as exc:  # one bad item must not cost the rest of the batch
                out.append(Failed(exc))
        return out

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(dataset_fingerprint(self.source).encode(), digest_size=8)
        h.update(";".join(self.ops).encode())
        return f"lazy:{len(self)}:{h.hexdigest()}"

    def substitute_span(self, index: int) -> tuple[int, int]:
        """Where a substitute for sample ``index`` is drawn from: the source's span for it (a
        mixture's: that sample's source), else every index."""
        inner = getattr(self.source, "substitute_span", None)
        return inner(index) if callable(inner) else (0, len(self))


class OrderedLazyDataset(LazyDataset):
    """A :class:`LazyDataset` over a source with an order of its own: it walks that order.

    ``LazyDataset(source)`` returns one when ``source`` is an
    :class:`~meshfeed.protocols.OrderedSource`; the indices that order yields are the source's,
    which this dataset serves transformed.
    """

    __slots__ = ()

    def make_order(self, **kwargs: Any) -> Any:
        """The source's order (the loader's ``shuffle=False`` check reads the source's own)."""
        return self.source.make_order(**kwargs)


def _rng(key: int) -> np.random.Generator:
    if fetch_info() is None:
        return sample_rng(key, seed=0, epoch=0)
    return sample_rng(key)
