"""The cached shards one process keeps held between its reads, and when it lets them go.

A stream reads a shuffle window's shards batch after batch: letting a shard go after each read
would re-hold it in the cache (a lock, its sidecar) and re-open it in the inner reader (header,
index) for the next batch, about half of a 2-worker epoch's CPU time in the workers' reads
under a cache limit (py-spy, #29). So
:class:`Holds` keeps each shard from one read to the next, and lets it go (the caller's
``let_go``: the inner reader's map, then the cache's hold) when:

- its rows are all returned (:meth:`Holds.finish`, told by the stream's order);
- it has not been read for ``idle`` seconds: a watcher thread lets go of those, so a process
  that waits for its next task (a worker ahead of the training loop) never keeps another
  process of the node from the room it waits for (a worker holding shards while another waited
  for room hung a 2-rank x 2-worker epoch for ``lock_timeout``);
- the process needs room itself (:meth:`Holds.let_go_idle`), or more than ``keep`` are held
  (least recently used first), or :meth:`Holds.close`.

A shard being read (between :meth:`Holds.use` or :meth:`Holds.add` and :meth:`Holds.done`) is
never let go by the watcher or by a request for room. Thread-safe; ``idle=None`` (no cache
limit: nothing is ever evicted) keeps holds until ``keep`` is exceeded and starts no thread.
A forked child must build its own :class:`Holds` (the parent's belong to the parent).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["IDLE", "Holds"]

#: seconds a held shard may go unread before the watcher lets it go
IDLE = 0.25


@dataclass(slots=True)
class _Hold:
    path: str
    used: float  # time.monotonic() of the last read's end
    busy: int = 0  # reads in progress


class Holds:
    """Held shards of one process, least recently used first (see the module docstring).
    ``let_go(url, path)`` is called once per hold let go, outside the lock."""

    def __init__(
        self, let_go: Callable[[str, str], None], *, keep: int, idle: float | None
    ) -> None:
        self._let_go, self.keep, self.idle = let_go, keep, idle
        self._lock = threading.Lock()
        self._held: OrderedDict[str, _Hold] = OrderedDict()
        self._watching = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def urls(self) -> list[str]:
        """The held URLs, least recently used first."""
        with self._lock:
            return list(self._held)

    def use(self, url: str) -> str | None:
        """The local path of ``url`` if held (marked read until :meth:`done`), else None."""
        with self._lock:
            hold = self._held.get(url)
            if hold is None:
                return None
            self._held.move_to_end(url)
            hold.busy += 1
            return hold.path

    def add(self, url: str, path: str) -> None:
        """``url`` was just held at ``path`` for a read (until :meth:`done`)."""
        with self._lock:
            old = self._held.pop(url, None)
            busy = 1 if old is None else old.busy + 1
            self._held[url] = _Hold(path, time.monotonic(), busy)
            extra = max(0, len(self._held) - self.keep)
            over = [u for u, h in self._held.items() if not h.busy][:extra]
            gone = self._pop(over)
            watch = self.idle is not None and not self._watching
            self._watching = self._watching or watch
        if old is not None:  # held twice (two threads raced for it): one hold is enough
            self._let_go(url, old.path)
        self._release(gone)
        if watch:
            threading.Thread(target=self._watch, name="meshfeed-holds", daemon=True).start()

    def done(self, url: str) -> None:
        """A read of ``url`` ended."""
        with self._lock:
            hold = self._held.get(url)
            if hold is not None:
                hold.busy = max(0, hold.busy - 1)
                hold.used = time.monotonic()

    def finish(self, urls: Iterable[str]) -> None:
        """Let go of ``urls`` (their rows are all returned) unless a read uses them now."""
        with self._lock:
            gone = self._pop([u for u in urls if u in self._held and not self._held[u].busy])
        self._release(gone)

    def let_go_idle(self) -> None:
        """Let go of every hold no read uses now (the process needs room in the cache)."""
        with self._lock:
            gone = self._pop([u for u, h in self._held.items() if not h.busy])
        self._release(gone)

    def close(self) -> None:
        """Let go of every hold."""
        with self._lock:
            gone = self._pop(list(self._held))
        self._release(gone)

    def _pop(self, urls: list[str]) -> list[tuple[str, str]]:
        return [(u, self._held.pop(u).path) for u in urls]

    def _release(self, gone: list[tuple[str, str]]) -> None:
        for url, path in gone:
            self._let_go(url, path)

    def _watch(self) -> None:
        """Let go of the holds unread for ``idle`` seconds; end once none is held (the next
        :meth:`add` starts another watcher)."""
        idle = float(self.idle or 0.0)
        while True:
            time.sleep(idle / 4)
            stale = time.monotonic() - idle
            with self._lock:
                gone = self._pop(
                    [u for u, h in self._held.items() if not h.busy and h.used < stale]
                )
                ending = not self._held
                if ending:
                    self._watching = False
            self._release(gone)
            if ending:
                return
