"""SCOPE: saliency-weighted facility-location coverage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32, cls_probabilities
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SCORE_DTYPES
from prune_audit.pruners.similarity import (
    TIES,
    facility_location_greedy,
    half_dtype,
    tie_tolerance,
    unit_rows,
    unit_rows_in,
)


@register
@dataclass
class ScopeSelector(InputSelector):
    """Greedy saliency x coverage-gain selection on vision features (SCOPE).

    With ``S`` the cosine similarity of the (N, Dv) ``vision_features`` and coverage
    ``cov_j = max(0, max_{s in picked} S[j, s])``, each step picks the unpicked token
    maximising ``a_i ** alpha * sum_j max(0, S[j, i] - cov_j) ** gap_power``, where
    ``a_i = sum_h cls_attention[h, i]`` is the CLS saliency; picks are returned in
    raster order. ``alpha = 0`` is plain facility-location coverage. Follows
    kinredon/SCOPE ``clip_encoder.py::SCOPE`` (``ALPHA=1.0``, ``COMBINED=multi``),
    computed lazily (Minoux) without the N x N matrix, ties to the lower index.

    Options:
        alpha: saliency exponent (reference 1.0; arXiv 2604.12035 sweeps 0, 0.5, 1).
        gap_power: exponent of the coverage gap, NOT in the reference code (default 1
            = reference); the calibration study varies it.
        ties: ``"tolerance"`` (default: scores within a relative 1e-5 of the best are tied,
            the lower index winning) or ``"argmax"`` (the official code's plain argmax).
        score_dtype: ``"float32"`` (default) or ``"model"``: computed in the model's dtype
            (``signals.model_dtype``; hand-built half-precision features keep theirs) as the
            official code does: saliency (head sum of the CLS probabilities formed in it,
            :func:`cls_probabilities`), unit
            rows, cosines, coverage gaps, gains and scores each rounded to it, sums
            accumulated at higher precision as half-precision reductions on GPU do. Needs
            ``gap_power`` 1; half-precision ties then go to the lower index.
    """

    name: ClassVar[str] = "scope"
    summary: ClassVar[str] = (
        "CLS saliency^alpha x facility-location coverage gain (SCOPE); gap_power is non-reference"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"vision_features", "cls_attention"})
    reference: ClassVar[Reference] = Reference(
        "SCOPE: Saliency-Coverage Oriented Token Pruning for Efficient Multimodal LLMs "
        "(NeurIPS 2025, arXiv 2510.24214)",
        "kinredon/SCOPE",
        "ALPHA=1.0, COMBINED=multi; gap_power is an extension (default 1 = reference)",
    )

    flops_exact: ClassVar[bool] = True

    alpha: float = option(1.0, Real(low=0.0), "saliency exponent (reference 1)")
    gap_power: float = option(1.0, Real(low=0.0, open_low=True), "coverage-gap exponent (1 = reference)")
    ties: str = option("tolerance", Choice(TIES), "tolerance (relative 1e-5, lower index) or argmax (official)")
    score_dtype: str = option("float32", Choice(SCORE_DTYPES), "float32, or the model dtype as the official code")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The cosine of the vision features; its unweighted greedy gains are element-wise updates of it."""
        return matmul(work.tokens, work.vision_width, work.tokens)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.score_dtype == "model" and self.gap_power != 1.0:
            raise ValueError("score_dtype=model reproduces the official code, which has no gap_power: use gap_power=1")

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        rounding = self._rounding(signals)
        if rounding is None:
            unit, saliency = unit_rows(signals.vision_features), as_float32(signals.cls_attention).sum(dim=0)
            weights = saliency.clamp_min(0) ** self.alpha
        else:
            unit = unit_rows_in(signals.vision_features, rounding)
            saliency = cls_probabilities(signals, rounding).sum(dim=0).to(rounding)
            weights = (saliency.float().clamp_min(0) ** self.alpha).to(rounding).float()
        order, _ = facility_location_greedy(
            unit,
            budget,
            candidate_weights=weights,
            gap_power=self.gap_power,
            tolerance=tie_tolerance(self.ties),
            rounding=rounding,
        )
        return Selection(kept=torch.sort(order).values)

    def _rounding(self, signals: InputSignals) -> torch.dtype | None:
        """The half dtype to compute in under ``score_dtype="model"``; None for float32."""
        return half_dtype(signals.model_dtype, signals.vision_features) if self.score_dtype == "model" else None
