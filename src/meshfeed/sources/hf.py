"""A Hugging Face ``datasets.Dataset`` as a map-style source with batched reads (``pip install meshfeed[hf]``).

``HFSource.__getitems__`` asks the Arrow-backed dataset for all rows of a batch in one call
(``dataset[list_of_indices]``, a single Arrow ``take``) instead of one ``__getitem__`` per row,
then turns the column dict into one dict per row. ``datasets`` is imported lazily.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from meshfeed.errors import SourceError

__all__ = ["FormatChangedError", "HFSource"]

Row = dict[str, Any]

#: ``Dataset.with_format`` types whose rows and batches are tables, not dicts of values
_TABLE_FORMATS = frozenset({"arrow", "pandas", "polars"})


class FormatChangedError(SourceError, ValueError):
    """The dataset's format was changed in place to a table format after its
    :class:`HFSource` was made. A :class:`~meshfeed.errors.SourceError`, so the loader
    raises it rather than substituting every sample; a ``ValueError``, as the same refusal
    is when the source is made."""


def _nulls_matter(column: Any) -> bool:
    """Whether an Arrow column holds a null that formatting a batch as a whole could turn
    into another value or dtype than its row's own (an int column's null makes the batch
    float; a float's is NaN in a batch, None alone): any null, nested ones included, but in
    a string or binary column (None in a batch as alone)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return bool(column.null_count) or _nulls_matter(pc.list_flatten(column))
    if pa.types.is_struct(t):
        return bool(column.null_count) or any(_nulls_matter(f) for f in column.flatten())
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    ):
        return False
    return bool(column.null_count)


def _same_kind(a: Any, b: Any) -> bool:
    """Whether two formatted values have one type and, for arrays and tensors, one dtype."""
    return type(a) is type(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "meshfeed's Hugging Face source needs the datasets package; install the extra: "
            "pip install meshfeed[hf]"
        ) from e
    return datasets


class HFSource:
    """Map-style rows (``dict`` column -> value) over a random-access ``datasets.Dataset``.

    ``columns`` keeps only those columns (all by default). The dataset's format is respected
    where a row is a dict of values: the default (Python objects), ``with_format("numpy")``
    (arrays per row), ``"torch"`` (tensors per row), ``"tensorflow"``, ``"jax"`` and a
    transform (``with_transform``); ``src[i]`` and ``src.__getitems__`` give the same rows.
    A table format (``"arrow"``, ``"pandas"``, ``"polars"``) is refused by name when the
    source is made (a row there is a one-row table, not a dict of values): pass
    ``dataset.with_format(None)``, ``"numpy"`` or ``"torch"``; and at every read, should
    ``dataset.set_format`` (in place) make the format a table format later
    (:class:`FormatChangedError`, which the loader never substitutes). Iterable and dict
    datasets are rejected: choose a split (``ds["train"]``), or stream an ``IterableDataset``
    with a meshfeed stream.

    >>> src = HFSource(datasets.Dataset.from_dict({"text": ["a", "b"]}))  # doctest: +SKIP
    >>> src.__getitems__([1, 0])  # doctest: +SKIP
    [{'text': 'b'}, {'text': 'a'}]
    """

    def __init__(self, dataset: Any, *, columns: Sequence[str] | None = None) -> None:
        ds = _datasets()
        if isinstance(dataset, ds.DatasetDict):
            raise TypeError(
                f"got a DatasetDict with splits {sorted(dataset)}; pick one, e.g. "
                "HFSource(dataset['train'])"
            )
        if isinstance(dataset, ds.IterableDataset):
            raise TypeError(
                "got a datasets.IterableDataset, which is not random access; load it without "
                "streaming=True or read it through a meshfeed stream"
            )
        if not isinstance(dataset, ds.Dataset):
            raise TypeError(
                f"dataset must be a datasets.Dataset (got {type(dataset).__name__}); wrap plain "
                "data with datasets.Dataset.from_dict"
            )
        kind = dataset.format["type"]
        if kind in _TABLE_FORMATS:
            raise ValueError(
                f"the dataset has format {kind!r}, whose rows are one-row tables, not dicts of "
                "values; pass dataset.with_format(None) (Python objects), "
                'dataset.with_format("numpy") or dataset.with_format("torch")'
            )
        if columns is not None:
            missing = [c for c in columns if c not in dataset.column_names]
            if missing:
                raise ValueError(
                    f"columns {missing} are not in the dataset (columns: "
                    f"{dataset.column_names}); pick existing columns"
                )
            dataset = dataset.select_columns(list(columns))
        self.dataset = dataset
        # Each read checks the format again (set_format changes it in place, after this
        # check): one attribute read where the dataset keeps its type as ``_format_type``
        # (it does, up to datasets 5 at least), else the public ``format`` dict.
        self._kind_attr = getattr(dataset, "_format_type", object()) == dataset.format["type"]

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def column_names(self) -> list[str]:
        return list(self.dataset.column_names)

    @property
    def fingerprint(self) -> str:
        """The dataset's own content fingerprint (``Dataset._fingerprint``) and its length."""
        return f"hf:{len(self)}:{getattr(self.dataset, '_fingerprint', 'unknown')}"

    def __getitem__(self, i: int) -> Row:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        self._check_format()
        return dict(self.dataset[int(i) % n])

    def __getitems__(self, indices: Sequence[int]) -> list[Row]:
        """Rows at ``indices`` in order, read with one batched lookup."""
        idx = np.asarray(indices)
        n = len(self)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise TypeError(f"indices must be a 1-D integer sequence (got shape {idx.shape})")
        if idx.size == 0:
            return []
        if int(idx.min()) < -n or int(idx.max()) >= n:
            raise IndexError(f"indices span [{int(idx.min())}, {int(idx.max())}], outside [0, {n})")
        kind = self._check_format()
        keys = (idx % n).tolist()
        if kind is not None and kind != "python":
            return self._formatted_rows(keys)
        batch = self.dataset[keys]  # Python objects: a batch's values are its rows' values
        names = list(batch)
        return [{k: batch[k][j] for k in names} for j in range(idx.shape[0])]

    def _formatted_rows(self, keys: list[int]) -> list[Row]:
        """Rows in a tensor format (numpy, torch, ...) as ``dataset[i]`` formats them, from one
        Arrow take. ``datasets`` formats a batch (``dataset[keys]``) as a whole, where a value
        can depend on the other rows (an int column holding a null in the batch becomes
        float32: 16777217 -> 16777216.0; numpy batches make float64 float32): the batch is
        used where its first row is formatted as that row alone would be and no column holds
        a null that could change a value (:func:`_nulls_matter`), else each row is formatted
        alone."""
        ds = self.dataset
        try:
            from datasets.formatting import format_table, get_formatter, query_table

            formatter = get_formatter(
                ds._format_type, features=ds._info.features, **(ds._format_kwargs or {})
            )
            table = query_table(ds._data, keys, indices=ds._indices)
            options = {
                "format_columns": ds._format_columns,
                "output_all_columns": ds._output_all_columns,
            }
        except (ImportError, AttributeError):  # another datasets: one read per row, as is
            return [dict(ds[i]) for i in keys]

        def row(j: int) -> Row:
            return dict(format_table(table.slice(j, 1), j, formatter=formatter, **options))

        first = row(0)
        if not any(_nulls_matter(column) for column in table.columns):
            batch = format_table(table, keys, formatter=formatter, **options)
            rows = [{k: batch[k][j] for k in batch} for j in range(len(keys))]
            if rows[0].keys() == first.keys() and all(
                _same_kind(first[k], rows[0][k]) for k in first
            ):
                return rows
        return [first, *(row(j) for j in range(1, len(keys)))]

    def _check_format(self) -> Any:
        """The dataset's format type; :class:`FormatChangedError` if it became a table format
        after the source was made (``dataset.set_format("pandas")``, in place)."""
        ds = self.dataset
        kind = ds._format_type if self._kind_attr else ds.format["type"]
        if kind in _TABLE_FORMATS:
            raise FormatChangedError(
                f"the dataset has format {kind!r}, set after this HFSource was made (e.g. by "
                "dataset.set_format), whose rows are one-row tables, not dicts of values; set "
                "it back with dataset.reset_format() (Python objects), "
                'dataset.set_format("numpy") or dataset.set_format("torch"), or make the '
                'source from a copy, dataset.with_format(None) (or "numpy", "torch"), which '
                "a later set_format on dataset leaves alone"
            )
        return kind
