"""Policy versions in the sample store: bounded staleness, admission control, partial rollouts.

A put may carry the ``version`` of the weights that produced it; a get may carry the trainer's
``version`` and a ``max_staleness``. Per partition a :class:`Book` (made on the first
versioned call, so unversioned stores pay nothing) keeps:

- each versioned sample's ``(oldest, newest)`` version over the puts that wrote its fields (a
  partial rollout continued under newer weights widens it); a get judges a sample by the one
  it names (``version_of="oldest"``, the default, or ``"newest"``);
- the group of each held sample put with one, and each group's version (``None``: a group put
  without versions), from the puts since the book was made and the samples held then;
- per task the trainer's newest ``version``, its ``max_staleness`` and how many samples one
  get plans (a rank-aware round): a plain get whose version goes backwards is refused by name
  (a loader's requests, fetched ahead by several ranks, may arrive out of order: each is
  served by its own version's bound, and ``StoreLoader.set_version`` refuses going back);
  and its last request, which admission asks whether a round is ready;
- per task the stale samples dropped and the groups a filter dropped (``stats()``).

Rules, applied in the store under its lock, so every data rank and both backends see the same:

- **bounded staleness**: before a get with ``max_staleness=s`` plans, every pending versioned
  sample of its task whose version is below ``version - s`` is consumed for the task without
  being delivered and counted in ``stale`` (no sample older than ``s`` is ever served). A
  group is judged once, whole: it is as old as its oldest pending member (by the version the
  get names), so it is dropped or kept whole, never split (a group sampler would wait forever
  for the dropped half);
- **admission**: a versioned put is refused by name (:class:`StaleVersion`) when every task
  that reads the partition bounds staleness and the put is already too old for all of them
  (waiting cannot make it fresher), and a put of new samples waits while a bounded task has
  ``(s + 1) * round`` unconsumed samples ahead already (what the trainer can take before they
  go stale) *and* its get could plan a round of them now. A put that overshoots is admitted,
  and so is any put while no round is ready for the task's get (incomplete groups, fields
  still missing): that get waits on the producers, so a put never waits on a get waiting on
  it, and the excess is what completes a round, never more once one is ready;
- **groups**: the new samples of a group are all of one version, and a group is all versioned
  or all unversioned (a put that splits a group across versions, or mixes versioned and
  unversioned samples in it, is refused by name: a get bounding staleness would split it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from meshfeed.queue.request import GetRequest, PutRequest

__all__ = [
    "VERSION_OF",
    "Book",
    "StaleVersion",
    "book_of",
    "check_staleness",
    "check_version",
    "check_version_of",
]

Key = Hashable
VERSION_OF = ("oldest", "newest")
_NO_GROUP = object()  # a group the book does not know (no held sample of it)


class Stored(Protocol):
    """What admission reads of a partition (a ``records.Partition``): its samples and each
    task's pending ones. A protocol, so this module stays below the records it is kept in."""

    @property
    def samples(self) -> Mapping[Key, Any]: ...

    @property
    def pending(self) -> Mapping[str, Mapping[Key, None]]: ...


class Booked(Protocol):
    """A partition as :func:`book_of` reads it: its book (if made) and its samples."""

    book: Book | None

    @property
    def samples(self) -> Mapping[Key, Any]: ...


def book_of(part: Booked) -> Book:
    """The partition's :class:`Book`, made on its first versioned call and told the groups of
    the samples it holds already (put unversioned before: a versioned put may not join them)."""
    book = part.book
    if book is None:
        book = part.book = Book()
        book.join_held(part.samples, {})
    return book


class StaleVersion(ValueError):
    """A versioned put that every bounded reader of its partition would drop as stale: the
    producer's weights are too old; load newer ones and generate again."""


def check_version(value: Any, what: str = "version") -> int | None:
    """``value`` as a policy version (an int >= 0) or ``None``; refused by name otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(
            f"{what} must be a policy version, an int >= 0, or None (got {what}={value!r}); "
            "pass the number of optimizer steps of the weights"
        )
    return value


def check_staleness(version: Any, max_staleness: Any) -> int | None:
    """A get's ``max_staleness``, checked (it needs the trainer's ``version``)."""
    if max_staleness is None:
        return None
    max_staleness = check_version(max_staleness, "max_staleness")
    if version is None:
        raise ValueError(
            f"max_staleness={max_staleness} bounds the lag behind the trainer's version; "
            "pass version= (the trainer's current policy version) with it"
        )
    return max_staleness


def check_version_of(version_of: Any) -> str:
    if version_of != "oldest" and version_of not in VERSION_OF:
        raise ValueError(f"version_of must be one of {VERSION_OF} (got {version_of=!r})")
    return version_of


class Book:
    """The version bookkeeping of one partition (see the module docstring)."""

    __slots__ = (
        "asks",
        "filtered",
        "group_of",
        "groups",
        "kept",
        "members",
        "refused",
        "stale",
        "trainers",
        "versions",
    )

    def __init__(self) -> None:
        self.versions: dict[Key, tuple[int, int]] = {}  # sample -> (oldest, newest)
        self.trainers: dict[str, tuple[int, int | None, int]] = {}  # version, staleness, round
        self.stale: dict[str, int] = {}
        self.filtered: dict[str, int] = {}
        # A group's version, from its first put (None: a group put without versions).
        self.groups: dict[Hashable, int | None] = {}
        # The group of each held sample put with one, and each group's count of them: a
        # group's version goes with its last sample, so an id used again later (the same
        # prompt sampled again) starts a new group.
        self.group_of: dict[Key, Hashable] = {}
        self.members: Counter[Hashable] = Counter()
        self.kept: dict[str, set[Key]] = {}  # per task, samples of groups a filter kept
        # Per task its last get (not in the checkpoint): admission asks whether it could plan
        # a round now. ``refused``: a put waited for admission since a get last woke it.
        self.asks: dict[str, GetRequest] = {}
        self.refused = False

    # ----------------------------------------------------------------- puts
    def admit(
        self,
        partition: str,
        store: Stored,
        request: PutRequest,
        ids: list[Key],
        n_new: int,
        v: int,
        ready: Callable[[str], bool],
    ) -> bool:
        """Whether the put of version ``v`` may land now (``False``: wait for the trainer to
        consume); raises for a put that never can (stale, too large, backwards, a split
        group). ``store``: the partition's samples and each task's pending ones;
        ``ready(task)``: whether the task's get could plan a round of its pending samples
        now (``True`` when not known)."""
        self._check_rewrite(partition, ids, v)
        self.check_groups(partition, store.samples, request, ids, v)
        bounded = {t: tr for t, tr in self.trainers.items() if tr[1] is not None}
        if bounded and set(bounded) >= set(store.pending):
            floors = {t: tr[0] - tr[1] for t, tr in bounded.items()}  # type: ignore[operator]
            if v < min(floors.values()):
                raise StaleVersion(
                    f"a put of version={v} to {partition!r} is older than every reader "
                    f"accepts (trainer version - max_staleness per task: {floors}); load "
                    "newer weights and generate again"
                )
        # Waits only while the task has (s + 1) rounds unconsumed already and its get could
        # take one now: a put that overshoots is admitted, and so is a put while no round is
        # ready (incomplete groups): that get waits on the producers, so a put never waits on
        # a get that waits on it (#28).
        if not n_new:
            return True
        pending = store.pending
        for task, tr in bounded.items():
            ahead = (tr[1] + 1) * tr[2]  # type: ignore[operator]
            if len(pending.get(task, ())) >= ahead and ready(task):
                self.refused = True
                return False
        return True

    def _check_rewrite(self, partition: str, ids: list[Key], v: int) -> None:
        versions = self.versions
        for k in ids:
            old = versions.get(k)
            if old is not None and v < old[1]:
                raise ValueError(
                    f"sample {k!r} of {partition!r} has fields of version {old[1]}; a put of "
                    f"version={v} goes backwards (a partial rollout continues under the same "
                    "or newer weights)"
                )

    def check_groups(
        self,
        partition: str,
        samples: Mapping[Key, Any],
        request: PutRequest,
        ids: list[Key],
        v: int | None,
    ) -> None:
        """Refuse a put (of version ``v``, ``None``: unversioned) whose new samples would
        split a held group across versions, or mix versioned and unversioned samples in it."""
        if request.groups is None:
            return
        groups = self.groups
        for k, g in zip(ids, request.groups, strict=True):
            if k in samples:
                continue
            first = groups.get(g, _NO_GROUP)
            if first is _NO_GROUP or first == v:
                continue
            if first is not None and v is not None:
                raise ValueError(
                    f"group {g!r} of {partition!r} has samples of version {first}; a put of "
                    f"its sample {k!r} with version={v} would split it across versions "
                    "(generate a group's answers with one set of weights)"
                )
            was = "without a version" if first is None else f"with version={first}"
            now = "without a version" if v is None else f"with version={v}"
            raise ValueError(
                f"group {g!r} of {partition!r} has samples put {was}; a put of its sample "
                f"{k!r} {now} would mix versioned and unversioned samples in one group (a get "
                "bounding staleness would drop part of it); put every sample of a group with "
                "the version of the weights that generated it, or none of them with one"
            )

    def record(self, request: PutRequest, ids: list[Key], v: int | None) -> None:
        """A put of version ``v`` (``None``: unversioned, with groups) landed: widen each
        sample's versions, note its groups'."""
        if v is not None:
            versions = self.versions
            for k in ids:
                old = versions.get(k)
                versions[k] = (v, v) if old is None else (min(old[0], v), max(old[1], v))
        if request.groups is not None:
            for k, g in zip(ids, request.groups, strict=True):
                self._join(k, g, v)

    def join_held(self, held: Mapping[Key, Any], groups: Mapping[Hashable, int]) -> None:
        """Note the group of every sample in ``held`` put with one (a record's ``group``);
        ``groups``: the versions of groups known already (a checkpoint's), else a group's
        version is its first versioned sample's oldest (``None``: unversioned)."""
        versions = self.versions
        for k, record in held.items():
            g = getattr(record, "group", None)
            if g is not None:
                vv = versions.get(k)
                self._join(k, g, groups.get(g, None if vv is None else vv[0]))

    def _join(self, k: Key, g: Hashable, v: int | None) -> None:
        self.groups.setdefault(g, v)
        was = self.group_of.get(k)
        if was != g:
            if was is not None:
                self._leave(was)
            self.group_of[k] = g
            self.members[g] += 1

    def forget(self, keys: Iterable[Key]) -> None:
        """Samples ``keys`` left the store: their versions go, and a group's version with
        its last sample."""
        versions, group_of = self.versions, self.group_of
        for k in keys:
            versions.pop(k, None)
            if group_of:
                g = group_of.pop(k, None)
                if g is not None:
                    self._leave(g)

    def _leave(self, g: Hashable) -> None:
        members = self.members
        members[g] -= 1
        if members[g] <= 0:
            del members[g]
            self.groups.pop(g, None)

    # ----------------------------------------------------------------- gets
    def observe(self, request: GetRequest, size: int, v: int) -> None:
        """Note the trainer's version ``v`` of a get (refusing one that goes backwards).
        Requests with a ``batch_index`` (a loader's, fetched ahead, several ranks) may arrive
        out of order: an older one is served by its own version's bound, and the newest is
        kept; the loader refuses a version that goes backwards (``set_version``)."""
        last = self.trainers.get(request.task)
        if last is not None and v < last[0]:
            if request.batch_index is None:
                raise ValueError(
                    f"task {request.task!r} asked with version={v} after version={last[0]}; "
                    "a trainer's version never goes backwards (pass the current optimizer step)"
                )
            v = last[0]
        self.trainers[request.task] = (v, request.max_staleness, size)
        self.asks[request.task] = request

    def stale_keys(self, pending: Mapping[Key, None], request: GetRequest) -> list[Key]:
        """The pending samples of the request's task older than it accepts: a group is as
        old as its oldest pending member (by ``request.version_of``), so its pending
        samples go together or stay together."""
        if request.max_staleness is None or request.version is None:
            return []
        floor = request.version - request.max_staleness
        at = 0 if request.version_of == "oldest" else 1
        stale = [k for k, vv in self.versions.items() if vv[at] < floor and k in pending]
        if stale and self.group_of:
            return self._whole_groups(stale, pending)
        return stale

    def _whole_groups(self, stale: list[Key], pending: Mapping[Key, None]) -> list[Key]:
        """``stale`` with the other pending members of their groups."""
        group_of = self.group_of
        hit = {group_of[k] for k in stale if k in group_of}
        if not hit:
            return stale
        out = set(stale)
        more = [k for k, g in group_of.items() if g in hit and k in pending and k not in out]
        return stale + more

    def of(self, ids: list[Key], version_of: str) -> list[int | None]:
        """The versions of ``ids`` (``None``: unversioned), as the request names them."""
        at = 0 if version_of == "oldest" else 1
        get = self.versions.get
        return [None if (vv := get(k)) is None else vv[at] for k in ids]

    # ----------------------------------------------------------------- state
    def stats(self) -> dict[str, Any]:
        """What ``stats()["partitions"][name]`` adds: counts per task, trainer versions and
        the held samples per version."""
        per_version = Counter(lo for lo, _ in self.versions.values())
        return {
            "stale": dict(self.stale),
            "filtered": dict(self.filtered),
            "trainer_versions": {t: tr[0] for t, tr in self.trainers.items()},
            "held_versions": dict(sorted(per_version.items())),
        }

    def to_meta(self) -> dict[str, Any]:
        return {
            "versions": [[k, lo, hi] for k, (lo, hi) in self.versions.items()],
            "trainers": {t: list(tr) for t, tr in self.trainers.items()},
            "stale": dict(self.stale),
            "filtered": dict(self.filtered),
            # Versioned groups only: an unversioned one is rebuilt from its held samples.
            "groups": [[g, v] for g, v in self.groups.items() if v is not None],
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], held: Mapping[Key, Any]) -> Book:
        book = cls()
        book.versions = {k: (int(lo), int(hi)) for k, lo, hi in meta["versions"] if k in held}
        book.trainers = {
            str(t): (int(v), None if s is None else int(s), int(n))
            for t, (v, s, n) in meta["trainers"].items()
        }
        book.stale = {str(t): int(n) for t, n in meta["stale"].items()}
        book.filtered = {str(t): int(n) for t, n in meta["filtered"].items()}
        book.join_held(held, {g: int(v) for g, v in meta["groups"]})
        return book
