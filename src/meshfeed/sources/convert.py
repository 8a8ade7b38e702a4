"""``meshfeed convert``: JSONL / Parquet text or token-id lists -> a Megatron indexed corpus.

Inputs are read and written one document at a time (the writer holds 8 bytes per document),
so corpora larger than memory convert fine. Each input record becomes one document:

- JSONL: one JSON value per line; an object's ``field`` (default ``"text"``) or a bare list.
- Parquet: the ``field`` column, read in record batches.
- ``.npy``: a 2-D integer array (one document per row) or a 1-D one (a single document).

A string is tokenized with ``tokenizer``: ``"bytes"`` (UTF-8 bytes, ids 0-255: for tests and
demos) or ``"module:callable"`` naming a function ``str -> list[int]``. A list of ints is
taken as token ids as is.

    meshfeed convert data.jsonl -o out/corpus --tokenizer bytes --append-eod 0
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from meshfeed.errors import SourceError
from meshfeed.mapped import check_mapped
from meshfeed.progress import Progress
from meshfeed.sources.indexed import DTYPE_CODES, IndexedWriter, TokenCorpus
from meshfeed.storage import ShardCache, StorageOptions, is_url, local_path_of, upload_file

__all__ = ["add_subcommand", "convert", "load_tokenizer"]

Tokenizer = Callable[[str], Any]
FORMATS = ("auto", "jsonl", "parquet", "npy")

#: Bytes of a .npy input copied out of its memory map per size check.
_NPY_BLOCK_BYTES = 8 << 20


def _byte_tokenizer(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load_tokenizer(spec: str | Tokenizer | None) -> Tokenizer | None:
    """Resolve ``"bytes"``, ``"module:callable"`` or a callable into a ``str -> ids`` function."""
    if spec is None or callable(spec):
        return spec
    if spec == "bytes":
        return _byte_tokenizer
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"tokenizer must be 'bytes' or 'module:callable' (got {spec!r}); e.g. "
            "'mytok:encode' for a function encode(text) -> list[int]"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import tokenizer module {module_name!r} ({e}); check PYTHONPATH"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"module {module_name!r} has no attribute {attr!r} (tokenizer {spec!r})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"tokenizer {spec!r} is not callable; name a function text -> list[int]")
    return obj


def _detect(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffixes = path.suffixes
    if ".jsonl" in suffixes or ".json" in suffixes:
        return "jsonl"
    if ".parquet" in suffixes:
        return "parquet"
    if ".npy" in suffixes:
        return "npy"
    raise ValueError(
        f"cannot tell the format of {path} from its name; pass --format one of "
        f"{', '.join(FORMATS[1:])}"
    )


def _records(path: Path, fmt: str, field: str) -> Iterator[tuple[str, Any]]:
    """(location, record) pairs; the location names file and line/row for error messages."""
    if fmt == "jsonl":
        opener: Any = open
        if path.suffix == ".gz":
            import gzip

            opener = gzip.open
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where} is not valid JSON ({e})") from e
                if isinstance(value, dict):
                    if field not in value:
                        raise ValueError(
                            f"{where} has no field {field!r} (keys: {sorted(value)}); pass "
                            "--field NAME"
                        )
                    value = value[field]
                yield where, value
    elif fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(
                "converting Parquet needs pyarrow: pip install meshfeed[parquet]"
            ) from e
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise ValueError(
                f"{path} has no column {field!r} (columns: {pf.schema_arrow.names}); pass "
                "--field NAME"
            )
        row = 0
        for batch in pf.iter_batches(columns=[field], batch_size=4096):
            for value in batch.column(0).to_pylist():
                yield f"{path} row {row}", value
                row += 1
    elif fmt == "npy":
        yield from _npy_records(path)
    else:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def _npy_records(path: Path) -> Iterator[tuple[str, Any]]:
    """The rows of a .npy input, copied out of its memory map a block at a time."""
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2):
        raise ValueError(
            f"{path} holds a {arr.ndim}-D {arr.dtype} array; .npy input must be a 2-D "
            "integer array (one document per row) or a 1-D one (one document)"
        )
    rows = arr[None, :] if arr.ndim == 1 else arr
    step = max(1, _NPY_BLOCK_BYTES // max(1, rows[:1].nbytes))
    for lo in range(0, rows.shape[0], step):
        # one size check, then one copy out of the map: a file truncated meanwhile is a
        # SourceError naming it, not SIGBUS in the middle of a row
        check_mapped(rows)
        block = np.array(rows[lo : lo + step])
        for r, row in enumerate(block, start=lo):
            yield f"{path} row {r}", row


def _count(path: Path, fmt: str) -> int | None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    if fmt == "npy":
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        return 1 if arr.ndim == 1 else int(arr.shape[0])
    return None


def convert(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    field: str = "text",
    tokenizer: str | Tokenizer | None = None,
    dtype: DTypeLike = np.uint16,
    append_eod: int | None = None,
    fmt: str = "auto",
    progress: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    storage_options: StorageOptions | None = None,
) -> TokenCorpus:
    """Convert ``inputs`` (in order) into ``output.bin`` / ``output.idx``; return the corpus.

    ``append_eod`` appends that token id to every document (the usual end-of-document marker
    that lets windows cross document boundaries). Text records need ``tokenizer``. On any
    error the partial output is deleted and the exception names the file and record.

    ``output`` may be a URL prefix (``s3://bucket/corpus``): the corpus is written locally
    (in the shard cache at ``cache_dir``), then uploaded, ``.bin`` before ``.idx``; each
    object appears only once complete, and the local files stay as the node's cached copies.
    """
    out = os.fspath(output)
    if is_url(out) and local_path_of(out) is None:
        return _convert_to_url(
            inputs,
            out,
            ShardCache(cache_dir, storage_options=storage_options),
            field=field,
            tokenizer=tokenizer,
            dtype=dtype,
            append_eod=append_eod,
            fmt=fmt,
            progress=progress,
        )
    output = local_path_of(out) or output
    paths = [Path(inputs)] if isinstance(inputs, (str, os.PathLike)) else [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no inputs given; pass at least one JSONL, Parquet or .npy file")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input {p} does not exist")
    formats = [_detect(p, fmt) for p in paths]
    tok = load_tokenizer(tokenizer)
    counts = [_count(p, f) for p, f in zip(paths, formats, strict=True)]
    total = None if any(c is None for c in counts) else sum(c or 0 for c in counts)
    eod = None if append_eod is None else np.asarray([append_eod])
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with (
        IndexedWriter(output, dtype=dtype) as writer,
        Progress(
            total, desc=f"convert -> {os.fspath(output)}", unit="doc", enabled=progress
        ) as bar,
    ):
        for path, f in zip(paths, formats, strict=True):
            for where, value in _records(path, f, field):
                if isinstance(value, str):
                    if tok is None:
                        raise ValueError(
                            f"{where} is text but no tokenizer was given; pass --tokenizer "
                            "bytes or --tokenizer module:callable"
                        )
                    value = tok(value)
                try:
                    ids = np.asarray(value)
                    if ids.size == 0:
                        ids = ids.astype(np.int64)
                    if eod is not None:
                        ids = np.concatenate([ids, eod])
                    writer.add(ids)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{where}: {e}") from e
                bar.update()
    return TokenCorpus(writer.prefix)


def _convert_to_url(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    url: str,
    cache: ShardCache,
    **kw: Any,
) -> TokenCorpus:
    for ext in (".bin", ".idx"):
        url = url.removesuffix(ext)
    # staged inside the cache, so adopting the uploaded files is a rename
    with tempfile.TemporaryDirectory(dir=cache.cache_dir, prefix=".convert-") as staging:
        convert(inputs, Path(staging, "corpus"), **kw)
        for ext in (".bin", ".idx"):  # .idx last: a reader finds the pair once the index is up
            local = Path(staging, "corpus" + ext)
            upload_file(local, url + ext, storage_options=cache.storage_options)
            cache.adopt(url + ext, local)
    return TokenCorpus.open(url, cache_dir=cache.cache_dir, storage_options=cache.storage_options)


def _handler(args: argparse.Namespace) -> int:
    if args.to == "shards":
        from meshfeed.sources.shards_convert import handler

        return handler(args)
    try:
        corpus = convert(
            args.inputs,
            args.output,
            field=args.field,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            append_eod=args.append_eod,
            fmt=args.format,
            progress=not args.quiet,
            cache_dir=args.cache_dir,
        )
    except (ValueError, TypeError, FileNotFoundError, ImportError, SourceError) as e:
        print(f"meshfeed convert: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {corpus.prefix}.bin/.idx: {corpus.num_documents} documents, "
        f"{corpus.num_tokens} tokens, {corpus.dtype}"
    )
    return 0


def add_subcommand(subparsers: Any) -> None:
    """Register ``convert`` on an ``argparse`` subparsers object (``set_defaults(func=...)``)."""
    p = subparsers.add_parser(
        "convert",
        help="write a Megatron .bin/.idx token corpus from JSONL, Parquet or .npy",
        description=(
            "Write a Megatron-LM indexed corpus (PREFIX.bin + PREFIX.idx) from JSONL or "
            "Parquet text (tokenized) or token-id lists (JSONL lists, 2-D .npy), streamed."
        ),
        epilog="example: meshfeed convert data.jsonl -o out/corpus --tokenizer bytes --append-eod 0",
    )
    p.add_argument("inputs", nargs="+", help="input files, converted in order")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="output prefix (writes PREFIX.bin/.idx); a URL (s3://bucket/corpus) is written "
        "locally, then uploaded (credentials and endpoint from the environment)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="shard cache for a URL output (default: $MESHFEED_CACHE_DIR or ~/.cache/meshfeed)",
    )
    p.add_argument(
        "--to",
        choices=("corpus", "shards"),
        default="corpus",
        help="corpus: a .bin/.idx token corpus (default); shards: meshfeed shards of whole "
        "JSONL records (write_shards), written to the directory -o names",
    )
    p.add_argument("--compression", choices=("zstd",), default=None, help="--to shards only")
    p.add_argument(
        "--format", choices=FORMATS, default="auto", help="input format (default: by suffix)"
    )
    p.add_argument("--field", default="text", help="JSON field / Parquet column (default: text)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="'bytes' (UTF-8 bytes) or 'module:callable' (str -> list[int]); needed for text",
    )
    p.add_argument(
        "--dtype",
        default="uint16",
        choices=sorted(str(d) for d in DTYPE_CODES.values()),
        help="token dtype on disk (default uint16: vocabularies up to 65536)",
    )
    p.add_argument(
        "--append-eod", type=int, default=None, help="token id appended to every document"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_handler)
