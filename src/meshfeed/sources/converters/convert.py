"""``meshfeed convert``: JSONL / Parquet text or token-id lists -> a Megatron indexed corpus.

Inputs are read and written a chunk of documents at a time (the writer holds 8 bytes per
document), so corpora larger than memory convert fine. Each input record becomes one document:

- JSONL (optionally gzipped): one JSON value per line; an object's ``field`` (default
  ``"text"``) or a bare list of token ids.
- Parquet: the ``field`` column, read in record batches.
- ``.npy``: a 2-D integer array (one document per row) or a 1-D one (a single document).

A string is tokenized with ``tokenizer`` (see :func:`meshfeed.sources.tokens.tokenizer.load_tokenizer`:
a ``tokenizer.json``, a saved HF tokenizer folder, a tiktoken encoding name, ``"bytes"`` or
``"module:callable"``); a list of ints is taken as token ids as is. ``num_workers > 1``
tokenizes (and parses JSON) in that many worker processes; chunks are written in input order,
so the output is byte-identical for every ``num_workers``. ``append_eod`` appends the
end-of-document id to every document, as Megatron-LM's ``tools/preprocess_data.py
--append-eod`` does, and the ``.bin/.idx`` bytes are those Megatron's own writer produces
for the same ids.

    meshfeed convert data.jsonl -o out/corpus --tokenizer tokenizer.json --append-eod -j 4
"""

from __future__ import annotations

import argparse
import errno
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from meshfeed.errors import SourceError
from meshfeed.progress import Progress
from meshfeed.sources.converters.inputs import (
    FORMATS,
    _Chunk,
    _chunks,
    _detect,
    _json_value,
    input_paths,
    token_ids,
)
from meshfeed.sources.tokens.indexed import DTYPE_CODES, TokenCorpus
from meshfeed.sources.tokens.indexed_format import _paths
from meshfeed.sources.tokens.indexed_write import IndexedWriter, upload_corpus
from meshfeed.sources.tokens.tokenizer import TextTokenizer, load_tokenizer
from meshfeed.storage import StorageOptions, local_path_of
from meshfeed.storage.output import Upload, upload_target

__all__ = ["add_subcommand", "convert", "load_tokenizer"]

#: Integer dtypes a token corpus may hold (the format also codes floats; convert refuses them).
TOKEN_DTYPES = tuple(
    str(d)
    for d in sorted(
        (np.dtype(d) for d in DTYPE_CODES.values() if np.dtype(d).kind in "iu"),
        key=lambda d: (d.kind, d.itemsize),
    )
)


@dataclass(frozen=True, slots=True)
class _Job:
    """What a worker needs to turn a chunk into token-id arrays."""

    field: str
    tokenizer: TextTokenizer | None
    eod: np.ndarray | None


def _encode_chunk_with(chunk: _Chunk, job: _Job) -> list[np.ndarray]:
    """The documents of ``chunk``, tokenized; the same code in this process and in workers."""
    out: list[np.ndarray] = []
    for i, (_, value) in enumerate(chunk.items):
        if chunk.fmt == "jsonl":
            value = _json_value(chunk, i, job.field)
        if isinstance(value, str):
            if job.tokenizer is None:
                raise ValueError(
                    f"{chunk.where(i)} is text but no tokenizer was given; pass --tokenizer "
                    "(a tokenizer.json, a tokenizer folder, bytes, ...)"
                )
            try:
                ids = job.tokenizer(value)
            except Exception as e:  # a user's tokenizer may raise anything: name the record
                raise ValueError(
                    f"{chunk.where(i)}: tokenizer {job.tokenizer.name} failed ({e})"
                ) from e
        elif isinstance(value, list):
            ids = token_ids(value, chunk.where(i))
        elif chunk.fmt == "npy":
            ids = np.asarray(value)
        else:
            raise ValueError(
                f"{chunk.where(i)} holds {type(value).__name__} {value!r:.40}; a record is text "
                f"or a list of token ids: fix it, or pass --field NAME"
            )
        if job.eod is not None:
            ids = _with_eod(ids, job.eod, chunk.where(i))
        out.append(ids)
    return out


def _with_eod(ids: np.ndarray, eod: np.ndarray, where: str) -> np.ndarray:
    """``ids`` with the end-of-document id appended, in their integer dtype (a wider integer
    one only when the id does not fit it); never promoted to float."""
    if ids.dtype.kind not in "iu":
        return np.concatenate([ids, eod])  # not token ids: the writer refuses it by name
    e = int(eod[0])
    dtype = ids.dtype
    if not np.iinfo(dtype).min <= e <= np.iinfo(dtype).max:
        dtype = np.promote_types(dtype, np.min_scalar_type(e))
        if dtype.kind not in "iu":  # uint64 ids and a negative id: no integer holds both
            raise ValueError(
                f"{where} holds {ids.dtype} token ids, which cannot sit beside the "
                f"end-of-document id {e} in one integer dtype; pass an --eod-id that is "
                f">= 0, or store the ids as int64"
            )
    return np.concatenate([ids.astype(dtype, copy=False), np.asarray([e], dtype)])


_WORKER_JOB: _Job | None = None


def _init_worker(job: _Job) -> None:
    global _WORKER_JOB
    _WORKER_JOB = job
    # A worker the pool starts again later forks from a caller that may handle SIGTERM in
    # Python (``meshfeed convert`` does): here it takes the default action.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _encode_chunk(chunk: _Chunk) -> list[np.ndarray]:
    assert _WORKER_JOB is not None, "worker started without _init_worker"
    return _encode_chunk_with(chunk, _WORKER_JOB)


@contextmanager
def _pool(method: str, workers: int, job: _Job) -> Iterator[Any]:
    """A process pool whose workers run HF tokenizers single-threaded, without its fork warning.

    The variable is set while the workers start (they inherit it) and restored after, so the
    caller's own tokenizers keep their threads. So is SIGTERM's default action: a caller that
    handles SIGTERM in Python (``meshfeed convert`` turns it into an interrupt) would hand its
    handler to forked workers, and a SIGTERM reaching one before the interpreter was ready in
    it was lost, so ``terminate()`` left it waiting for a task and the pool's join hung. The
    pool ends with ``close()`` and ``join()`` (each worker takes its stop message); it is
    terminated only on an error.
    """
    key = "TOKENIZERS_PARALLELISM"
    before = os.environ.get(key)
    os.environ[key] = "false"
    handler = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        pool = mp.get_context(method).Pool(workers, _init_worker, (job,))
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


def _encoded(
    chunks: Iterator[_Chunk], job: _Job, workers: int
) -> Generator[tuple[_Chunk, list[np.ndarray]], None, None]:
    """(chunk, its documents) in input order; ``workers > 1`` encodes in worker processes."""
    if workers <= 1:
        for chunk in chunks:
            yield chunk, _encode_chunk_with(chunk, job)
        return
    # fork shares the loaded tokenizer with the workers (no pickling, no re-import of torch)
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with _pool(method, workers, job) as pool:
        pending: deque[tuple[_Chunk, Any]] = deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(_encode_chunk, (chunk,))))
            if len(pending) >= 4 * workers:  # bounded read-ahead: memory stays a few chunks
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


def _eod(
    append_eod: bool | int, eod_id: int | None, tok: TextTokenizer | None
) -> np.ndarray | None:
    if not isinstance(append_eod, bool):  # an int is the id itself
        eod_id, append_eod = int(append_eod), True
    if not append_eod and eod_id is None:
        return None
    if eod_id is None:
        eod_id = None if tok is None else tok.eod_id
    if eod_id is None:
        name = "no tokenizer" if tok is None else f"tokenizer {tok.name}"
        raise ValueError(
            f"--append-eod needs an end-of-document id and {name} names none; pass --eod-id N"
        )
    return np.asarray([eod_id], dtype=np.int64)


def convert(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    field: str = "text",
    tokenizer: Any = None,
    dtype: DTypeLike = np.uint16,
    append_eod: bool | int = False,
    eod_id: int | None = None,
    fmt: str = "auto",
    num_workers: int = 1,
    progress: bool = True,
    overwrite: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    storage_options: StorageOptions | None = None,
) -> TokenCorpus:
    """Convert ``inputs`` (in order) into ``output.bin`` / ``output.idx``; return the corpus.

    ``append_eod=True`` appends the end-of-document id to every document: ``eod_id`` if given,
    else the tokenizer's (its ``<|endoftext|>`` / ``</s>`` / eos token); an int is taken as
    the id itself. Text records need ``tokenizer``. ``num_workers`` processes tokenize; the
    bytes written do not depend on it. Progress counts input bytes (total and ETA known). On
    any error the partial output is deleted and the exception names the file and record;
    inputs that hold no record are refused (``ValueError``), as ``write_shards`` refuses no
    samples. A corpus already at ``output`` is replaced (atomically: the new files are
    renamed in); ``overwrite=False`` refuses it instead (``FileExistsError`` naming the file),
    as ``meshfeed convert`` does unless given ``--overwrite``.

    ``output`` may be a URL prefix (``s3://bucket/corpus``): the corpus is written locally
    (in the shard cache at ``cache_dir``), then uploaded, ``.bin`` before ``.idx``; each
    object appears only once complete, and the local files stay as the node's cached copies.
    """
    url = upload_target(output)
    if url is not None:
        url = url.removesuffix(".bin").removesuffix(".idx")
        with Upload(cache_dir, storage_options) as upload:
            upload.check(url, "the corpus")
            if not overwrite:
                for ext in (".bin", ".idx"):
                    if upload.exists(url + ext):
                        raise _taken(url + ext, url)
            convert(
                inputs,
                upload.staging / "corpus",
                field=field,
                tokenizer=tokenizer,
                dtype=dtype,
                append_eod=append_eod,
                eod_id=eod_id,
                fmt=fmt,
                num_workers=num_workers,
                progress=progress,
            )
            upload_corpus(upload, upload.staging / "corpus", url)
        cache = upload.cache
        return TokenCorpus.open(
            url, cache_dir=cache.cache_dir, storage_options=cache.storage_options
        )
    output = local_path_of(os.fspath(output)) or output
    if not overwrite:
        idx_path, bin_path = _paths(output)
        for path in (bin_path, idx_path):
            if path.exists() or path.is_symlink():
                raise _taken(os.fspath(path), os.fspath(idx_path)[: -len(".idx")])
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1 (got {num_workers!r})")
    paths = input_paths(inputs)
    formats = [_detect(p, fmt) for p in paths]
    tok = None if tokenizer is None else load_tokenizer(tokenizer)
    job = _Job(field, tok, _eod(append_eod, eod_id, tok))
    total = sum(p.stat().st_size for p in paths)
    encoded = _encoded(_chunks(paths, formats, field), job, num_workers)
    with (
        closing(encoded),  # an error stops the worker processes now, not when collected
        IndexedWriter(output, dtype=dtype) as writer,
        Progress(
            total,
            desc=f"convert -> {os.fspath(output)}",
            unit="B",
            unit_scale=True,
            enabled=progress,
        ) as bar,
    ):
        shown = 0
        for chunk, docs in encoded:
            for i, ids in enumerate(docs):
                try:
                    writer.add(ids)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{chunk.where(i)}: {e}") from e
            bar.update(chunk.done_bytes - shown)
            shown = chunk.done_bytes
        if writer.num_documents == 0:  # raised inside the writer: nothing is published
            names = ", ".join(os.fspath(p) for p in paths)
            raise ValueError(
                f"{names} {'holds' if len(paths) == 1 else 'hold'} no records, and a corpus "
                "needs at least one document; nothing was written: check the input (an empty "
                "file, or the wrong one?)"
            )
        bar.update(total - shown)
    return TokenCorpus(writer.prefix)


class _CorpusExists(FileExistsError):
    """``convert(overwrite=False)`` found a corpus file at its output (``filename``)."""


def _taken(found: str, prefix: str) -> FileExistsError:
    """``convert(overwrite=False)``'s refusal of the corpus file ``found`` at ``prefix``."""
    return _CorpusExists(
        errno.EEXIST,
        f"a token corpus is already at {prefix} ({found} exists); pass overwrite=True to "
        "replace it, or choose another output",
        found,
    )


#: Options of one --to only, with their defaults: given with the other, they are refused.
_ONLY: dict[str, dict[str, tuple[str, object]]] = {
    "corpus": {
        "--field": ("field", "text"),
        "--tokenizer": ("tokenizer", None),
        "--dtype": ("dtype", "uint16"),
        "--append-eod": ("append_eod", False),
        "--eod-id": ("eod_id", None),
        "--format": ("format", "auto"),
    },
    "shards": {
        "--compression": ("compression", None),
        "--rows-per-shard": ("rows_per_shard", None),
        "--bytes-per-shard": ("bytes_per_shard", None),
    },
}


def _misplaced(args: argparse.Namespace) -> str | None:
    """The first option given that the chosen --to ignores (it would be silently dropped)."""
    for to, options in _ONLY.items():
        if to == args.to:
            continue
        for flag, (name, default) in options.items():
            if getattr(args, name) != default:
                return f"{flag} applies to --to {to} only (got --to {args.to}); leave it out"
    return None


def _handler(args: argparse.Namespace) -> int:
    refused = _misplaced(args)
    if refused is None and not args.output:
        what = "a directory" if args.to == "shards" else "a prefix (writes PREFIX.bin/.idx)"
        refused = f"-o is empty; give {what}, e.g. -o out/corpus"
    if refused is None and args.num_workers < 0:
        refused = f"-j must be 0 or more (got {args.num_workers}); 0 and 1 work in this process"
    args.num_workers = max(1, args.num_workers)  # -j 0: in this process, as for analyze
    if refused is not None:
        print(f"meshfeed convert: error: {refused}", file=sys.stderr)
        return 2
    if args.to == "shards":
        from meshfeed.sources.converters.shards import handler

        return handler(args)
    try:
        corpus = convert(
            args.inputs,
            args.output,
            field=args.field,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            append_eod=args.append_eod,
            eod_id=args.eod_id,
            fmt=args.format,
            num_workers=args.num_workers,
            progress=not args.quiet,
            overwrite=args.overwrite,
            cache_dir=args.cache_dir,
        )
    except _CorpusExists as e:
        print(
            f"meshfeed convert: error: a token corpus is already at {args.output} "
            f"({e.filename} exists); pass --overwrite to replace it, or choose another -o",
            file=sys.stderr,
        )
        return 2
    except (ValueError, TypeError, OSError, ImportError, SourceError) as e:
        print(f"meshfeed convert: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {corpus.prefix}.bin/.idx: {corpus.num_documents} documents, "
        f"{corpus.num_tokens} tokens, {corpus.dtype}"
    )
    return 0


def _size(text: str) -> int:
    """A positive count, with an optional K/M/G suffix (binary: 64M is 64 << 20)."""
    shift = {"K": 10, "M": 20, "G": 30}.get(text[-1:].upper(), 0)
    digits = text[:-1] if shift else text
    if not digits.isdigit() or int(digits) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive number; give e.g. 4096, 256K or 64M"
        )
    return int(digits) << shift


def add_subcommand(subparsers: Any) -> None:
    """Register ``convert`` on an ``argparse`` subparsers object (``set_defaults(func=...)``)."""
    p = subparsers.add_parser(
        "convert",
        help="write a Megatron .bin/.idx token corpus from JSONL, Parquet or .npy",
        description=(
            "Write a Megatron-LM indexed corpus (PREFIX.bin + PREFIX.idx) from JSONL or "
            "Parquet text (tokenized) or token-id lists (JSONL lists, 2-D .npy), streamed."
        ),
        epilog=(
            "example: meshfeed convert data.jsonl -o out/corpus --tokenizer tokenizer.json "
            "--append-eod -j 4"
        ),
    )
    p.add_argument("inputs", nargs="+", help="input files, converted in order")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="output prefix (writes PREFIX.bin/.idx; with --to shards, a directory); a URL "
        "(s3://bucket/corpus) is written locally, then uploaded (credentials and endpoint from "
        "the environment)",
    )
    p.add_argument(
        "--to",
        choices=("corpus", "shards"),
        default="corpus",
        help="corpus: a .bin/.idx token corpus (default); shards: meshfeed shards of whole "
        "JSONL records (write_shards)",
    )
    shards = p.add_argument_group("--to shards")
    shards.add_argument(
        "--compression", choices=("zstd",), default=None, help="compress blocks (default: none)"
    )
    shards.add_argument(
        "--rows-per-shard",
        type=_size,
        metavar="N",
        help="end a shard after N samples (default: none; shards end by bytes)",
    )
    shards.add_argument(
        "--bytes-per-shard",
        type=_size,
        metavar="B",
        help="end a shard once it holds B raw bytes; K/M/G suffixes (default: 64M, or none "
        "with --rows-per-shard)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the corpus at -o (PREFIX.bin/.idx), or with --to shards the shard "
        "dataset there (one with an index.json); default: refuse",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="shard cache for a URL output (default: $MESHFEED_CACHE_DIR or ~/.cache/meshfeed)",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="input format (default: auto, from the file name)",
    )
    p.add_argument("--field", default="text", help="JSON field or Parquet column (default: text)")
    p.add_argument(
        "--tokenizer",
        metavar="SPEC",
        help=(
            "needed for text: a tokenizer.json file, a saved Hugging Face tokenizer folder, a "
            "tiktoken encoding name (if tiktoken is installed), 'bytes' (UTF-8 bytes) or "
            "'module:callable' importable from the current folder"
        ),
    )
    p.add_argument(
        "--dtype",
        default="uint16",
        choices=TOKEN_DTYPES,
        help="token id type on disk (default: uint16, vocabularies up to 65536)",
    )
    p.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to every document, as Megatron's "
        "preprocess_data.py does (its id from the tokenizer, or --eod-id)",
    )
    p.add_argument(
        "--eod-id",
        type=int,
        metavar="ID",
        help="end-of-document id to append (implies --append-eod)",
    )
    p.add_argument(
        "-j",
        "--num-workers",
        type=int,
        default=1,
        metavar="N",
        help="tokenize (--to shards: encode shards) in N worker processes, 0 or 1 in this "
        "process; the output is the same for every N (default: 1)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_handler)
