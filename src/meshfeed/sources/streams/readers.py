"""How a sharded stream reads its shards: the reader contract, the default reader, identities.

A reader is any callable ``reader(shard, start_row, stop_row) -> iterable of rows`` (``stop_row``
None: to the end of the shard). Optional hooks make it faster or stronger, each declared in
:mod:`meshfeed.protocols` and resolved once into :class:`ReaderHooks` when the
:class:`~meshfeed.sources.ShardedStream` is built; the main three:

- ``take(shard, rows) -> list``: the rows at these indices (any order, repeats allowed), for
  shards that can be read by index (memory-mapped arrays, indexed shard files). Without it the
  stream groups the wanted rows into contiguous runs and calls the reader once per run.
- ``count(shard) -> int``: the shard's number of rows without reading them all.
- ``version(shard) -> str``: a cheap identity of the shard's content (e.g. size and hash of
  its index); without it a file's identity is its size, mtime and a hash of its first and
  last 64 KiB, and a callable's is its qualified name and arguments (never a ``repr`` holding
  an address, which differs in every process).

:class:`DefaultReader` reads callables (``itertools.islice`` over ``shard()``; an open iterator
is kept per shard and process, so reading forward never starts over; a stream reads them through
its own :class:`RowCursor`, which keeps the rows its shuffle window still asks for) and text
files (one row per line, less its ``"\\n"`` or ``"\\r\\n"``, the same whether read by range or
by index; a lone ``"\\r"`` ends no line; ``.jsonl`` lines are parsed as JSON), by index through a
line-offset table built once per file and process.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshfeed.errors import ShardRowsError, SourceError
from meshfeed.protocols import (
    AskReader,
    ClosingReader,
    CountReader,
    DatedReader,
    FinishReader,
    ForgetReader,
    ModifiedReader,
    PlanReader,
    TakeReader,
    UrlReader,
    VersionReader,
)

__all__ = [
    "DefaultReader",
    "Reader",
    "ReaderHooks",
    "RowCursor",
    "default_reader",
    "edge_identity",
    "shard_identity",
    "shard_name",
]

Reader = Callable[[Any, int, "int | None"], Iterable[Any]]
#: Bytes hashed at each end of a file for its cheap identity.
_EDGE = 64 * 1024
#: Bytes of a text shard read at once around the rows a step wants (and kept for the next).
_SPAN_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ReaderHooks:
    """A reader's optional hooks (each a protocol of :mod:`meshfeed.protocols`), resolved once
    with :meth:`of`: None where the reader lacks one (``reads_urls``: False). A reader with
    none of them (a plain function) is read through its call alone."""

    take: Callable[[Any, np.ndarray], list[Any]] | None = None
    count: Callable[[Any], int] | None = None
    version: Callable[[Any], str] | None = None
    modified: Callable[[Any], int] | None = None
    plan: Callable[[list[Any]], None] | None = None
    finished: Callable[[list[Any]], None] | None = None
    ask: Callable[[list[Any]], None] | None = None
    forget: Callable[[Any], None] | None = None
    close: Callable[[], None] | None = None
    reads_urls: bool = False
    newest: int | None = None

    @classmethod
    def of(cls, reader: Any) -> ReaderHooks:
        return cls(
            take=reader.take if isinstance(reader, TakeReader) else None,
            count=reader.count if isinstance(reader, CountReader) else None,
            version=reader.version if isinstance(reader, VersionReader) else None,
            modified=reader.modified if isinstance(reader, ModifiedReader) else None,
            plan=reader.plan if isinstance(reader, PlanReader) else None,
            finished=reader.finished if isinstance(reader, FinishReader) else None,
            ask=reader.ask if isinstance(reader, AskReader) else None,
            forget=reader.forget if isinstance(reader, ForgetReader) else None,
            close=reader.close if isinstance(reader, ClosingReader) else None,
            reads_urls=isinstance(reader, UrlReader) and bool(reader.reads_urls),
            newest=reader.newest if isinstance(reader, DatedReader) else None,
        )


#: Modules whose readers were named in stream fingerprints before meshfeed 0.4 moved them into
#: sources' subpackages: identities keep the old names, so a 0.3 checkpoint still resumes.
_NAMED_BEFORE = {
    "meshfeed.sources.streams.readers": "meshfeed.sources.stream_readers",
    "meshfeed.sources.streams.remote": "meshfeed.sources.stream_remote",
    "meshfeed.sources.streams.webdataset": "meshfeed.sources.webdataset",
    "meshfeed.sources.streams.mds": "meshfeed.sources.mds",
    "meshfeed.sources.shards.read": "meshfeed.sources.shards_read",
}


def _module_name(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    return _NAMED_BEFORE.get(module, module)


def callable_identity(fn: Any) -> str:
    """A name for ``fn`` that is the same in every process: qualified name, code and
    arguments (``functools.partial`` unwrapped), never an address."""
    if isinstance(fn, functools.partial):
        args = [_value_identity(a) for a in fn.args]
        kwargs = {k: _value_identity(v) for k, v in sorted(fn.keywords.items())}
        return f"partial({callable_identity(fn.func)}, {args}, {kwargs})"
    name = f"{_module_name(fn)}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    code = getattr(fn, "__code__", None)
    if code is not None:
        h = hashlib.blake2b(code.co_code, digest_size=6)
        h.update(
            repr([c for c in code.co_consts if isinstance(c, (int, float, str, bytes))]).encode()
        )
        name += f"#{h.hexdigest()}"
        cells = getattr(fn, "__closure__", None) or ()
        values = [_value_identity(c.cell_contents) for c in cells if _has_contents(c)]
        if values:
            name += f"{values}"
    return name


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _value_identity(v: Any) -> str:
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return repr(v)
    if isinstance(v, (os.PathLike,)):
        return repr(os.fspath(v))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value_identity(x) for x in v) + "]"
    if callable(v):
        return callable_identity(v)
    # An object without a stable value: its type, and its length where it has one.
    size = len(v) if hasattr(v, "__len__") else ""
    return f"<{_module_name(type(v))}.{type(v).__qualname__}{size}>"


def edge_identity(size: int, read: Callable[[int, int], bytes]) -> str:
    """``SIZE:HEX``, the hash of a file's first and last 64 KiB (``read(offset, n)`` reads
    them): a cheap identity of its content."""
    h = hashlib.blake2b(digest_size=8)
    h.update(read(0, min(size, _EDGE)))
    if size > _EDGE:
        tail = max(_EDGE, size - _EDGE)
        h.update(read(tail, size - tail))
    return f"{size}:{h.hexdigest()}"


@functools.lru_cache(maxsize=4096)
def _file_identity(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return edge_identity(size, lambda offset, n: os.pread(f.fileno(), n, offset))


def shard_identity(shard: Any, version: Callable[[Any], str] | None = None) -> str:
    """The identity of one shard's content: ``version(shard)`` (a reader's hook) where given,
    else as the module docstring says; cheap, cached."""
    if version is not None:
        return str(version(shard))
    if callable(shard):
        return callable_identity(shard)
    path = os.fspath(shard)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        # Not a local file: a name the reader resolves (a key, a URL); the reader's
        # ``version`` is what identifies its content.
        return f"name:{path}"
    except OSError as exc:
        raise SourceError(f"cannot read shard {path!r}: {exc}") from exc
    try:
        return _file_identity(path, st.st_size, st.st_mtime_ns)
    except OSError as exc:
        raise SourceError(f"cannot read shard {path!r}: {exc}") from exc


def shard_mtime(shard: Any) -> int:
    """The shard's modification time in ns (0 for a callable)."""
    if callable(shard):
        return 0
    try:
        return os.stat(os.fspath(shard)).st_mtime_ns
    except OSError:
        return 0


class DefaultReader:
    """Reads callables and text / JSON-lines files (see the module docstring). Picklable: the
    per-process caches are dropped when it is sent to a worker. It keeps up to 16 files open
    for reading by index; :meth:`close` (which ``ShardedStream.close`` calls) closes them."""

    def __init__(self) -> None:
        self._cursors: dict[int, RowCursor] = {}  # a callable shard's rows, read forward
        self._offsets: dict[str, np.ndarray] = {}
        self._files: dict[str, Any] = {}
        self._spans: dict[str, tuple[int, list[str]]] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __call__(self, shard: Any, start: int, stop: int | None) -> Iterator[Any]:
        if callable(shard):
            return itertools.islice(iter(shard()), start, stop)
        return _read_lines(os.fspath(shard), start, stop)

    def count(self, shard: Any) -> int:
        if callable(shard):
            return sum(1 for _ in shard())
        return len(self._line_offsets(os.fspath(shard))[1]) - 1

    def take(self, shard: Any, rows: np.ndarray) -> list[Any]:
        if callable(shard):
            cursor = self._cursors.get(id(shard))
            if cursor is None:
                cursor = self._cursors[id(shard)] = RowCursor(self, shard, seeks=False)
            return cursor.take(rows)
        path = os.fspath(shard)
        key, offsets = self._line_offsets(path)
        parse = _parser(path)
        lo, hi = int(rows.min()), int(rows.max()) + 1
        if lo < 0 or hi >= len(offsets):
            raise _past_end(path, lo if lo < 0 else hi - 1, len(offsets) - 1)
        if offsets[hi] - offsets[lo] <= _SPAN_BYTES:
            # One read of the span the rows lie in (a shuffle window's), kept: the next steps
            # drawing from the same window parse from memory.
            first, text = self._span(key, path, offsets, lo, hi)
            return [parse(text[r - first]) for r in rows.tolist()]
        f = self._handle(key, path)
        uniq = np.unique(rows)
        found: dict[int, str] = {}
        # one read per contiguous run of wanted rows; parsed per wanted row (a row asked for
        # twice is two objects, as from the kept span)
        for run in np.split(uniq, np.flatnonzero(np.diff(uniq) != 1) + 1):
            a, b = int(run[0]), int(run[-1]) + 1
            found.update(zip(range(a, b), _read_rows(f, path, offsets, a, b), strict=True))
        return [parse(found[r]) for r in rows.tolist()]

    def close(self) -> None:
        """Close the files this process opened and drop the kept spans and callable shards'
        iterators (idempotent); reading again re-opens. The line-offset tables stay (they
        hold no file and cost a read of the whole file to rebuild)."""
        files, self._files, self._pid = self._files, {}, os.getpid()
        self._spans.clear()
        self._cursors.clear()
        for f in files.values():  # a forked worker's inherited copies are its own to close
            f.close()

    def _span(
        self, key: str, path: str, offsets: np.ndarray, lo: int, hi: int
    ) -> tuple[int, list[str]]:
        """Rows ``[lo, hi)`` of ``path`` as text: from the span read last when it holds
        them, else read (from ``lo`` to at least ``hi``, up to ``_SPAN_BYTES``) and kept."""
        held = self._spans.get(key)
        if held is not None and held[0] <= lo and hi <= held[0] + len(held[1]):
            return held
        stop = int(np.searchsorted(offsets, offsets[lo] + _SPAN_BYTES, side="right")) - 1
        stop = min(max(hi, stop), len(offsets) - 1)
        text = _read_rows(self._handle(key, path), path, offsets, lo, stop)
        if len(self._spans) >= 4:
            self._spans.clear()
        self._spans[key] = (lo, text)
        return lo, text

    def _handle(self, key: str, path: str) -> Any:
        """An open file per (path, size, mtime) and process: a rewritten file is opened anew,
        and a forked worker opens its own (a file inherited through fork shares its offset
        with the parent, so seeks in one process would move the other's reads)."""
        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()
        f = self._files.get(key)
        if f is None:
            if len(self._files) >= 16:
                for old in self._files.values():
                    old.close()
                self._files.clear()
            with _shard_file(path):
                f = open(path, "rb")  # noqa: SIM115 (kept open, closed above)
            self._files[key] = f
        return f

    def _line_offsets(self, path: str) -> tuple[str, np.ndarray]:
        """Byte offsets of every row's start, plus the file's end (one pass, cached). A row
        is a line; in a JSON-lines file, a line that holds more than whitespace (as
        ``meshfeed convert`` reads it): blank lines lie between rows and are skipped."""
        with _shard_file(path):
            st = os.stat(path)
            key = f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
            if key not in self._offsets:
                with open(path, "rb") as f:
                    data = np.frombuffer(f.read(), dtype=np.uint8)
                self._offsets[key] = _row_starts(data, skip_blank=_is_jsonl(path))
        return key, self._offsets[key]


#: What ``bytes.strip()`` removes (ASCII whitespace): a JSON line of these alone is blank.
_BLANK = " \t\n\r\x0b\x0c"


#: The UTF-8 byte order mark some editors write at a file's start: no part of its first row.
_BOM = b"\xef\xbb\xbf"


def _row_starts(data: np.ndarray, *, skip_blank: bool) -> np.ndarray:
    """The start of every row of a text file's bytes, then its size (``int64``): a row per
    line, less the blank lines where ``skip_blank``; the first row starts after a BOM."""
    first = len(_BOM) if data[: len(_BOM)].tobytes() == _BOM else 0
    starts = np.concatenate([[first], np.flatnonzero(data == ord("\n")) + 1]).astype(np.int64)
    starts = starts[starts < data.size]  # the end of the file starts no line
    if skip_blank and starts.size:
        ink = (data != ord(" ")) & ((data < ord("\t")) | (data > ord("\r")))
        starts = starts[np.logical_or.reduceat(ink, starts)]
    return np.append(starts, np.int64(data.size))


def _read_rows(f: Any, path: str, offsets: np.ndarray, lo: int, hi: int) -> list[str]:
    """Rows ``[lo, hi)`` of ``path`` (open as ``f``) as text: one read from row ``lo``'s
    start to row ``hi``'s (blank lines between them dropped in a JSON-lines file)."""
    f.seek(int(offsets[lo]))
    text = f.read(int(offsets[hi] - offsets[lo])).decode("utf-8")
    if _is_jsonl(path):
        lines = [line for line in text.split("\n") if line.strip(_BLANK)]
    else:
        # A row is its line less the terminator, "\n" or "\r\n" (as the range form reads it);
        # a lone "\r" is no terminator and stays.
        lines = text.replace("\r\n", "\n").split("\n")
        del lines[hi - lo :]  # the empty piece after the last newline is no line
    if len(lines) != hi - lo:  # the file changed between its offset table and this read
        raise _past_end(path, hi - 1, lo + len(lines))
    return lines


@contextlib.contextmanager
def _shard_file(path: str) -> Iterator[None]:
    """A shard file that is gone or unreadable raises :class:`SourceError` naming it."""
    try:
        yield
    except FileNotFoundError as exc:
        raise SourceError(
            f"shard {path} is missing: it was deleted or moved after the stream was built "
            "(its rows were counted then); restore it, or build the stream again without it"
        ) from exc
    except OSError as exc:
        if isinstance(exc, SourceError):
            raise
        raise SourceError(f"cannot read shard {path}: {exc}") from exc


def _past_end(shard: Any, row: int, rows: int) -> ShardRowsError:
    """The error for ``row`` of a shard that holds ``rows`` rows (never a bad sample)."""
    return ShardRowsError(
        f"shard {shard_name(shard)} holds {rows} rows, but row {row} was asked for: it changed "
        "after its rows were counted, or rows= overstates it; build the stream again (with "
        "the right rows=, or none to count them)"
    )


def _is_jsonl(path: str) -> bool:
    return path.endswith(".jsonl")


def _parser(path: str) -> Callable[[str], Any]:
    return json.loads if _is_jsonl(path) else str


def _read_lines(path: str, start: int, stop: int | None) -> Iterator[Any]:
    with _shard_file(path):
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    with f:
        if f.read(len(_BOM)) != _BOM:  # rows as take() reads them: a BOM is no part of row 0
            f.seek(0)
        if _is_jsonl(path):  # rows as take() counts them: non-blank lines, split at b"\n"
            lines = (line for line in f if line.strip())
            for line in itertools.islice(lines, start, stop):
                yield json.loads(line)
            return
        # Lines end at "\n" alone, as the offset table counts them (universal newlines would
        # also end one at a lone "\r"); a row is its line less "\n" or "\r\n", as take() reads
        # it (a last line without "\n" keeps a final "\r": it ends no line). Inline: a call
        # per row would double this loop's cost.
        text = io.TextIOWrapper(f, encoding="utf-8", newline="\n")
        for row in itertools.islice(text, start, stop):
            cut = row.removesuffix("\n")
            yield cut.removesuffix("\r") if len(cut) < len(row) else cut


def rows_by_take(
    take: Callable[[Any, np.ndarray], list[Any]],
    shard: Any,
    start: int,
    stop: int,
    *,
    step: int = 256,
) -> Iterator[Any]:
    """The range form of a reader that reads by index: rows ``[start, stop)`` of ``shard``,
    ``step`` rows per ``take``."""
    for a in range(start, stop, step):
        yield from take(shard, np.arange(a, min(a + step, stop), dtype=np.int64))


def shard_name(shard: Any) -> str:
    """How messages name a shard: its path, or a callable's identity."""
    return callable_identity(shard) if callable(shard) else os.fspath(shard)


class RowCursor:
    """Reads one shard through a range reader: one call ``reader(shard, start, None)`` per
    span of wanted rows, read on while the next span starts at or after where the last one
    ended (a rank reading on through its rows opens the shard once), and the rows read kept
    while a later step may still ask for them, so the steps that draw from one shuffle window
    read it once. (Each data rank reads the spans it draws from whole: give the reader
    ``take`` to read only its own rows.)

    ``window``: how far back a later call may reach, the stream's ``shuffle_buffer``. The steps
    of a pass ask for a shard's rows window by window, in any order within one, so every row
    a later step asks for lies at most ``window - 1`` rows before the last row asked for: the
    rows read from there on are kept (at most ``window`` rows, or one call's span where that is
    longer), those before it dropped. Without it (0), the span read last is kept. A row asked
    for before what is kept (a new pass) starts the reader over at it.

    A kept row is handed out once: asked for again (a later epoch, a retry) it is read again,
    as a new call of the shard would give it, so an in-place edit of a row handed out (a
    ``map``, a ``collate_fn``) never reaches a later read. A row asked for twice in one call
    is handed out once and a ``copy.deepcopy`` of it made before either leaves (a row that
    cannot be deep-copied is handed out twice as it is).

    ``seeks``: the reader opens a shard at any row cheaply (its contract), so a span further
    on than a window is opened there; without it (a callable shard, read from its start) the
    kept iterator is read forward to the span, and started over only for a row before its
    position that is not kept.
    """

    def __init__(self, reader: Any, shard: Any, *, seeks: bool = True, window: int = 0) -> None:
        self.reader, self.shard, self.seeks, self.window = reader, shard, seeks, window
        self.it: Any = None
        self.at = 0  # the row the iterator gives next; the kept rows end there
        self.span_start = 0
        self.span: list[Any] = []  # rows [span_start, at); rows handed out already are _GIVEN

    def take(self, rows: np.ndarray) -> list[Any]:
        lo0, kept = self.span_start, self.span
        hi0 = lo0 + len(kept)
        wanted = rows.tolist()
        missing = [r for r in wanted if not (lo0 <= r < hi0 and kept[r - lo0] is not _GIVEN)]
        if not missing:
            return _hand_out(wanted, lo0, kept, 0, kept)
        lo, hi = min(missing), max(missing) + 1
        keep = min(lo, hi - self.window)  # the first row a later call may still ask for
        span: list[Any]
        if self.it is None or lo < self.at or (keep > self.at and self.seeks):
            # Opened at keep (lo without a window): a seeking reader never reads the rows
            # other ranks read before it, and a window's rows before lo are kept for the
            # steps that ask for them later.
            start, span = max(keep, 0), []
            self.it, self.at = iter(self.reader(self.shard, start, None)), start
        elif keep > self.at:  # read on to keep: the rows before it are neither asked nor kept
            start, span = keep, []
        else:  # read on from the kept rows' end: they are kept on
            start, span = lo0, kept
        first = max(start, self.at)  # the row read first
        try:
            if first > self.at:
                next(itertools.islice(self.it, first - self.at, first - self.at), None)
            read = list(itertools.islice(self.it, hi - first))
        except BaseException:
            self.it = None  # a reader that raised is not read on
            raise
        if len(read) != hi - first:
            self.it = None
            raise _past_end(self.shard, hi - 1, first + len(read))
        self.at = hi
        if len(wanted) == hi - lo and wanted == list(range(lo, hi)):
            # a run read on in order (no shuffle window): every row of it handed out as read
            out = read[lo - first :]
            span += read[: lo - first]
            span += itertools.repeat(_GIVEN, hi - lo)
        else:
            span += read
            out = _hand_out(wanted, start, span, lo0, kept)
        if keep > start:
            del span[: keep - start]
            start = keep
        self.span_start, self.span = start, span
        return out


_GIVEN: Any = object()  # in RowCursor.span: a row handed out already


def _copy(row: Any) -> Any:
    """A deep copy of ``row``; a row that cannot be copied (it holds a generator, a lock, ...)
    is handed out again as it is, as it was before rows were copied."""
    try:
        return copy.deepcopy(row)
    except Exception:
        return row


def _hand_out(wanted: list[int], lo: int, span: list[Any], lo0: int, kept: list[Any]) -> list[Any]:
    """Rows ``wanted`` from ``span`` (rows from ``lo``), else from ``kept`` (rows from
    ``lo0``, none of the wanted ones handed out), each marked handed out; a row wanted twice
    is handed out once, its other places get deep copies (made before any of them leaves)."""
    hi = lo + len(span)
    out: list[Any] = []
    append = out.append
    for r in wanted:
        if lo <= r < hi:
            held, i = span, r - lo
        else:
            held, i = kept, r - lo0
        row = held[i]
        if row is _GIVEN:  # asked twice in this call
            row = _copy(out[wanted.index(r)])
        else:
            held[i] = _GIVEN
        append(row)
    return out


def default_reader(shard: Any, start_row: int, stop_row: int | None) -> Iterator[Any]:
    """Rows ``[start_row, stop_row)`` of a callable shard or a text / JSON-lines file."""
    return DefaultReader()(shard, start_row, stop_row)
