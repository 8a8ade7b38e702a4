"""Dynamic sampling: a filter on whole groups, run in the store where groups become ready.

DAPO drops the GRPO groups that carry no signal (every answer's reward equal). A get with
``group_filter=fn`` and a :class:`~meshfeed.queue.samplers.GroupSampler` (or a rank-aware
one around it) calls ``fn({field: [value per sample]})`` on each complete group of its task
not judged before, with the request's ``fields``; a group it rejects is consumed for the task
without being delivered and counted in ``stats()["filtered"]``, and the sampler fills the
batch from later groups, so every batch stays full. It runs while the batch is planned under
the store's lock, so a rank-aware round (planned once for every data rank) is the same on
every rank, and the kept groups are the same whichever rank asked first.

A filter that raises is reported by name (``ValueError``, the cause chained) and changes
nothing: no group is consumed, counted or marked kept. Per task, the samples of kept groups
are remembered until the task consumes them (:func:`consumed`), so a filter runs once per
group, and a group id used again later (the same prompt sampled again) is judged again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshfeed.queue.engine.records import Partition, View
from meshfeed.queue.engine.versions import book_of
from meshfeed.queue.request import GetRequest
from meshfeed.queue.samplers import GroupSampler, RankAwareSampler, Sampler

__all__ = ["Varies", "check_group_filter", "consumed", "rejected"]

Key = Hashable


@dataclass(frozen=True, kw_only=True, slots=True)
class Varies:
    """DAPO's filter: keep a group whose ``field`` (e.g. the rewards) is not the same for
    every sample, i.e. one with a GRPO advantage. Importable, so it pickles by reference to
    a Ray store (a function of a script's ``__main__`` does not)."""

    field: str = "reward"

    def __call__(self, group: Mapping[str, list[Any]]) -> bool:
        values = group[self.field]
        first = values[0]
        return any(bool(v != first) for v in values[1:])


def _groups_of(sampler: Sampler) -> GroupSampler | None:
    if isinstance(sampler, RankAwareSampler):
        sampler = sampler.inner
    return sampler if isinstance(sampler, GroupSampler) else None


def check_group_filter(group_filter: Any, sampler: Sampler) -> Callable[..., Any] | None:
    """A get's ``group_filter``, checked against its sampler."""
    if group_filter is None:
        return None
    if not callable(group_filter):
        raise TypeError(
            f"group_filter must be a function of a group's fields returning True to keep it "
            f"(got {group_filter=!r})"
        )
    if _groups_of(sampler) is None:
        raise ValueError(
            f"group_filter judges whole groups, but the sampler {sampler!r} does not hand out "
            "groups; use GroupSampler(group_size=...) (rank-aware on a mesh)"
        )
    return group_filter


def rejected(part: Partition, request: GetRequest, pending: Mapping[Key, None]) -> list[Key]:
    """The samples of the complete groups ``request.group_filter`` rejects (not judged
    before); counts them in the partition's :class:`Book`. A filter that raises changes
    nothing (the groups judged before it in this call are judged again next time)."""
    groups = _groups_of(request.sampler)
    fn = request.group_filter
    assert groups is not None and fn is not None  # checked by check_group_filter
    book = book_of(part)
    kept = book.kept.get(request.task, set())
    view = View(part, pending, request.need)  # type: ignore[arg-type]
    out: list[Key] = []
    keep_now: list[Key] = []
    dropped = 0
    for members in groups.complete_groups(view, None):
        if members[0] in kept:
            continue
        values = {f: [view.value(k, f) for k in members] for f in request.fields}
        try:
            keep = bool(fn(values))
        except Exception as exc:
            gid = view.group(members[0]) if not groups.consecutive_ids else tuple(members)
            raise ValueError(
                f"group_filter raised {exc!r} on group {gid!r} of {request.partition!r}; "
                "nothing was consumed (fix the filter: it must return True to keep a group)"
            ) from exc
        if keep:
            keep_now.extend(members)
        else:
            out.extend(members)
            dropped += 1
    if keep_now:
        book.kept.setdefault(request.task, set()).update(keep_now)
    if dropped:
        book.filtered[request.task] = book.filtered.get(request.task, 0) + dropped
    return out


def consumed(part: Partition, task: str, keys: Iterable[Key]) -> None:
    """``task`` consumed ``keys`` (delivered or not): they leave its kept groups."""
    book = part.book
    if book is not None:
        kept = book.kept.get(task)
        if kept:
            kept.difference_update(keys)
