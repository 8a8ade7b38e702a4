"""Which order a loader walks, and how shuffle, mixture and curriculum orders compose.

The loader calls :func:`build_order` once; nothing else decides the order. The combinations:

- no curriculum, a plain dataset: a :class:`~meshfeed.order.plan.ShuffledOrder`;
- no curriculum, a dataset with its own order (an
  :class:`~meshfeed.protocols.OrderedSource`, e.g. a
  :class:`~meshfeed.sources.Mixture`): that order;
- a curriculum over a plain dataset: the curriculum's difficulty-gated order;
- a curriculum over a ``Mixture``: a :class:`CurriculumMixtureOrder`. The mixture picks the
  source of every position arithmetically, exactly as without a curriculum (so its weights hold
  within +-1 sample per source in every prefix of global batches), and each source then draws
  from its own gated sub-order: the ``k``-th draw of source ``s`` is position ``k`` of a
  :class:`~meshfeed.curriculum.GatedOrder` over the source's eligible samples, whose pool grows
  at the draws where the mixture's global batches start. ``curriculum`` is either one
  :class:`~meshfeed.curriculum.Curriculum` whose metric indexes cover the whole mixture (one
  value per concatenated index; each source is gated by the values of its own samples), or a
  dict ``{source name: Curriculum}`` with per-source indexes and schedules (sources left out are
  not gated). Every source must have an eligible sample at the first step.
- a :class:`~meshfeed.sources.LazyDataset` over any of these datasets is planned as the
  dataset under it (its per-item operations run at fetch time on the same indices), so a
  lazy map over a mixture keeps the mixture's weights, schedule and state (#28).
- anything else with a curriculum (another self-ordering dataset, a dict of curricula over a
  plain dataset, per-source transforms) raises ``ValueError`` naming the combination: an order
  is never dropped silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshfeed.curriculum.curriculum import Curriculum
from meshfeed.curriculum.order import check_gate
from meshfeed.order.batches import Order, ShuffledOrder
from meshfeed.order.permutation import derive_seed
from meshfeed.protocols import CurriculumHooks, OrderBase, OrderedSource, PostProcess
from meshfeed.sources.lazy import LazyDataset
from meshfeed.sources.mixture import Mixture
from meshfeed.state import envelope, open_envelope

__all__ = ["CurriculumMixtureOrder", "build_order", "curriculum_postprocess"]

_GATE_OP = 0x6A7E
#: Version of the facts a CurriculumMixtureOrder records in a loader checkpoint.
ORDER_VERSION = 1


def build_order(
    dataset: Any,
    *,
    curriculum: Any,
    dataset_length: int,
    global_batch_size: int,
    seed: int,
    shuffle: bool,
    rampup: Any = None,
) -> Order:
    """The order of ``dataset`` under ``curriculum`` (None: no curriculum); see module doc.

    ``shuffle`` is passed to a dataset's own order (a stream walks its shards in order without
    it; a Mixture refuses it); a curriculum defines its own order, so ``shuffle=False`` with
    one raises. A batch-size ``rampup`` is refused with an order that counts steps of a fixed
    global batch (a curriculum, a Mixture).
    """
    given = dataset  # what a metric index was built for: the dataset itself, or its source
    # A LazyDataset serves its source's indices, so it is planned as its source.
    dataset = dataset.source if isinstance(dataset, LazyDataset) else dataset
    if rampup is not None and (curriculum is not None or isinstance(dataset, Mixture)):
        what = "curriculum" if curriculum is not None else "Mixture dataset"
        raise ValueError(
            f"rampup={rampup!r} with a {what}: its schedule counts steps of a fixed global "
            "batch (pacing, weights per global batch), so a growing batch would move it; "
            "drop rampup, or the curriculum / mixture, for this run"
        )
    ordered = isinstance(dataset, OrderedSource)
    if not shuffle and curriculum is not None:
        raise ValueError(
            f"shuffle=False with curriculum={type(curriculum).__name__} would be ignored: that "
            "order is defined by the curriculum, not by a shuffle; drop shuffle=False (for an "
            "unshuffled walk use a plain dataset without curriculum)"
        )
    if curriculum is None:
        if not ordered:
            return ShuffledOrder(dataset_length, seed=seed, shuffle=shuffle)
        kwargs: dict[str, Any] = {}
        if not shuffle:  # asked only when not shuffling: make_order(shuffle=) is optional
            params = inspect.signature(dataset.make_order).parameters.values()
            if not any(p.name == "shuffle" or p.kind is p.VAR_KEYWORD for p in params):
                raise ValueError(
                    f"shuffle=False with dataset={type(dataset).__name__} (it has its own order, "
                    "make_order, which takes no shuffle=) would be ignored: drop shuffle=False"
                )
            kwargs["shuffle"] = False
        return _checked(
            dataset.make_order(
                dataset_length=dataset_length,
                global_batch_size=global_batch_size,
                seed=seed,
                **kwargs,
            )
        )
    if isinstance(dataset, Mixture):
        return CurriculumMixtureOrder(
            dataset, curriculum, global_batch_size=global_batch_size, seed=seed
        )
    if isinstance(curriculum, Mapping):
        raise ValueError(
            f"a dict of curricula per source (keys {sorted(map(str, curriculum))}) needs a "
            f"meshfeed Mixture as the dataset (got {type(dataset).__name__}); pass one "
            "Curriculum for a single dataset"
        )
    if ordered:
        raise ValueError(
            f"curriculum over {type(dataset).__name__}, a dataset with its own order "
            "(make_order), is not supported: the curriculum would replace that order; use a "
            "meshfeed Mixture (curriculum over a mixture gates each source) or drop one of them"
        )
    if not isinstance(curriculum, CurriculumHooks):
        raise ValueError(
            f"curriculum={curriculum!r} lacks make_order() or postprocess (see "
            "meshfeed.protocols.CurriculumHooks); build one with "
            "meshfeed.curriculum.Curriculum(...) or from_deepspeed_config(...)"
        )
    if isinstance(curriculum, Curriculum):
        curriculum.check_dataset(given)
    return _checked(
        curriculum.make_order(
            dataset_length=dataset_length, global_batch_size=global_batch_size, seed=seed
        )
    )


def curriculum_postprocess(curriculum: Any) -> PostProcess | None:
    """The batch hook of ``curriculum`` (None for none), once :func:`build_order` accepted it.

    A dict of curricula per source has none: :class:`CurriculumMixtureOrder` refuses
    per-source transforms, since a batch mixes sources.
    """
    if curriculum is None or isinstance(curriculum, Mapping):
        return None
    return curriculum.postprocess


def _checked(order: Any) -> Order:
    if not isinstance(order, Order):
        raise TypeError(f"make_order() returned {type(order).__name__}, which is not an Order")
    return order


def _per_source_curricula(curriculum: Any, names: list[str]) -> dict[str, Any]:
    """The dict source name -> Curriculum, or ``{}`` for one Curriculum over the whole
    mixture; refused unless every key is a source and every value a transform-free Curriculum."""
    if isinstance(curriculum, Mapping):
        unknown = sorted(set(map(str, curriculum)) - set(names))
        if unknown:
            raise ValueError(
                f"curricula for {unknown}, which are not sources of the mixture {names}; "
                "key the dict by source name"
            )
        per_source = {str(k): v for k, v in curriculum.items()}
    elif isinstance(curriculum, Curriculum):
        per_source = {}
    else:
        raise ValueError(
            f"curriculum={curriculum!r} is neither a Curriculum nor a dict source name -> "
            "Curriculum; build one with meshfeed.curriculum.Curriculum(...)"
        )
    for name, cur in per_source.items():
        if not isinstance(cur, Curriculum):
            raise ValueError(f"curriculum for source {name!r} is not a Curriculum ({cur!r})")
        if cur.transforms:
            raise ValueError(
                f"curriculum for source {name!r} has transforms {cur!r}: a batch mixes "
                "sources, so per-source transforms are not supported; put them in one "
                "Curriculum over the whole mixture"
            )
    return per_source


def _check_eligible_at_start(name: str, cur: Any, src_pool: Any, src_entry: Any) -> None:
    """The mixture draws from every source from the start: some sample of source ``name``
    must be eligible at the curriculum's first step."""
    if len(src_pool) == 0 or int(src_entry[0]) > cur.first_step:
        raise ValueError(
            f"no sample of source {name!r} is eligible at step {cur.first_step} "
            f"(difficulties {cur.difficulties(cur.first_step)}), but the mixture draws "
            "from it from the start (at weight 0 too: its gate plans from the first step); "
            "lower the min_difficulty so that the first step admits some of its samples (per "
            "source with curriculum={name: Curriculum(...)})"
        )


class CurriculumMixtureOrder(OrderBase):
    """A mixture whose sources are each walked by a difficulty-gated sub-order (module doc)."""

    def __init__(self, mixture: Any, curriculum: Any, *, global_batch_size: int, seed: int) -> None:
        self.mixture = mixture
        self.mixture_order = mixture.make_order(
            dataset_length=len(mixture), global_batch_size=global_batch_size, seed=seed
        )
        self.G = int(global_batch_size)
        spe = self.mixture_order.samples_per_epoch
        names = mixture.names
        per_source = _per_source_curricula(curriculum, names)
        self.curricula: dict[str, Any] = {}
        self.gates: list[Any] = []
        whole = None if per_source else curriculum
        whole_pool = None
        if whole is not None:
            whole.bind(global_batch_size=self.G, samples_per_epoch=spe)
            whole.check_dataset(mixture)
            whole_pool = whole.pool(len(mixture))
        for s, name in enumerate(names):
            cur = whole if whole is not None else per_source.get(name)
            if cur is None:
                self.gates.append(None)
                continue
            src_pool, src_entry = self._source_pool(s, cur, whole_pool, samples_per_epoch=spe)
            _check_eligible_at_start(name, cur, src_pool, src_entry)
            self.curricula[name] = cur
            self.gates.append(
                cur.gate(
                    src_pool,
                    src_entry,
                    global_batch_size=self.G,
                    seed=derive_seed(seed, _GATE_OP, s),
                    samples_per_epoch=spe,
                    batch_start=self._starts(s),
                )
            )
        self.mixture_order.on_schedule_change(self._schedule_changed)

    def _schedule_changed(self) -> None:
        """The mixture's weights changed (``reweight``, or a schedule adopted from a
        checkpoint): the draws where each source's pool grows moved, so every gate plans its
        rounds again, and the loader re-plans what it has not returned (a draw it planned
        with the old rounds may now be another sample)."""
        for gate in self.gates:
            if gate is not None:
                gate.rebuild()
        self.mixture_order.replan_from(self.mixture_order.returned_until)

    def _source_pool(
        self, s: int, cur: Any, whole_pool: tuple[Any, Any] | None, *, samples_per_epoch: int
    ) -> tuple[Any, Any]:
        """Source ``s``'s eligible samples (local indices) and the step each enters: its part
        of the whole mixture's pool, or the pool of its own curriculum ``cur``."""
        lo, n = int(self.mixture.offsets[s]), int(self.mixture.lengths[s])
        if whole_pool is not None:
            pool, entry = whole_pool
            mask = (pool >= lo) & (pool < lo + n)
            return pool[mask] - lo, entry[mask]
        cur.bind(global_batch_size=self.G, samples_per_epoch=samples_per_epoch)
        try:
            cur.check_dataset(self.mixture.sources[s])
            return cur.pool(n)
        except ValueError as exc:
            raise ValueError(f"curriculum of source {self.mixture.names[s]!r}: {exc}") from exc

    def _starts(self, s: int) -> Any:
        mixture, G, name = self.mixture, self.G, self.mixture.names[s]
        return lambda batch: mixture.counts(batch * G, global_batch_size=G)[name]

    @property
    def planned_until(self) -> int:
        return int(self.mixture_order.planned_until)

    def returned(self, epoch: int, position: int) -> None:
        self.mixture_order.returned(epoch, position)

    def replanned(self, epoch: int) -> int | None:
        return self.mixture_order.replanned(epoch)

    def epoch_length(self, epoch: int) -> int:
        return int(self.mixture_order.samples_per_epoch)

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        src, k = self.mixture_order.draws(epoch, positions)
        out = self.mixture_order.source_indices(src, k)
        for s, gate in enumerate(self.gates):
            where = src == s
            if gate is not None and where.any():
                local = gate.pool_order[gate.stream_ranks(k[where])]
                out[where] = np.asarray(local, dtype=np.int64) + int(self.mixture.offsets[s])
        return out

    def describe(self, epoch: int, position: int) -> dict[str, Any]:
        """The mixture's facts plus, per gated source, its step, pool size and difficulties."""
        g = epoch * self.epoch_length(epoch) + int(position)
        gated = {}
        for name, gate in zip(self.mixture.names, self.gates, strict=True):
            if gate is not None:
                step = g // self.G - 1 + gate.first_step
                at = max(step, gate.first_step)
                gated[name] = {
                    "step": step,
                    "pool_size": gate.pool_size(at),
                    "difficulty": self.curricula[name].difficulties(at),
                }
        return envelope(
            "curriculum_mixture_order",
            ORDER_VERSION,
            mixture=self.mixture_order.describe(epoch, position),
            sources=gated,
        )

    def validate(self, described: Mapping[str, Any]) -> None:
        """Refuse facts of another kind or version, another weight schedule or other gates."""
        facts = open_envelope(
            described,
            kind="curriculum_mixture_order",
            version=ORDER_VERSION,
            fields={"mixture": dict, "sources": dict},
            what="curriculum mixture order state",
        )
        self.mixture_order.validate(facts["mixture"])
        mine = sorted(self.curricula)
        if sorted(facts["sources"]) != mine:
            raise ValueError(
                f"the checkpoint gates sources {sorted(facts['sources'])}, this loader {mine}; "
                "resume with the same curricula per source"
            )
        for name, gate in zip(self.mixture.names, self.gates, strict=True):
            recorded = facts["sources"].get(name)
            if gate is None or not isinstance(recorded, dict):
                continue
            step = recorded.get("step")
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(
                    f"the checkpoint's curriculum of source {name!r} has step={step!r}; the "
                    "checkpoint is corrupted"
                )
            at = max(step, gate.first_step)
            check_gate(
                recorded,
                pool_size=gate.pool_size(at),
                difficulty=self.curricula[name].difficulties(at),
                what=f"curriculum of source {name!r}",
            )
