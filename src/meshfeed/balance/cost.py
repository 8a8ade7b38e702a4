"""CostModel: how long one document takes, as a linear plus quadratic function of its length.

Attention work grows with the square of a document's length, but below tens of thousands of
tokens the linear GEMM work dominates; a model with only an ``s**2`` term mis-balances exactly
the common case. A document of length ``s`` on ``c`` context-parallel ranks costs each of them
``(linear * s + quadratic * s**2) / c``, and every micro-step adds ``per_step`` (launch,
optimizer-free fixed overhead). Units are arbitrary but shared: FLOPs from
:meth:`CostModel.from_transformer`, seconds from :meth:`CostModel.calibrate`.

>>> cost = CostModel(linear=1.0, quadratic=0.001)
>>> float(cost.work(np.array([1000]))[0])
2000.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CostModel"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Per-document cost ``(linear*s + quadratic*s**2) / c`` plus ``per_step`` per micro-step.

    All three coefficients must be finite and non-negative, and ``linear`` or ``quadratic``
    must be positive (a model that prices every document at zero cannot balance anything).
    """

    linear: float = 0.0
    quadratic: float = 0.0
    per_step: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "per_step"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.floating, np.integer)) or not (
                np.isfinite(value) and value >= 0
            ):
                raise ValueError(
                    f"CostModel.{name} must be a finite number >= 0 (got {name}={value!r}); "
                    "costs are times or FLOPs and cannot be negative"
                )
        if self.linear == 0 and self.quadratic == 0:
            raise ValueError(
                f"CostModel needs linear > 0 or quadratic > 0 (got linear={self.linear}, "
                f"quadratic={self.quadratic}); e.g. CostModel(linear=1.0) balances tokens"
            )

    def work(self, lengths: Any) -> np.ndarray:
        """Total cost (float64) of each document on one rank, excluding ``per_step``."""
        s = np.asarray(lengths, dtype=np.float64)
        return self.linear * s + self.quadratic * s * s

    def time(self, lengths: Any, cp: Any = 1) -> np.ndarray:
        """Per-rank cost of each document on ``cp`` ranks, excluding ``per_step``."""
        return self.work(lengths) / np.asarray(cp, dtype=np.float64)

    @classmethod
    def from_transformer(
        cls,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        ffn_hidden_size: int | None = None,
        gated_mlp: bool = False,
        vocab_size: int = 0,
        causal: bool = True,
        training: bool = True,
        per_step: float = 0.0,
    ) -> CostModel:
        """FLOPs of a decoder-only transformer: GEMMs per token, attention per token pair.

        Per layer and token the projections cost ``2*h*(h + 2*kv)`` (QKV), ``2*h*h`` (output)
        and ``2*k*h*ffn`` (MLP, ``k`` = 3 when gated else 2); the logits add ``2*h*vocab``.
        Attention costs ``4*h`` per (query, key) pair and layer, halved when ``causal``.
        ``training`` multiplies both by 3 (forward plus a backward of twice the cost).
        """
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int (got {name}={value!r})")
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size must be divisible by num_heads (got {hidden_size=}, {num_heads=})"
            )
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if kv_heads < 1 or num_heads % kv_heads:
            raise ValueError(
                f"num_kv_heads must divide num_heads (got {num_kv_heads=}, {num_heads=})"
            )
        h = float(hidden_size)
        kv = h * kv_heads / num_heads
        ffn = float(ffn_hidden_size if ffn_hidden_size is not None else 4 * hidden_size)
        mlp_mats = 3 if gated_mlp else 2
        per_layer = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * mlp_mats * h * ffn
        linear = num_layers * per_layer + 2 * h * vocab_size
        quadratic = num_layers * 4 * h * (0.5 if causal else 1.0)
        factor = 3.0 if training else 1.0
        return cls(linear=factor * linear, quadratic=factor * quadratic, per_step=per_step)

    @classmethod
    def calibrate(cls, lengths: Any, times: Any, *, fit_per_step: bool = False) -> CostModel:
        """Least-squares fit of ``time ~ linear*s + quadratic*s**2 (+ per_step)``.

        ``times[i]`` is the measured time of one micro-step holding one document of length
        ``lengths[i]`` on one rank. With ``fit_per_step`` the intercept becomes ``per_step``.
        Coefficients that come out negative (noise) are dropped and the rest refitted, so the
        result is always a valid model. Needs at least as many measurements as terms.
        """
        s = np.asarray(lengths, dtype=np.float64).ravel()
        t = np.asarray(times, dtype=np.float64).ravel()
        columns = _calibration_columns(s, t, fit_per_step=fit_per_step)
        fitted = _nonnegative_fit(columns, t)
        if fitted is None:
            raise ValueError(
                "the measured times do not grow with length, so no cost model fits; "
                "check that times are per micro-step and lengths vary"
            )
        return cls(**fitted)


def _calibration_columns(
    s: np.ndarray, t: np.ndarray, *, fit_per_step: bool
) -> dict[str, np.ndarray]:
    """The design columns of :meth:`CostModel.calibrate` by term name, refused unless the
    measurements pair up, are valid and are enough for the terms."""
    if s.shape != t.shape:
        raise ValueError(
            f"lengths and times must pair up (got {s.size} lengths, {t.size} times); "
            "give one time per measured length"
        )
    if not (np.all(np.isfinite(s)) and np.all(np.isfinite(t)) and np.all(s > 0)):
        raise ValueError("lengths must be positive and times finite; drop broken samples")
    columns = {"linear": s, "quadratic": s * s}
    if fit_per_step:
        columns["per_step"] = np.ones_like(s)
    if s.size < len(columns) or np.unique(s).size < 2:
        raise ValueError(
            f"calibrate needs >= {len(columns)} measurements at >= 2 distinct lengths "
            f"(got {s.size} at {np.unique(s).size}); measure more lengths"
        )
    return columns


def _scaled_lstsq(columns: dict[str, np.ndarray], active: list[str], t: np.ndarray) -> np.ndarray:
    """Least-squares coefficients of the ``active`` columns, each column scaled to max 1 so
    the normal equations are well conditioned at lengths ~ 1e5."""
    a = np.stack([columns[k] for k in active], axis=1)
    scale = np.abs(a).max(axis=0)
    coef, *_ = np.linalg.lstsq(a / scale, t, rcond=None)
    return np.asarray(coef / scale)


def _nonnegative_fit(columns: dict[str, np.ndarray], t: np.ndarray) -> dict[str, float] | None:
    """The fit with every coefficient >= 0 (negative terms dropped and the rest refitted), or
    None when no length-dependent term is left positive."""
    active = list(columns)
    while active:
        coef = _scaled_lstsq(columns, active, t)
        negative = [k for k, c in zip(active, coef, strict=True) if c < 0]
        if not negative:
            fitted = dict(zip(active, (float(c) for c in coef), strict=True))
            if fitted.get("linear", 0.0) == 0 and fitted.get("quadratic", 0.0) == 0:
                return None
            return fitted
        active = [k for k in active if k not in negative]
    return None
