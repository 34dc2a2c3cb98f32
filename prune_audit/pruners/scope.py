"""SCOPE: saliency-weighted facility-location coverage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32, cls_probabilities
from prune_audit.pruners.fidelity import CLS_HALF, Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SCORE_DTYPES
from prune_audit.pruners.signals import InputSignals
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
    summary: ClassVar[str] = "CLS saliency^alpha x facility-location coverage gain (SCOPE); gap_power is non-reference"
    requires: ClassVar[frozenset[str]] = frozenset({"vision_features", "cls_attention"})
    reference: ClassVar[Reference] = Reference(
        "SCOPE: Saliency-Coverage Oriented Token Pruning for Efficient Multimodal LLMs "
        "(NeurIPS 2025, arXiv 2510.24214)",
        "kinredon/SCOPE",
        "ALPHA=1.0, COMBINED=multi; gap_power is an extension (default 1 = reference)",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "6bf73069",
        "saliency^alpha x facility-location gain, alpha=1, near-ties (relative 1e-5) to the lower index, float32 scores",
        ("ties=argmax", "score_dtype=model"),
        (
            "near-ties (relative 1e-5) go to the lower index by default; ties=argmax takes the official plain argmax "
            "(no near-tie occurred in the random cases, so both agree there); gap_power is an extension (1 = reference)",
            "float32 by default (the official code computes the saliency, cosines, coverage gaps and gains in the "
            "model dtype, fp16/bf16 in practice, whose rounding creates ties); score_dtype=model rounds each of them "
            "to the model dtype as it does, the sums accumulated at higher precision as half-precision reductions on "
            "GPU are; a half-precision matrix product's last bit depends on its kernel's accumulation order (about "
            "1 cosine in 10^4), so agreement with a given GPU run can only be near-exact",
        ),
        random_agreement(
            30,
            "test_scope.py::test_scope_reproduces_the_official_greedy",
            "1024-dim CLIP features, dense official greedy, ties=tolerance and ties=argmax alike; against the "
            "official greedy run in fp16: score_dtype=model 29 of 30, float32 23 of 30; in bf16: score_dtype=model "
            "30 of 30, float32 12 of 30 (test_scope.py::test_scope_model_dtype_reproduces_the_official_half_precision_greedy); "
            "and naive facility-location cases (test_input_selectors.py); "
            + CLS_HALF
            + "score_dtype=model 28 and 30 of 30, float32 21 and 3 of 30",
        ),  # fmt: skip
        30,
        "with score_dtype=model, ties=argmax against the official greedy run in that dtype on CPU: fp16 29 of 30, "
        "bf16 30 of 30 (test_scope.py::test_scope_model_dtype_reproduces_the_official_half_precision_greedy, "
        "asserted with one case of slack); float32 23 and 12 of 30; the remaining fp16 case is kernel rounding: "
        "a half-precision matrix product's last bit depends on its accumulation order (about 1 cosine in 10^4 "
        "differs by an ulp between kernels)",
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
