"""HybridCPDataLoader: a drop-in for Megatron-LM's ``HybridCPDataLoaderWrapper``.

Megatron's training loop with ``hybrid_context_parallel=True`` wraps its data iterator::

    data_iterator = HybridCPDataLoaderWrapper(data_iterator, config, pg_collection)

and ``hybrid_context_parallel_forward_backward`` calls ``next()`` once per global batch. Swap
that one line for ``HybridCPDataLoader(data_iterator, config, pg_collection)``: the input is
the same (each rank's iterator yields a list of packed samples, dicts of 1-D tensors with
``cu_seqlens``; CP peers of one DP replica hold the same samples) and so is the output of every
``next()``: ``(samples, sample_id_groups)`` where ``samples`` maps a global sub-sample id to this
rank's copy of that document (every key but ``cu_seqlens``, ``batch_idx``, ``max_seqlen``) and
``sample_id_groups[g][r]`` lists the ids rank ``r`` of the DP x CP group runs in group ``g``
(a document on several ranks is run by all of them with that CP size).

What changes is the schedule: :func:`schedule_documents` (cost model, CP degrees on aligned
power-of-two blocks as Megatron's hybrid CP groups need, LPT, equal group counts) instead of
``BalancedCPScheduler``, and the collectives go through :mod:`meshfeed.dist` (the device rule
and bounded waits). The ids are numbered as Megatron numbers them (DP rank order, then position
in the batch, empty documents dropped), so ``samples`` keys and groups mean the same thing.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from meshfeed import dist
from meshfeed.balance._group import exchange_group, own_group
from meshfeed.balance.balanced import (
    _RAISED,
    _REFUSED,
    _refuse_together,
    error_words,
    words_error,
)
from meshfeed.balance.cost import CostModel
from meshfeed.balance.routing import _as_bytes, _unfuse
from meshfeed.balance.schedule import Placement, schedule_documents
from meshfeed.errors import CollectiveError, RankError

__all__ = ["MEGATRON_COST", "HybridCPDataLoader"]

#: Megatron's workload estimate (``seq_len**2 / cp_size``), so balance is judged as Megatron does.
MEGATRON_COST = CostModel(quadratic=1.0)

_SKIPPED = ("cu_seqlens", "batch_idx", "max_seqlen")  # the keys Megatron's unpack_batch drops
#: ok flag (1; ``_REFUSED`` when this rank's batch failed its checks; ``_RAISED`` when its data
#: iterator raised, the second slot then the byte count of the error's text, which follows;
#: ``_ENDED`` when its data iterator ended), layout signature; then the document lengths
_HEADER = 2
#: ok flag of a rank whose data iterator ended (StopIteration): all ranks ended, or the others
#: raise :class:`~meshfeed.errors.RankError` naming it
_ENDED = -3


class HybridCPDataLoader:
    """Iterator of ``(samples, sample_id_groups)`` per global batch (see the module doc).

    ``config`` needs ``max_seqlen_per_dp_cp_rank`` (or pass ``max_seqlen_per_dp_cp_rank=``).
    ``pg_collection`` is Megatron's ``ProcessGroupCollection`` (``.dp_cp``, ``.dp``); ``None``
    takes Megatron's ``parallel_state`` groups when it is initialised, else the default group as
    both (every rank its own DP replica, no CP replication). ``cost`` defaults to Megatron's
    ``s**2`` estimate; pass a :class:`CostModel` with a linear term to balance real step time.
    ``groups="one"`` (default) returns the whole placement as one group in micro-step order
    (no barrier between micro-steps, deadlock-free because every rank runs shared documents in
    the same order); ``groups="microsteps"`` returns one group per micro-step.

    Every batch is checked before anything moves: per-token values must be 1-D tensors of one
    length, ``cu_seqlens`` must rise from 0 to at most that length, the packed samples of a batch and
    the DP replicas must share keys and dtypes (in any order). A refused batch raises on every
    rank of the DP group at the same ``next()`` (the rank with the bad sample its own error),
    so no rank waits for the others and a loop that catches the error stays in step. So does a
    data iterator that raises on some ranks (they raise its error, the others a
    :class:`~meshfeed.errors.RankError` naming them) or ends on some ranks only (every rank a
    ``RankError`` naming them); one that ends on every rank at the same ``next()`` ends this
    iterator on every rank (``StopIteration``).

    The header all-gathers run on a gloo group of meshfeed's own over the DP group's ranks whose
    timeout is ``timeout`` (made at the first ``next()``), so one given up on is not left
    pending on the caller's group (which would keep the process from exiting until that
    group's timeout); the documents' ``all_to_all`` runs on ``pg_collection.dp_cp`` (on
    meshfeed's gloo group over its ranks where this runs off the thread that built it, e.g. in
    :class:`~meshfeed.delivered.Delivered`).
    """

    def __init__(
        self,
        data_iterator: Any,
        config: Any = None,
        pg_collection: Any = None,
        *,
        max_seqlen_per_dp_cp_rank: int | None = None,
        cost: CostModel = MEGATRON_COST,
        groups: str = "one",
        timeout: float = dist.DEFAULT_TIMEOUT,
    ) -> None:
        budget = max_seqlen_per_dp_cp_rank
        if budget is None:
            budget = getattr(config, "max_seqlen_per_dp_cp_rank", None)
        if budget is None:
            raise ValueError(
                "HybridCPDataLoader needs the per-rank token budget; pass a Megatron config "
                "with max_seqlen_per_dp_cp_rank set or max_seqlen_per_dp_cp_rank=..."
            )
        if groups not in ("one", "microsteps"):
            raise ValueError(f"groups must be 'one' or 'microsteps' (got {groups=!r})")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(
                f"timeout must be positive seconds as a number (got {timeout=!r}); e.g. timeout=300"
            )
        if math.isnan(timeout) or timeout <= 0:
            raise ValueError(
                f"timeout must be positive seconds (got {timeout=!r}); e.g. timeout=300"
            )
        self.data_iterator = data_iterator
        self.config = config
        self.dp_cp_group, self.dp_group = _groups(pg_collection)
        self._groups = groups
        self._timeout = float(timeout)
        self.total_hdp_gpus = dist.world_size(self.dp_cp_group)
        self._plan_kwargs: dict[str, Any] = {
            "num_ranks": self.total_hdp_gpus,
            "max_tokens": budget,
            "cost": cost,
            "cp_sizes": "pow2_aligned",
        }
        # Fail at construction on a bad budget or group size, not at the first batch.
        schedule_documents([], **self._plan_kwargs)
        # Position in the DP x CP group of every member of this rank's DP group.
        hdp = {g: i for i, g in enumerate(dist.group_ranks(self.dp_cp_group))}
        self._dp_members = [hdp[g] for g in dist.group_ranks(self.dp_group)]
        self.last_placement: Placement | None = None
        #: meshfeed's own gloo group over the DP group's ranks, made at the first next()
        self._control: Any = None
        self._control_made = False
        self._thread = threading.get_ident()  # the thread that built it (see _data_group)

    def __iter__(self) -> HybridCPDataLoader:
        return self

    def __next__(self) -> tuple[dict[int, dict[str, torch.Tensor]], list[list[list[int]]]]:
        if self.data_iterator is None:  # Megatron: TP ranks > 0 receive data by broadcast
            return None, None  # type: ignore[return-value]
        refused: Exception | None = None
        raised: Exception | None = None
        docs: list[dict[str, torch.Tensor]] = []
        layout: dict[str, torch.dtype] = {}
        try:
            batch = next(self.data_iterator)
        except StopIteration:  # the other ranks learn of it from the all-gather: no wait
            if not dist.is_distributed(self.dp_group):
                raise
            header = np.asarray([_ENDED, 0], dtype=np.int64)
        except Exception as e:  # the other ranks learn of it from the all-gather: no wait
            if not dist.is_distributed(self.dp_group):
                raise
            raised, header = e, _raised_header(e)
        else:
            try:
                docs, layout = _unpack_batch(batch)
                lengths = np.asarray([_length(d) for d in docs], dtype=np.int64)
                header = np.concatenate([[1, _signature(layout)], lengths])
            except Exception as e:  # the other ranks learn of it from the all-gather: no wait
                refused, docs, layout = e, [], {}
                header = np.asarray([_REFUSED, 0], dtype=np.int64)
        try:
            rows = dist.all_gather_ints(header, timeout=self._timeout, group=self._own())
        except CollectiveError as e:
            mine = raised if raised is not None else refused
            if mine is None:
                raise
            # A dead peer must not hide this rank's own error.
            mine.add_note(f"the other ranks of the DP group could not be told: {e}")
            raise mine from None
        if refused is None:  # else this rank raises its own error, just below
            self._raise_together(rows, raised)
        _refuse_together(rows, dist.rank(self.dp_group), refused)
        if len({int(row[1]) for row in rows}) > 1:
            self._refuse_layouts(layout)  # every rank sees the mismatch: all raise here
        per_dp = [row[_HEADER:] for row in rows]
        counts = [int(p.size) for p in per_dp]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        all_lengths = np.concatenate(per_dp)
        placement = schedule_documents(all_lengths, **self._plan_kwargs)
        self.last_placement = placement
        groups = _sample_id_groups(placement, self._groups)
        idle = [r for r in range(self.total_hdp_gpus) if not groups or not groups[-1][r]]
        if idle:
            # Megatron's loop runs the last sub-sample of the last group on every rank; every
            # rank computed this same placement, so all of them raise here together.
            raise ValueError(
                f"ranks {idle[:8]} get no document in the last group of this global batch "
                f"({all_lengths.size} documents over {self.total_hdp_gpus} ranks), which "
                "Megatron's hybrid-CP loop cannot run; use more documents per global batch "
                "(or groups='one', which leaves a rank idle only when it gets no document at all)"
            )
        samples = self._reroute(docs, layout, all_lengths, offsets, placement)
        return samples, groups

    def _own(self) -> Any:
        """meshfeed's own gloo group over the DP group's ranks (made at the first call; on a
        delivery thread, that walk's, :func:`meshfeed.dist.thread_group`, not kept here)."""
        if dist.on_delivery_thread():
            return own_group(self.dp_group, self._timeout, "HybridCPDataLoader")
        if not self._control_made:
            self._control = own_group(self.dp_group, self._timeout, "HybridCPDataLoader")
            self._control_made = True
        return self._control

    def _data_group(self) -> Any:
        """The group of the documents' ``all_to_all``: ``pg_collection.dp_cp`` on the thread
        that built this, else meshfeed's gloo group over its ranks (:func:`exchange_group`)."""
        return exchange_group(self.dp_cp_group, self._timeout, self._thread, "HybridCPDataLoader")

    def _raise_together(self, rows: list[np.ndarray], raised: Exception | None) -> None:
        """Raise on every rank of the DP group when a rank's data iterator raised or ended
        (unless every rank's ended: then ``StopIteration`` on every rank), all at this
        ``next()``: a rank whose iterator raised its own error, the others
        :class:`RankError` naming it."""
        flags = [int(row[0]) for row in rows]
        me = dist.rank(self.dp_group)
        bad = [r for r, flag in enumerate(flags) if flag == _RAISED]
        if bad:
            if raised is not None:
                raised.add_note(
                    f"every rank of the DP group stops at this batch (the data iterators of "
                    f"DP ranks {bad} raised)"
                )
                raise raised
            r = bad[0]
            text = words_error(rows[r][_HEADER:], int(rows[r][1]))
            raise RankError(
                f"the data iterator of DP rank {r}{self._global(r)} raised {text} (this is DP "
                f"rank {me}); see that rank's error. Every rank of the DP group stops at this "
                "batch so that none waits for the others in its next collective",
                rank=dist.global_rank(self.dp_group, r),
            )
        ended = [r for r, flag in enumerate(flags) if flag == _ENDED]
        if not ended:
            return
        if len(ended) == len(flags):
            raise StopIteration
        r = ended[0]
        others = [r for r, flag in enumerate(flags) if flag != _ENDED]
        raise RankError(
            f"rank {dist.global_rank(self.dp_group, r)}'s data iterator ended (DP ranks "
            f"{ended} ended, DP ranks {others} yielded a batch; this is DP rank {me}); every "
            "rank of the DP group must yield the same number of global batches. Every rank "
            "of the DP group stops at this batch so that none waits for the others",
            rank=dist.global_rank(self.dp_group, r),
        )

    def _global(self, r: int) -> str:
        g = dist.global_rank(self.dp_group, r)
        return "" if g == r else f" (global rank {g})"

    def _refuse_layouts(self, layout: Mapping[str, torch.dtype]) -> None:
        """Raise, on every rank of the DP group alike, naming each rank's keys and dtypes.

        Only when the signatures in the all-gather differ (every rank sees that), so this
        extra all-gather is made by all of them or by none."""
        layouts = dist.all_gather_objects(
            _layout_text(layout), timeout=self._timeout, group=self._own()
        )
        ranks = dist.group_ranks(self.dp_group)
        named = "; ".join(
            f"DP rank {i} (rank {g}): {text or 'no per-token keys'}"
            for i, (g, text) in enumerate(zip(ranks, layouts, strict=True))
        )
        raise ValueError(
            "the data-parallel replicas yield packed samples with different keys or dtypes "
            f"({named}); every DP replica must yield the same per-token keys with the same "
            "dtypes (their order does not matter), as documents move between them"
        )

    def _reroute(
        self,
        docs: list[dict[str, torch.Tensor]],
        layout: Mapping[str, torch.dtype],
        lengths: np.ndarray,
        offsets: np.ndarray,
        placement: Placement,
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Send every document to each rank that runs it, within this rank's DP group."""
        world, me = self.total_hdp_gpus, dist.rank(self.dp_cp_group)
        dp_rank = dist.rank(self.dp_group)
        lo, hi = int(offsets[dp_rank]), int(offsets[dp_rank + 1])
        needs = _needs(placement, world)
        # The layout comes from the packed samples, not a document: a rank whose documents are
        # all empty still knows the row layout it receives. Rows are fused in sorted key order,
        # the same on every rank (the all-gathered signature checked that the layouts agree).
        keys = _canonical(layout)
        dtypes = [layout[k] for k in keys]
        # CP peers hold the same data: send within the DP group.
        send, send_rows = _send_buffer(docs, keys, dtypes, needs, lengths, lo, hi, self._dp_members)
        src_of = np.searchsorted(offsets, np.arange(lengths.size), side="right") - 1
        recv_rows, incoming = _receive_plan(needs[me], lengths, src_of, self._dp_members, world)
        recv = dist.all_to_all_single(
            send, send_rows, recv_rows, timeout=self._timeout, group=self._data_group()
        )
        received = _split_received(recv, incoming, lengths, keys, dtypes)
        # In this rank's own key order, as Megatron's wrapper returns them.
        return {g: {k: doc[k] for k in layout} for g, doc in received.items()}


def _raised_header(error: Exception) -> np.ndarray:
    """The header of a rank whose data iterator raised ``error``: its text follows."""
    size, body = error_words(error)
    return np.concatenate([[_RAISED, size], body]).astype(np.int64)


def _needs(placement: Placement, world: int) -> list[list[int]]:
    """The sorted document ids each rank runs in any micro-step."""
    return [sorted({d for step in placement.microsteps[r] for d, _ in step}) for r in range(world)]


def _send_buffer(
    docs: list[dict[str, torch.Tensor]],
    keys: list[str],
    dtypes: list[torch.dtype],
    needs: list[list[int]],
    lengths: np.ndarray,
    lo: int,
    hi: int,
    members: list[int],
) -> tuple[torch.Tensor, list[int]]:
    """The fused rows this rank sends (its documents ``[lo, hi)`` that each member needs, by
    member then id) and the row count for each destination rank (0 outside ``members``)."""
    send_rows = [0] * len(needs)
    pieces: list[torch.Tensor] = []
    for dest in members:
        mine = [g for g in needs[dest] if lo <= g < hi]
        send_rows[dest] = int(lengths[mine].sum()) if mine else 0
        pieces.extend(_fused(docs[g - lo], keys) for g in mine)
    if pieces:
        return torch.cat(pieces), send_rows
    return torch.zeros((0, sum(dt.itemsize for dt in dtypes)), dtype=torch.uint8), send_rows


def _receive_plan(
    wanted: list[int], lengths: np.ndarray, src_of: np.ndarray, members: list[int], world: int
) -> tuple[list[int], list[int]]:
    """The row count this rank receives from each rank, and the document ids in wire order
    (by source rank, then id); ``src_of[g]`` is the index in ``members`` of the document's
    sender."""
    got = {member: [g for g in wanted if src_of[g] == j] for j, member in enumerate(members)}
    recv_rows = [0] * world
    for member, ids in got.items():
        recv_rows[member] = int(lengths[ids].sum()) if ids else 0
    return recv_rows, [g for member in sorted(got) for g in got[member]]


def _split_received(
    recv: torch.Tensor,
    incoming: list[int],
    lengths: np.ndarray,
    keys: list[str],
    dtypes: list[torch.dtype],
) -> dict[int, dict[str, torch.Tensor]]:
    """Cut the received fused rows back into one document (key -> tensor) per incoming id."""
    parts = recv.split([int(lengths[g]) for g in incoming])
    return {g: _unfuse(part, keys, dtypes) for g, part in zip(incoming, parts, strict=True)}


def _groups(pg_collection: Any) -> tuple[Any, Any]:
    if pg_collection is not None:
        return pg_collection.dp_cp, pg_collection.dp
    # A Megatron job has imported parallel_state to initialise it; importing Megatron here
    # only to learn that nothing is initialised would load a whole framework (and its
    # threads) into every process that uses the default group.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        return (
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            parallel_state.get_data_parallel_group(),
        )
    return None, None


def _unpack_batch(
    batch: Any,
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.dtype]]:
    """Megatron's ``unpack_batch``: the non-empty documents of a list of packed samples.

    Also returns the per-token keys (in the packed samples' order) and their dtypes, which
    every packed sample of the batch must share. Refuses what Megatron would slice into wrong
    documents: a value that is not a 1-D tensor, keys of different lengths, a ``cu_seqlens``
    that does not rise from 0 to at most the sample length (documents overlapping or running
    past it; tokens after its last boundary are padding, dropped as Megatron drops them).
    """
    if isinstance(batch, Mapping):
        batch = [batch]
    if not batch:
        raise ValueError(
            "the data iterator yielded an empty list; every rank needs at least one packed "
            "sample per global batch (Megatron's wrapper needs it too)"
        )
    docs = []
    layout: dict[str, torch.dtype] = {}
    for i, sample in enumerate(batch):
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"packed sample {i} of the batch is a {type(sample).__name__}; the data "
                "iterator must yield a list of packed samples, dicts of 1-D tensors plus "
                "cu_seqlens"
            )
        if "cu_seqlens" not in sample:
            raise ValueError(
                f"a packed sample needs 'cu_seqlens' (has {sorted(map(str, sample))}); yield "
                "Megatron's packed samples: 1-D tensors plus cu_seqlens"
            )
        mine = _sample_layout(sample, i)
        if i == 0:
            layout = mine
        elif mine != layout:
            raise ValueError(
                f"the packed samples of one batch differ in keys or dtypes (sample 0: "
                f"{_layout_text(layout)}; sample {i}: {_layout_text(mine)}); every packed "
                "sample must hold the same per-token keys with the same dtypes (cast them "
                "alike, e.g. in the dataset or its collate_fn)"
            )
        total = int(sample[next(iter(mine))].numel())
        cu = np.asarray(torch.as_tensor(sample["cu_seqlens"]).cpu(), dtype=np.int64).ravel()
        if cu.size == 0 or cu[0] != 0 or cu[-1] > total or np.any(np.diff(cu) < 0):
            raise ValueError(
                f"cu_seqlens must rise from 0 to at most the sample length {total} (got "
                f"{cu.tolist()[:8]}{'...' if cu.size > 8 else ''} in packed sample {i}); its "
                "documents would overlap or run past the sample: give the document "
                "boundaries of the sample (tokens past the last one are dropped, as "
                "Megatron's unpack_batch drops padding)"
            )
        for a, b in itertools.pairwise(cu.tolist()):
            if b > a:
                docs.append({k: v[a:b] for k, v in sample.items() if k not in _SKIPPED})
    return docs, layout


def _sample_layout(sample: Mapping[str, Any], index: int) -> dict[str, torch.dtype]:
    """The per-token keys of packed sample ``index`` and their dtypes, checked: 1-D tensors,
    all of one length."""
    layout: dict[str, torch.dtype] = {}
    sizes: dict[str, int] = {}
    for key, value in sample.items():
        if key in _SKIPPED:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"sample[{key!r}] of packed sample {index} is a {type(value).__name__}; every "
                f"key but {list(_SKIPPED)} must be a 1-D tensor (convert it with "
                "torch.as_tensor, e.g. in the dataset or its collate_fn)"
            )
        if value.ndim != 1:
            raise ValueError(
                f"sample[{key!r}] of packed sample {index} has shape {tuple(value.shape)}; "
                "every per-token key must be a 1-D tensor, one value per token (flatten it, "
                "or drop a leading batch dimension of 1)"
            )
        layout[key] = value.dtype
        sizes[key] = int(value.numel())
    if not layout:
        raise ValueError(
            f"packed sample {index} holds no per-token key besides {list(_SKIPPED)}; yield "
            "Megatron's packed samples: tokens, labels, ... plus cu_seqlens"
        )
    if len(set(sizes.values())) != 1:
        raise ValueError(
            f"the per-token keys of packed sample {index} differ in length ({sizes}); every "
            "key of a packed sample must hold one value per token"
        )
    return layout


def _canonical(layout: Mapping[str, torch.dtype]) -> list[str]:
    """The keys in the order every rank fuses them (sorted), whatever each sample's order."""
    return sorted(layout, key=str)


def _layout_text(layout: Mapping[str, torch.dtype]) -> str:
    return ", ".join(f"{k}:{layout[k]}" for k in _canonical(layout))


def _signature(layout: Mapping[str, torch.dtype]) -> int:
    """A 31-bit hash of the keys and dtypes, to check that every rank sends the same layout."""
    return zlib.crc32(_layout_text(layout).encode()) & 0x7FFFFFFF


def _length(doc: Mapping[str, torch.Tensor]) -> int:
    return int(next(iter(doc.values())).numel())


def _fused(doc: Mapping[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([_as_bytes(doc[k]) for k in keys], dim=1)


def _sample_id_groups(placement: Placement, mode: str) -> list[list[list[int]]]:
    """Megatron's ``sample_id_groups[g][r]`` from the placement's micro-steps."""
    n = placement.num_ranks
    steps = [
        [[int(d) for d, _ in placement.microsteps[r][k]] for r in range(n)]
        for k in range(placement.num_microsteps)
    ]
    if mode == "microsteps":
        return steps
    return [[[d for step in steps for d in step[r]] for r in range(n)]]
