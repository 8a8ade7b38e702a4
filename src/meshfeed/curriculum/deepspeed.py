"""Read a DeepSpeed config's curriculum section, so a DeepSpeed user switches by pointing at it.

Understood: ``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics`` (each
metric's ``difficulty_type``, ``clustering_type``, ``min_difficulty``, ``max_difficulty``,
``schedule_type`` and ``schedule_config``) and the legacy top-level ``curriculum_learning``
(``curriculum_type: "seqlen"``). Metrics named ``seqlen_truncate`` / ``seqlen_reshape`` (or with
``clustering_type: "single_cluster"``) become transforms, other ``single_cluster`` metrics
(e.g. the ``dummy_metric`` of DeepSpeed's own tests) become a :class:`ReportedDifficulty` (the
value is reported, nothing is gated or cut, as in DeepSpeed); the others gate sampling and need
a meshfeed metric index: pass ``indexes={name: MetricIndex or path}``, or let
``index_to_metric_path`` point at a directory written by ``meshfeed analyze``. A path may be a
URL (``s3://bucket/metrics/vocab_rarity``), read through the shard cache at ``cache_dir=``
with ``storage_options=`` (see :meth:`MetricIndex.load`).

What DeepSpeed's sampler does, the curriculum built here does too: batch ``n`` gets the
difficulty of curriculum step ``n + 1`` (``first_step=1``; DeepSpeed increments before it
samples), and a percentile pool at ``p`` holds ``(N // max_difficulty) * p`` samples
(``percentile_max``), all ``N`` at ``max_difficulty``.

Switches follow DeepSpeed's defaults (``DATA_EFFICIENCY_ENABLED_DEFAULT`` and the data-sampling
and curriculum ones are all False): the data-efficiency curriculum applies only when
``data_efficiency.enabled``, ``data_sampling.enabled`` and ``curriculum_learning.enabled`` are
all true, as in DeepSpeed. A config that enables no curriculum is refused, naming the switch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from meshfeed.curriculum.curriculum import Curriculum, CurriculumMetric, Transform
from meshfeed.curriculum.index import MetricIndex
from meshfeed.curriculum.schedule import Schedule, fixed_discrete, fixed_linear, fixed_root
from meshfeed.curriculum.transforms import ReportedDifficulty, SeqlenReshape, SeqlenTruncate
from meshfeed.storage import StorageOptions, is_url

__all__ = ["from_deepspeed_config", "schedule_from_deepspeed"]

_TRANSFORMS: dict[str, type[SeqlenTruncate] | type[SeqlenReshape]] = {
    "seqlen_truncate": SeqlenTruncate,
    "seqlen_reshape": SeqlenReshape,
}


def _need(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ValueError(f"DeepSpeed config {where} is missing {key!r} (got keys {sorted(cfg)})")
    return cfg[key]


def schedule_from_deepspeed(cfg: Mapping[str, Any], *, where: str = "curriculum") -> Schedule:
    """One DeepSpeed metric/curriculum block -> a meshfeed schedule."""
    kind = _need(cfg, "schedule_type", where)
    if kind not in ("fixed_linear", "fixed_root", "fixed_discrete"):
        raise ValueError(
            f"DeepSpeed config {where}: schedule_type {kind!r} is not supported from JSON; use "
            "fixed_linear, fixed_root or fixed_discrete, or build custom(fn) in Python"
        )
    sc = _need(cfg, "schedule_config", where)
    if kind == "fixed_discrete":
        return fixed_discrete(
            difficulty=_need(sc, "difficulty", where), max_step=_need(sc, "max_step", where)
        )
    lo, hi = _need(cfg, "min_difficulty", where), _need(cfg, "max_difficulty", where)
    total = _need(sc, "total_curriculum_step", where)
    step = _need(sc, "difficulty_step", where)
    if kind == "fixed_linear":
        return fixed_linear(lo, hi, total, step)
    return fixed_root(lo, hi, total, step, _need(sc, "root_degree", where))


def _index(
    name: str, cfg: Mapping[str, Any], indexes: Mapping[str, Any], remote: Mapping[str, Any]
) -> MetricIndex:
    given = indexes.get(name)
    if isinstance(given, MetricIndex):
        return given
    path = given if given is not None else cfg.get("index_to_metric_path")
    if path is not None and is_url(os.fspath(path)):
        return MetricIndex.load(path, **remote)  # its errors name the URL
    if path is not None and (Path(path) / "meta.json").is_file():
        return MetricIndex.load(path)
    raise ValueError(
        f"curriculum metric {name!r} needs a meshfeed metric index (got {path=}); run "
        f"`meshfeed analyze` and pass indexes={{{name!r}: '<dir>/{name}'}}"
    )


def from_deepspeed_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    indexes: Mapping[str, MetricIndex | str | os.PathLike[str]] | None = None,
    samples_per_epoch: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    storage_options: StorageOptions | None = None,
) -> Curriculum:
    """A :class:`Curriculum` from a DeepSpeed config dict or JSON file (see module doc).

    ``cache_dir``, ``cache_limit`` and ``storage_options`` serve index paths that are URLs.
    """
    cfg: Mapping[str, Any] = (
        config if isinstance(config, Mapping) else json.loads(Path(config).read_text())
    )
    indexes = dict(indexes or {})
    cl, off = _curriculum_section(cfg)
    remote = dict(cache_dir=cache_dir, cache_limit=cache_limit, storage_options=storage_options)
    metrics, transforms = ([], []) if off else _read_metrics(cl, indexes, remote)
    legacy = _legacy_transform(cfg)
    if legacy is not None:
        transforms.append(legacy)
    if not metrics and not transforms:
        _refuse_no_curriculum(cl, off)
    return Curriculum(
        metrics, transforms=transforms, samples_per_epoch=samples_per_epoch, first_step=1
    )


def _curriculum_section(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[str]]:
    """The ``curriculum_learning`` section under ``data_efficiency.data_sampling`` (``{}``
    when absent) and the names of the switches above it that are not true."""
    de = cfg.get("data_efficiency", cfg if "data_sampling" in cfg else {})
    sampling = de.get("data_sampling", {})
    cl = sampling.get("curriculum_learning", {})
    # DeepSpeed's defaults: each of the three switches is off unless set to true.
    switches = [
        ("data_efficiency.enabled", de),
        ("data_efficiency.data_sampling.enabled", sampling),
        ("data_efficiency.data_sampling.curriculum_learning.enabled", cl),
    ]
    off = [name for name, section in switches if not section.get("enabled", False)]
    return cl, off


def _read_metrics(
    cl: Mapping[str, Any], indexes: Mapping[str, Any], remote: Mapping[str, Any]
) -> tuple[list[CurriculumMetric], list[Transform]]:
    """The metrics (filtered through an index) and transforms of ``curriculum_metrics``."""
    metrics: list[CurriculumMetric] = []
    transforms: list[Transform] = []
    for name, m in _need(cl, "curriculum_metrics", "curriculum_learning").items():
        where = f"curriculum_metrics.{name}"
        schedule = schedule_from_deepspeed(m, where=where)
        if name in _TRANSFORMS:
            transforms.append(_TRANSFORMS[name](schedule=schedule))
        elif m.get("clustering_type") == "single_cluster":
            transforms.append(ReportedDifficulty(schedule=schedule, name=name))
        else:
            kind = m.get("difficulty_type", "value")
            metrics.append(
                CurriculumMetric(
                    index=_index(name, m, indexes, remote),
                    schedule=schedule,
                    difficulty_type=kind,
                    percentile_max=_percentile_max(m, where) if kind == "percentile" else None,
                )
            )
    return metrics, transforms


def _legacy_transform(cfg: Mapping[str, Any]) -> Transform | None:
    """The seqlen truncation of a legacy top-level ``curriculum_learning``, if enabled."""
    legacy = cfg.get("curriculum_learning", {})
    if not legacy.get("enabled", False):
        return None
    kind = legacy.get("curriculum_type", "seqlen")
    if kind != "seqlen":
        raise ValueError(
            f"legacy curriculum_learning.curriculum_type {kind!r} is not supported; only "
            "'seqlen' (truncation) exists in DeepSpeed's legacy curriculum"
        )
    return SeqlenTruncate(schedule=schedule_from_deepspeed(legacy))


def _refuse_no_curriculum(cl: Mapping[str, Any], off: list[str]) -> NoReturn:
    """Raise for a config that enables no curriculum, naming the switches that are off."""
    why = ""
    if cl and off:
        why = (
            f"; its curriculum_learning section is ignored because {', '.join(off)} "
            f"{'is' if len(off) == 1 else 'are'} not true (DeepSpeed defaults each to false)"
        )
    raise ValueError(
        f"the DeepSpeed config enables no curriculum{why}; set data_efficiency.enabled, "
        "data_sampling.enabled and curriculum_learning.enabled to true (or the legacy "
        "top-level curriculum_learning.enabled)"
    )


def _percentile_max(cfg: Mapping[str, Any], where: str) -> int:
    top = _need(cfg, "max_difficulty", where)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(
            f"DeepSpeed config {where}: a percentile metric needs an integer max_difficulty "
            f">= 1 (got {top!r}); DeepSpeed divides the sample count by it, usually 100"
        )
    return top
