"""BalancedBatches: rebalance a per-rank iterator of packed samples over a DP x CP group.

Per global batch, every rank of ``group``: takes its next packed sample from ``inner``; joins
**one** all-gather of a header (has-data flag, dtype signature, configuration digest, document
lengths and corpus ids);
computes the same :func:`schedule_documents` as every other rank; joins **one** variable-size
``all_to_all_single`` carrying all keys of all documents fused; and yields its micro-steps.
If any rank's inner iterator ends, every rank stops at the same batch (no hang); if it raises,
that rank raises its error and every other rank :class:`~meshfeed.errors.RankError` naming it,
at the same batch.

Before its first header, each instance joins one fixed-size all-gather of its settings
(``max_tokens``, ``cost``, ``cp_sizes``, ``tp``, ``keys``, ``pad``, ``max_docs_per_rank``,
``long_documents``, ``plan_ahead``, ``document_fields``): ranks built differently would plan
differently, yield different numbers of micro-steps or size the header's buffer differently, so
every rank refuses that, naming the setting and each rank's value. The collectives run on a gloo
group of meshfeed's own over ``group``'s ranks whose timeout is ``timeout`` (module
:mod:`meshfeed.balance._group`; an NCCL group's ``all_to_all`` of the tokens stays on it), so a
rank that gave up on a stalled peer can exit.

Planning runs one batch ahead on a background thread (the lengths of batch t+1 are gathered
before batch t is rerouted), so it is off the critical path; collectives stay on the calling
thread, in the same order on every rank.

Each yielded micro-step is a dict: the per-token keys (with this rank's zigzag chunks of a
split document), ``cu_seqlens`` (int32, over the chunks this rank holds), ``doc_ids`` (each
document's position in the global batch: source rank order, then position in its sample),
``document_ids`` (each document's corpus id, aligned with ``cu_seqlens``, int64; present when
every rank's packed sample carries ``document_ids``, as :func:`packed_document_loader`'s do; a
uint64 id past int64 is refused on every rank, naming it, rather than wrapped to a negative one),
``cp_group`` (global ranks running this micro-step together), ``cp_rank``, ``microstep`` and
``num_microsteps``.

Per-document fields (``document_fields=("pixel_values", "image_grid_thw")``: a tensor of the
documents' rows back to back plus ``<name>_offsets``, as ``SampleFields(concat_fields=...)``
packs them) travel with their document in one more ``all_to_all_single``: every rank holding a
piece of a document gets all of its rows (module :mod:`meshfeed.balance.document_fields`), and
each micro-step holds ``<name>`` for its documents in ``doc_ids`` order with ``<name>_offsets``.
A field the sample holds that is neither a key, a document field nor carried is refused by
name rather than dropped.

A document longer than the group can hold (every rank of the largest CP group at
``max_tokens``) follows ``long_documents``: ``"refuse"`` (an error naming its corpus id),
``"truncate"`` or ``"split"`` (see :mod:`meshfeed.balance.long_documents`). With tensor parallelism, build one instance per TP rank over that rank's
DP x CP group: all of them compute the same placement.

State is the envelope ``{"kind": "balanced_batches", "version": 2, "inner", "skip",
"microsteps", "plan"}``: the inner iterator's state before the current batch, how many of its
micro-steps were yielded, how many it has (0 when ``skip`` is 0), and the settings that plan it
(``max_tokens``, ``cost``, ``cp_sizes``, ``tp``, ``long_documents`` and the group's size
``ranks``). Restoring refetches that batch and skips them. A state taken partway through a batch
is refused by a BalancedBatches that would plan it otherwise (naming the setting), and one whose
``skip`` is more than the batch's micro-steps (at load, or at the batch when the state predates
``microsteps``): skipping other micro-steps would lose documents or serve them twice. A state
taken between batches (``skip`` 0) resumes under any settings.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshfeed import dist
from meshfeed.balance._group import exchange_group, own_group
from meshfeed.balance.cost import CostModel
from meshfeed.balance.document_fields import (
    OFFSETS,
    build_field_send,
    check_field_names,
    document_bytes,
    field_rows,
    field_specs,
    normalize_fields,
    unpack_fields,
)
from meshfeed.balance.long_documents import check_policy, fit_sample, max_document_tokens
from meshfeed.balance.packing import check_int
from meshfeed.balance.routing import Layout, build_send, doc_lengths, fields_signature, unpack
from meshfeed.balance.schedule import DEFAULT_COST, Placement, schedule_documents
from meshfeed.errors import CollectiveError, RankError
from meshfeed.keys import DEFAULT_KEYS, DEFAULT_PAD, DOCUMENT_IDS
from meshfeed.protocols import Stateful
from meshfeed.runtime.failures import error_text
from meshfeed.state import check_count, envelope, open_envelope

__all__ = ["BalancedBatches"]

_KIND = "balanced_batches"
_VERSION = 2  # 1 had no kind; the header of the all-gather changed with it
#: has_data, dtype signature, documents, has_ids (whether the sample carries corpus ids), the
#: digest of the settings every rank agreed on; then their lengths and corpus ids (any int64,
#: negative ones too; zeros without ids)
_HEADER = 5
#: has_ids when the sample's corpus ids are uint64 with one past int64: the ids then travel as
#: their bit patterns, so that every rank refuses the batch with the same error (no hang)
_WIDE_IDS = 2
#: has_data of a rank whose sample failed its checks there: every rank raises at this batch
#: (that rank its own error), none waits for the next all-gather until its timeout
_REFUSED = -1
#: has_data of a rank whose inner iterator raised: ``documents`` is then the byte count of the
#: error's text, which follows the header (so every other rank names it), at most _ERROR_BYTES
_RAISED = -2
_ERROR_BYTES = 240
#: What a packed sample may hold beyond ``keys``: what the micro-steps carry, rebuilt
_CARRIED = frozenset({"cu_seqlens", DOCUMENT_IDS})
_INT64_MAX = np.iinfo(np.int64).max
#: The settings that decide a batch's micro-steps (with the group's size, ``ranks``): a state
#: taken partway through a batch resumes only where they are the same
_PLAN = ("max_tokens", "cost", "cp_sizes", "tp", "long_documents")
#: Most documents one rank's packed sample may hold: the all-gather buffer has two slots per
#: document on every rank (8 bytes each: length and corpus id), allocated at every batch.
MAX_DOCS_PER_RANK = 2**20


def _on_cpu(sample: Any) -> Any:
    """A packed sample with its tensors on the CPU, where BalancedBatches plans and packs
    them (an inner loader with ``device="cuda"``: the tokens arrive on the CPU either way, and
    an NCCL group's ``all_to_all`` moves them to the GPU itself)."""
    if not isinstance(sample, Mapping) or all(
        not isinstance(v, torch.Tensor) or v.device.type == "cpu" for v in sample.values()
    ):
        return sample
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in sample.items()}


class _Comm:
    """The collectives this module makes, through :mod:`meshfeed.dist` (device rule, bounded
    waits), on meshfeed's own gloo group over ``group``'s ranks (:func:`own_group`, made at the
    first collective); ``group`` names the ranks, and an NCCL group carries the ``all_to_all``
    (the tokens move on the GPU). A wait that fails names ``BalancedBatches(timeout=)``."""

    def __init__(self, group: Any, timeout: float) -> None:
        if group is not None and not dist.is_initialized():
            raise ValueError(
                "group was given but torch.distributed is not initialised; call "
                "init_process_group first or pass group=None for one process"
            )
        self.group = group
        self.timeout = timeout
        self.rank = dist.rank(group)
        self.size = dist.world_size(group)
        self._thread = threading.get_ident()  # the thread that built it (see _made)
        #: (control group, data group), made at the first collective
        self._groups: tuple[Any, Any] | None = None

    def device(self) -> torch.device:
        """Where the caller's group puts a collective's tensors (CUDA for NCCL, else CPU)."""
        return dist.group_device(self.group)

    def global_rank(self, r: int) -> int:
        return dist.global_rank(self.group, r)

    def agreement(self, values: Mapping[str, int]) -> dict[str, list[int]]:
        """Every rank's value of each of these ints: one all-gather of a fixed size."""
        group = self._made()[0]
        what = "settings all-gather (its first collective)"
        return self._bounded(what, dist.gather_agreement, values, self.timeout, group=group)

    def all_gather_objects(self, obj: Any) -> list[Any]:
        group = self._made()[0]
        what = "all-gather of the settings' values"
        return self._bounded(what, dist.all_gather_objects, obj, timeout=self.timeout, group=group)

    def all_gather(self, header: np.ndarray, max_len: int) -> list[np.ndarray]:
        group = self._made()[0]
        return self._bounded(
            "header all-gather",
            dist.all_gather_ints,
            header,
            max_len=max_len,
            timeout=self.timeout,
            group=group,
        )

    def all_to_all(
        self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]
    ) -> torch.Tensor:
        group = self._made()[1]
        return self._bounded(
            "all_to_all of the documents",
            dist.all_to_all_single,
            send,
            send_rows,
            recv_rows,
            timeout=self.timeout,
            group=group,
        )

    def _made(self) -> tuple[Any, Any]:
        """(the group of the control collectives, the group of the ``all_to_all``).

        The ``all_to_all`` runs on the caller's group where that is a GPU group (NCCL: the
        tokens move on the GPU), on the thread that built this only (:func:`exchange_group`).
        A delivery thread's groups are that walk's (:func:`meshfeed.dist.thread_group`): asked
        again each time, not kept here."""
        what = "process group's setup (its first collective)"
        if dist.on_delivery_thread():  # first: groups kept from another thread are not its own
            own = self._bounded(what, own_group, self.group, self.timeout)
            return own, own
        if self._groups is None:
            own = self._bounded(what, own_group, self.group, self.timeout)
            data = own
            if dist.is_distributed(self.group) and self.device().type != "cpu":
                args = (self.group, self.timeout, self._thread, "BalancedBatches")
                data = self._bounded(what, exchange_group, *args)
            self._groups = (own, data)
        return self._groups

    def _bounded(self, what: str, collective: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``collective(*args, **kw)``; a :class:`CollectiveError` names BalancedBatches."""
        try:
            return collective(*args, **kw)
        except CollectiveError as e:
            if e.reason == "timeout":
                message = (
                    f"rank {e.this_rank} waited more than BalancedBatches(timeout={self.timeout}) "
                    f"seconds for the other ranks of its group in BalancedBatches' {what}; a "
                    "rank has stalled, stopped iterating or is busy elsewhere (raise "
                    "BalancedBatches(timeout=) if a batch legitimately takes longer there)"
                )
            else:
                message = (
                    f"rank {e.this_rank}: a peer rank's connection closed after {e.elapsed:.1f}s "
                    f"in BalancedBatches' {what}: it died or exited without joining; see the "
                    "failed rank's own log"
                )
            raise CollectiveError(
                message, this_rank=e.this_rank, reason=e.reason, elapsed=e.elapsed
            ) from e


@dataclass(frozen=True, slots=True)
class _Refused:
    """A batch every rank refused alike, fetched ahead: raised once the batch before it has
    been served."""

    error: Exception


@dataclass(slots=True)
class _Batch:
    state: Any
    sample: Mapping[str, Any]
    counts: list[int]
    #: The corpus id of every document of the global batch, if all ranks sent them.
    ids: np.ndarray | None
    dtypes: list[torch.dtype]
    placement: Future[Placement]
    #: Every document's rows of each document field, (documents, fields).
    field_counts: np.ndarray
    specs: list[tuple[torch.dtype, tuple[int, ...]]]


class BalancedBatches:
    """Iterator of balanced micro-steps over ``group`` (see the module doc).

    ``inner`` yields this rank's packed samples (dicts of 1-D tensors named by ``keys`` plus
    ``cu_seqlens``); ``max_tokens``, ``cost``, ``cp_sizes`` and ``tp`` go to :func:`schedule_documents`.
    ``max_docs_per_rank`` sizes the fixed all-gather buffer (a sample with more documents is
    an error naming it). ``timeout`` bounds every wait: each collective and the planning of a
    batch. ``long_documents`` (``"refuse"``, ``"truncate"`` or ``"split"``) decides what
    happens to a document longer than the group can hold; pieces of a split document keep
    their order. ``document_fields`` names the per-document fields that travel with their
    documents (the module doc; every piece of a split document holds all of its rows).

    ``group`` (None: every rank) names the ranks; the collectives run on meshfeed's own gloo
    group over them, whose timeout is ``timeout`` (an NCCL group carries the tokens'
    ``all_to_all``). Every rank of it must build BalancedBatches with the same settings
    (checked at the first batch, the module doc).

    To checkpoint, ``inner`` must be :class:`~meshfeed.protocols.Stateful` (``state_dict()`` /
    ``load_state_dict(state)``; a meshfeed loader is, and is iterated epoch by epoch). A plain
    iterator without state is accepted, and then ``state_dict()`` raises ``TypeError``; one
    that has only half of the protocol is refused at construction, naming what it lacks.
    """

    def __init__(
        self,
        inner: Iterable[Mapping[str, Any]],
        *,
        max_tokens: int,
        cost: CostModel = DEFAULT_COST,
        group: Any = None,
        cp_sizes: str | Sequence[int] = "any",
        tp: int = 1,
        keys: Sequence[str] = DEFAULT_KEYS,
        pad: Mapping[str, int | None] = DEFAULT_PAD,
        max_docs_per_rank: int = 4096,
        plan_ahead: bool = True,
        timeout: float = 300.0,
        long_documents: str = "refuse",
        document_fields: Sequence[str] = (),
    ) -> None:
        # A float would be truncated by int() below and a bool would mean 1 document.
        check_int("max_docs_per_rank", max_docs_per_rank)
        if max_docs_per_rank > MAX_DOCS_PER_RANK:
            raise ValueError(
                f"max_docs_per_rank={max_docs_per_rank} is more than BalancedBatches plans "
                f"(MAX_DOCS_PER_RANK = 2**20 = {MAX_DOCS_PER_RANK}): every rank all-gathers 8 "
                "bytes per slot from every rank at each batch; size it to the most documents "
                "one packed sample holds"
            )
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or math.isnan(timeout)
            or timeout <= 0
        ):
            raise ValueError(f"timeout must be positive seconds (got {timeout=!r})")
        self._inner = _stateful_iterator(inner)
        if not isinstance(self._inner, Stateful):
            _refuse_partial_state(self._inner)
        self._comm = _Comm(group, float(timeout))
        self._plan_kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "cost": cost,
            "cp_sizes": cp_sizes,
            "tp": tp,
        }
        # Fail at construction, not at the first collective, on a bad configuration.
        schedule_documents([], num_ranks=self._comm.size, **self._plan_kwargs)
        self._policy = check_policy(long_documents)
        self._limit = max_document_tokens(
            num_ranks=self._comm.size, max_tokens=max_tokens, cp_sizes=cp_sizes, tp=tp
        )
        self._keys, self._pad = _check_keys(keys), _check_pad(pad)
        self._fields = check_field_names(document_fields, self._keys)
        self._carried = _CARRIED | set(self._fields) | {n + OFFSETS for n in self._fields}
        self._cap = int(max_docs_per_rank)
        self._timeout = float(timeout)
        #: What every rank must build alike (the module doc), checked at the first batch
        self._settings = _settings(
            max_tokens=int(max_tokens),
            cost=_plain_cost(cost),
            cp_sizes=cp_sizes if isinstance(cp_sizes, str) else sorted({int(c) for c in cp_sizes}),
            tp=int(tp),
            keys=list(self._keys),
            pad=sorted(((str(k), v) for k, v in self._pad.items()), key=lambda kv: kv[0]),
            max_docs_per_rank=self._cap,
            long_documents=self._policy,
            plan_ahead=bool(plan_ahead),
            document_fields=list(self._fields),
        )
        self._digest = _digest(repr(sorted(self._settings.items())))
        self._agreed_settings = False
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="meshfeed-plan") if plan_ahead else None
        )
        self._plan = {name: self._settings[name] for name in _PLAN} | {"ranks": self._comm.size}
        self._base_state: Any = self._inner_state()
        self._skip = 0
        #: The micro-steps of the batch ``_skip`` counts into, as the state recorded (0 when
        #: ``_skip`` is 0; None: a state from before they were recorded)
        self._microsteps: int | None = 0
        #: Why the loaded state cannot resume here, found at its batch: raised at every next()
        self._unresumable: ValueError | None = None
        self._reset()

    # --------------------------------------------------------------- iteration
    def __iter__(self) -> BalancedBatches:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._unresumable is not None:
            raise self._unresumable
        while self._k >= len(self._current):
            if self._done:
                raise StopIteration
            self._advance()
        item = self._current[self._k]
        self._k += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        """The state as of the last micro-step returned (JSON-serialisable if inner's is)."""
        self._stateful_inner()
        if self._current and self._k >= len(self._current) and isinstance(self._ahead, _Batch):
            return self._state(self._ahead.state, 0, 0)
        if self._current:
            return self._state(self._base_state, self._k, len(self._current))
        return self._state(self._base_state, self._skip, self._microsteps)

    def _state(self, inner: Any, skip: int, microsteps: int | None) -> dict[str, Any]:
        if microsteps is None:  # a state loaded from before they were kept, before its batch
            return envelope(_KIND, _VERSION, inner=inner, skip=skip)
        plan = dict(self._plan)
        return envelope(_KIND, _VERSION, inner=inner, skip=skip, microsteps=microsteps, plan=plan)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` output; every rank must load the same step."""
        fields = open_envelope(
            state, kind=_KIND, version=_VERSION, fields={"skip": int}, what="BalancedBatches state"
        )
        if "inner" not in fields:
            raise ValueError(
                "BalancedBatches state is missing 'inner'; the checkpoint is corrupted"
            )
        skip = fields["skip"]
        # 'microsteps' and 'plan' are optional: states written before they were kept lack them
        microsteps = fields.get("microsteps")
        if microsteps is not None:
            microsteps = check_count(microsteps, name="microsteps", what="BalancedBatches state")
            if skip > microsteps:
                raise ValueError(
                    f"BalancedBatches state has skip={skip}, more than the {microsteps} "
                    f"micro-steps of the batch it was taken in (microsteps={microsteps}); the "
                    "checkpoint is corrupted or was edited: load the dict that state_dict() "
                    "returned"
                )
        if skip:
            self._refuse_other_plan(fields.get("plan"), skip)
        self._stateful_inner().load_state_dict(fields["inner"])
        self._base_state, self._skip, self._microsteps = fields["inner"], skip, microsteps
        self._unresumable = None
        self._reset()

    def close(self) -> None:
        """Stop the planning thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> BalancedBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- internals
    def _refuse_other_plan(self, plan: Any, skip: int) -> None:
        """A state taken ``skip`` micro-steps into a batch, planned with ``plan`` (None: a state
        from before it was kept): refused where that batch would be planned otherwise."""
        if plan is None:
            return
        if not isinstance(plan, Mapping) or not all(
            isinstance(v, (int, str)) and not isinstance(v, bool) for v in plan.values()
        ):
            raise ValueError(
                f"BalancedBatches state field 'plan' is {plan!r}, not a dict of the settings "
                "that planned its batch; the checkpoint is corrupted"
            )
        differ = [n for n, v in self._plan.items() if n in plan and plan[n] != v]
        if not differ:
            return
        theirs = ", ".join(f"{n}={plan[n]}" for n in differ)
        mine = ", ".join(f"{n}={self._plan[n]}" for n in differ)
        ranks = " (ranks: the size of its group)" if "ranks" in differ else ""
        raise ValueError(
            f"BalancedBatches state was taken {skip} micro-steps into a batch planned with "
            f"{theirs}, and this BalancedBatches has {mine}{ranks}: it would plan that batch "
            "into other micro-steps, and skipping its first ones would lose documents or serve "
            f"them twice. Build BalancedBatches with {theirs} to resume it; a state taken "
            "between batches (skip 0) resumes under other settings"
        )

    def _check_resumed(self, microsteps: int) -> None:
        """Refuse to skip into the loaded state's batch, now planned into ``microsteps``, when
        the state's batch had another number of micro-steps or fewer than it skips."""
        skip, recorded = self._skip, self._microsteps
        if skip == 0 or (skip <= microsteps and recorded in (None, microsteps)):
            return
        if recorded is not None:
            why = (
                f"was taken {skip} micro-steps into a batch of {recorded}, which this "
                f"BalancedBatches plans into {microsteps}: the inner iterator resumed another "
                "batch, or the group or its settings differ from the run that wrote it"
            )
        else:
            why = (
                f"has skip={skip}, more than the {microsteps} micro-steps of the batch it "
                "resumes: the checkpoint is corrupted or was edited, or the inner iterator, the "
                "group or its settings differ from the run that wrote it"
            )
        self._unresumable = ValueError(
            f"BalancedBatches state {why}; skipping would lose documents or serve them twice. "
            "Load the state that state_dict() returned into a BalancedBatches built as the one "
            "that wrote it, over the same ranks"
        )
        raise self._unresumable

    def _reset(self) -> None:
        self._current: list[dict[str, Any]] = []
        self._k = 0
        self._done = False
        #: False: not fetched; None: inner ended; _Refused: raised when batch t is served
        self._ahead: _Batch | _Refused | bool | None = False

    def _stateful_inner(self) -> Stateful:
        """The inner iterator, or TypeError naming the protocol it lacks."""
        if not isinstance(self._inner, Stateful):
            raise TypeError(
                f"the inner iterator {type(self._inner).__name__} has no state_dict() / "
                "load_state_dict(state) (meshfeed.protocols.Stateful); build BalancedBatches "
                "over a stateful iterator (e.g. a meshfeed loader) to checkpoint it"
            )
        return self._inner

    def _inner_state(self) -> Any:
        return self._inner.state_dict() if isinstance(self._inner, Stateful) else None

    def _fetch(self, defer: bool = False) -> _Batch | _Refused | None:
        """Take the next sample and all-gather its lengths; None if any rank has run out.

        ``defer``: an error every rank raises alike (after the all-gather) is returned, to be
        raised once the batch before it is served (the plan-ahead fetch must not lose it)."""
        if not self._agreed_settings:
            self._agree_settings()
        state = self._inner_state()
        header = np.asarray([0, 0, 0, 0, self._digest], np.int64)
        refused: Exception | None = None
        try:
            sample = next(self._inner, None)
        except Exception as e:  # the other ranks learn of it from the all-gather: no wait
            sample, refused, header = None, e, self._raised_header(e)
        if sample is not None:
            try:
                sample = _on_cpu(sample)
                wide = _ids_past_int64(sample)  # refused below, on every rank
                if "cu_seqlens" in sample:  # else _header names what it lacks
                    if self._fields:
                        documents = doc_lengths(sample, self._keys).size
                        sample = normalize_fields(sample, self._fields, documents)
                    if wide is None:
                        sample = fit_sample(
                            sample, self._keys, self._limit, self._policy, self._fields
                        )
                header = self._header(sample, wide)
            except Exception as e:  # the other ranks learn of it from the all-gather: no wait
                refused, header = e, np.asarray([_REFUSED, 0, 0, 0, self._digest], np.int64)
        try:
            rows = self._comm.all_gather(header, self._header_size())
        except CollectiveError as e:
            if refused is None:
                raise
            # A dead peer must not hide this rank's own error.
            refused.add_note(f"the other ranks of the group could not be told: {e}")
            raise refused from None
        try:
            return self._agreed(state, sample, rows, refused)
        except Exception as e:  # raised on every rank alike: each defers it, none waits
            if not defer:
                raise
            return _Refused(e)

    def _agreed(
        self,
        state: Any,
        sample: Mapping[str, Any] | None,
        rows: list[np.ndarray],
        refused: Exception | None,
    ) -> _Batch | None:
        """The batch every rank agrees on from the all-gathered headers (or the error every
        rank raises alike)."""
        self._refuse_other_settings(rows)
        self._raise_together(rows, refused)
        _refuse_together(rows, self._comm.rank, refused)
        if not all(int(row[0]) for row in rows):
            return None
        signatures = [int(row[1]) for row in rows]
        if len(set(signatures)) > 1:
            raise ValueError(
                f"ranks disagree on the packed keys' dtypes (signatures {signatures}); "
                f"every rank must yield {list(self._keys)} with the same dtypes"
                + (
                    f", and {list(self._fields)} with the same dtypes and row shapes"
                    if self._fields
                    else ""
                )
            )
        counts = [int(row[2]) for row in rows]
        flags = [int(row[3]) for row in rows]
        if _WIDE_IDS in flags:
            _refuse_wide_ids(rows, counts, flags)  # the same error on every rank: no hang
        has_ids = all(flags)
        all_lengths = np.concatenate(
            [row[_HEADER : _HEADER + n] for row, n in zip(rows, counts, strict=True)]
        )
        all_ids = np.concatenate(
            [row[_HEADER + n : _HEADER + 2 * n] for row, n in zip(rows, counts, strict=True)]
        )
        ids = all_ids if has_ids else None
        f = len(self._fields)
        field_counts = np.concatenate(
            [
                row[_HEADER + 2 * n : _HEADER + (2 + f) * n].reshape(n, f)
                for row, n in zip(rows, counts, strict=True)
            ]
        )
        self._refuse_long(all_lengths, ids, counts)  # the same error on every rank: no hang
        assert sample is not None  # every rank, this one included, has data
        dtypes = [sample[k].dtype for k in self._keys]
        specs = field_specs(sample, self._fields)
        kwargs = dict(self._plan_kwargs, num_ranks=self._comm.size)
        if self._pool is not None:
            future = self._pool.submit(schedule_documents, all_lengths, **kwargs)
        else:
            future = Future()
            future.set_result(schedule_documents(all_lengths, **kwargs))
        return _Batch(state, sample, counts, ids, dtypes, future, field_counts, specs)

    def _header_size(self) -> int:
        """The most ints a header holds, alike on every rank once the settings agree."""
        return _HEADER + (2 + len(self._fields)) * self._cap

    def _agree_settings(self) -> None:
        """Once, before the first header: one all-gather of a fixed size (an int or a digest
        per setting), so that no rank joins a header of another size or plans differently."""
        values = {
            name: value if isinstance(value, int) else _digest(value)
            for name, value in self._settings.items()
        }
        columns = self._comm.agreement(values)
        differ = [name for name, column in columns.items() if len(set(column)) > 1]
        if differ:  # every rank sees the same columns: all of them raise here
            texts = [n for n in differ if not isinstance(self._settings[n], int)]
            shown = self._comm.all_gather_objects([self._settings[n] for n in texts])
            held = {n: f"[{', '.join(row[i] for row in shown)}]" for i, n in enumerate(texts)}
            name = differ[0]
            also = f" (and on {', '.join(differ[1:])})" if differ[1:] else ""
            raise ValueError(
                f"ranks built BalancedBatches with different {name}: rank i holds "
                f"{held.get(name, str(columns[name]))}{also}; build it with the same "
                f"{', '.join(self._settings)} on every rank of its group: they decide the plan "
                "every rank computes alike and the size of the collectives every rank joins"
            )
        self._agreed_settings = True

    def _refuse_other_settings(self, rows: list[np.ndarray]) -> None:
        """A header of a BalancedBatches built otherwise (the ranks agreed at their first
        batch, so the ranks iterate different instances at this batch): every rank raises."""
        digests = [int(row[4]) for row in rows]
        if len(set(digests)) > 1:
            raise ValueError(
                f"the ranks' headers at this batch come from BalancedBatches built differently "
                f"(settings digests, rank i: {digests}); every rank of the group must iterate "
                "its BalancedBatches built alike, the instances in the same order"
            )

    def _raised_header(self, error: Exception) -> np.ndarray:
        """The header of a rank whose inner iterator raised ``error``: its text follows."""
        size, body = error_words(error, min(8 * (self._header_size() - _HEADER), _ERROR_BYTES))
        return np.concatenate([[_RAISED, 0, size, 0, self._digest], body]).astype(np.int64)

    def _raise_together(self, rows: list[np.ndarray], raised: Exception | None) -> None:
        """Raise on every rank when a rank's inner iterator raised: that rank its own error,
        the others :class:`RankError` naming it and its error, all at this batch."""
        bad = [r for r, row in enumerate(rows) if int(row[0]) == _RAISED]
        if not bad:
            return
        me = self._comm.rank
        if me in bad and raised is not None:
            if self._comm.size > 1:
                raised.add_note(
                    f"every rank of the group stops at this batch (the inner iterators of ranks "
                    f"{bad} raised)"
                )
            raise raised
        r = bad[0]
        text = words_error(rows[r][_HEADER:], int(rows[r][2]))
        g = self._comm.global_rank(r)
        where = "" if g == r else f" (global rank {g})"
        raise RankError(
            f"the inner iterator of rank {r}{where} raised {text} (this is rank {me}); see "
            "that rank's error. Every rank of the group stops at this batch so that none waits "
            "for the others in its next collective",
            rank=g,
        )

    def _header(self, sample: Mapping[str, Any], wide: np.ndarray | None = None) -> np.ndarray:
        """has_data, dtype signature, documents, has_ids, settings digest, their lengths, their
        corpus ids.

        ``wide``: the sample's uint64 corpus ids when one is past int64 (they travel as bit
        patterns, flagged ``_WIDE_IDS``, and every rank refuses the batch)."""
        lengths = doc_lengths(sample, self._keys)
        dropped = [k for k in sample if k not in self._keys and k not in self._carried]
        if dropped:
            raise ValueError(
                f"the packed sample holds {sorted(map(str, dropped))}, which BalancedBatches "
                f"would drop: it moves documents between ranks with their per-token keys "
                f"(keys={list(self._keys)}), their document fields (document_fields="
                f"{list(self._fields)}), cu_seqlens and document_ids only. Add per-token "
                "fields to keys=, per-document fields (an image's pixel_values, with "
                "<name>_offsets: SampleFields concat_fields) to document_fields=, or leave "
                "out the fields you do not need (e.g. in the loader's collate_fn)"
            )
        if lengths.size > self._cap:
            raise ValueError(
                f"a packed sample holds {lengths.size} documents, more than "
                f"{self._cap=}; raise max_docs_per_rank"
            )
        ids = np.zeros(lengths.size, dtype=np.int64)
        has_ids = int(DOCUMENT_IDS in sample)
        if has_ids:
            given = (
                np.asarray(torch.as_tensor(sample[DOCUMENT_IDS]).cpu(), dtype=np.int64)
                if wide is None
                else wide
            )
            if given.shape != lengths.shape:
                raise ValueError(
                    f"sample[{DOCUMENT_IDS!r}] holds {given.size} ids for {lengths.size} "
                    "documents; give one corpus id per document of cu_seqlens"
                )
            ids = given if wide is None else wide.view(np.int64)
            has_ids = 1 if wide is None else _WIDE_IDS
        per_doc = field_rows(sample, self._fields, lengths.size).ravel()
        signature = fields_signature(sample, self._keys, self._fields)
        head = np.asarray([1, signature, lengths.size, has_ids, self._digest], np.int64)
        return np.concatenate([head, lengths, ids, per_doc])

    def _refuse_long(self, lengths: np.ndarray, ids: np.ndarray | None, counts: list[int]) -> None:
        over = np.flatnonzero(lengths > self._limit)
        if over.size == 0:
            return
        i = int(over[0])
        rank = int(np.searchsorted(np.cumsum(counts), i, side="right"))
        name = (
            f"corpus document {int(ids[i])}"
            if ids is not None
            else f"document {i - sum(counts[:rank])} of rank {rank}'s sample"
        )
        raise ValueError(
            f"{name} has {int(lengths[i])} tokens, more than this group of {self._comm.size} "
            f"ranks can hold ({self._limit} at max_tokens={self._plan_kwargs['max_tokens']}); "
            "pass long_documents='split' or 'truncate', raise max_tokens or add ranks"
        )

    def _advance(self) -> None:
        if isinstance(self._ahead, _Refused):  # batch t+1, refused once batch t was served
            error, self._ahead = self._ahead.error, False
            raise error
        batch = self._fetch() if self._ahead is False else self._ahead
        self._ahead = False
        if not isinstance(batch, _Batch):
            self._done = True
            return
        if self._pool is not None:
            self._ahead = self._fetch(defer=True)  # plan t+1 while batch t is rerouted
        try:
            p = batch.placement.result(timeout=self._timeout)
        except TimeoutError as e:
            raise TimeoutError(
                f"planning a batch took longer than timeout={self._timeout}s; "
                "raise timeout or reduce the documents per batch"
            ) from e
        self._check_resumed(p.num_microsteps)  # alike on every rank: the plan is the same
        rank = self._comm.rank
        layout = Layout.build(p, batch.counts)
        send = build_send(batch.sample, rank, layout, self._keys, self._pad)
        recv = self._comm.all_to_all(send, layout.send_splits(rank), layout.recv_splits(rank))
        steps = unpack(recv, rank, layout, batch.dtypes, self._keys)
        if self._fields:
            self._exchange_fields(batch, layout, steps)
        for step in steps:
            step["cp_group"] = tuple(self._comm.global_rank(r) for r in step["cp_group"])
            if batch.ids is not None:
                step[DOCUMENT_IDS] = torch.from_numpy(batch.ids[step["doc_ids"].numpy()])
        self._base_state, self._current = batch.state, steps
        self._k, self._skip, self._microsteps = self._skip, 0, 0

    def _exchange_fields(self, batch: _Batch, layout: Layout, steps: list[dict[str, Any]]) -> None:
        """The one more all-to-all: every piece's document fields to the rank holding it."""
        rank, rows, specs = self._comm.rank, batch.field_counts, batch.specs
        send = build_field_send(batch.sample, self._fields, layout, rank, rows, specs)
        send_bytes, recv_bytes = layout.byte_splits(rank, document_bytes(rows, specs))
        recv = self._comm.all_to_all(send, send_bytes, recv_bytes)
        unpack_fields(recv, layout, rank, steps, self._fields, specs, rows)


def _ids_past_int64(sample: Mapping[str, Any]) -> np.ndarray | None:
    """The sample's corpus ids, when they are uint64 (a numpy array or tensor) and one is past
    int64, which carries them (as an int64 cast would wrap it to a negative id); else None.
    Other dtypes cost one dtype comparison."""
    value = sample.get(DOCUMENT_IDS)
    if isinstance(value, torch.Tensor):
        if value.dtype != getattr(torch, "uint64", None):  # torch < 2.3 has no uint64
            return None
        value = value.cpu().numpy()
    if not isinstance(value, np.ndarray) or value.dtype != np.uint64:
        return None
    return value if value.size and int(value.max()) > _INT64_MAX else None


def _refuse_together(rows: list[np.ndarray], rank: int, refused: Exception | None) -> None:
    """Raise on every rank when a rank's packed sample failed its checks there (``refused``
    on that rank): that rank's own error, on the others one naming it. So every rank stops at
    the same batch, and a loop that catches the error and goes on stays in step."""
    bad = [r for r, row in enumerate(rows) if int(row[0]) == _REFUSED]
    if not bad:
        return
    if refused is not None:
        refused.add_note(f"every rank of the group stops at this batch (refused on ranks {bad})")
        raise refused
    raise ValueError(
        f"the packed sample of rank(s) {bad} failed its checks there (their error names the "
        f"problem); rank {rank} stops at the same batch so that no rank waits for the others"
    )


def _refuse_wide_ids(rows: list[np.ndarray], counts: list[int], flags: list[int]) -> None:
    """Raise, on every rank alike, naming the first corpus id past int64 (module doc)."""
    rank = flags.index(_WIDE_IDS)
    n = counts[rank]
    ids = rows[rank][_HEADER + n : _HEADER + 2 * n].view(np.uint64)
    i = int(np.flatnonzero(ids > _INT64_MAX)[0])
    value = int(ids[i])
    raise ValueError(
        f"document {i} of rank {rank}'s sample has corpus id {value} (uint64), past int64: "
        f"BalancedBatches carries document_ids as int64, where it would wrap to "
        f"{value - 2**64}; number the documents below 2**63, or reinterpret the ids as int64 "
        "yourself (ids.view(np.int64), and .view(np.uint64) on the micro-steps' document_ids)"
    )


def _settings(**given: Any) -> dict[str, int | str]:
    """Each setting as an int, or as the text of its value (compared through its digest)."""
    return {
        name: value if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        for name, value in given.items()
    }


def _plain_cost(cost: CostModel) -> CostModel:
    """``cost`` with float coefficients, whose text is the same on every rank that has it."""
    return CostModel(
        linear=float(cost.linear), quadratic=float(cost.quadratic), per_step=float(cost.per_step)
    )


def _digest(text: str) -> int:
    """A 64-bit digest of ``text`` as an int64, the same in every process (``hash`` is not)."""
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True
    )


class _LoaderEpoch:
    """One epoch of a stateful iterable (a DataLoader) as an iterator that can checkpoint.

    A DataLoader's ``iter()`` is a generator without state; the loader holds it. This
    iterator forwards ``state_dict`` / ``load_state_dict`` to the loader and starts a fresh
    ``iter()`` after a restore, so BalancedBatches checkpoints through any meshfeed loader.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _LoaderEpoch:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = iter(self.loader)
        return next(self._it)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._it = None  # the next item comes from the restored position


def _stateful_iterator(inner: Iterable[Any]) -> Iterator[Any]:
    if not hasattr(inner, "__next__") and isinstance(inner, Stateful):
        return _LoaderEpoch(inner)
    return iter(inner)


def _check_keys(keys: Any) -> tuple[str, ...]:
    """``keys`` as a tuple, or ValueError unless it is a non-empty sequence of key names."""
    if (
        isinstance(keys, str)
        or not isinstance(keys, Sequence)
        or not keys
        or not all(isinstance(k, str) for k in keys)
    ):
        raise ValueError(
            f"keys must be a non-empty sequence of the packed per-token key names (got "
            f"{keys=!r}); e.g. keys=meshfeed.keys.DEFAULT_KEYS = {list(DEFAULT_KEYS)}"
        )
    return tuple(keys)


def _check_pad(pad: Any) -> dict[str, int | None]:
    """``pad`` as a dict, or TypeError unless it maps key names to pad values."""
    if not isinstance(pad, Mapping):
        raise TypeError(
            f"pad must be a mapping of key -> pad value (None: continue the position ids) "
            f"(got {pad=!r}); e.g. pad=meshfeed.keys.DEFAULT_PAD = {dict(DEFAULT_PAD)}"
        )
    return dict(pad)


def _refuse_partial_state(inner: Any) -> None:
    """An iterator with part of a state protocol would checkpoint wrongly: refuse it by name."""
    has = [n for n in ("state_dict", "load_state_dict") if hasattr(inner, n)]
    if has:
        raise TypeError(
            f"the inner iterator {type(inner).__name__} has {has[0]}() but is not "
            "meshfeed.protocols.Stateful; give it both state_dict() and load_state_dict(state) "
            "(the one state protocol), or pass an iterator without state and do not checkpoint"
        )


def error_words(error: Exception, limit: int = _ERROR_BYTES) -> tuple[int, np.ndarray]:
    """``"Type: text"`` of ``error`` in UTF-8, at most ``limit`` bytes, for a header of ints:
    its byte count and the bytes as int64 words (zero-padded)."""
    text = f"{type(error).__name__}: {error_text(error)}".encode()[:limit]
    return len(text), np.frombuffer(text + b"\0" * (-len(text) % 8), dtype=np.int64)


def words_error(words: np.ndarray, size: int) -> str:
    """The text :func:`error_words` packed: ``size`` bytes of ``words``."""
    return words.tobytes()[:size].decode(errors="replace")
