"""CDPruner: conditional DPP selection with fast greedy MAP inference."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SCORE_DTYPES
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.similarity import (
    TIES,
    SpeculativeRows,
    first_near_max,
    half_dtype,
    tie_tolerance,
    unit_rows,
    unit_rows_in,
)

# a conditional gain below this fraction of the largest diagonal entry is treated as 0:
# float32 cancellation in ``gain - e**2`` leaves noise of about that size
_EXHAUSTED = 1e-6


def greedy_dpp_map(kernel_rows: Callable[[Tensor], Tensor], diagonal: Tensor, k: int, tolerance: float = 0.0) -> Tensor:
    """Fast greedy MAP inference for a DPP (Chen, Zhang & Zhou, NeurIPS 2018).

    Each step picks ``argmax_i log det L[S + i]``, i.e. the largest conditional gain
    ``d2_i = L_ii - |c_i|^2`` (plain argmax, or near-ties within ``tolerance`` to the lower index),
    kept with incremental Cholesky vectors: ``e = (L[j] - C[:, j] @ C) / sqrt(d2_j)``,
    ``d2 -= e**2``. Unlike Chen et al. it does not stop early. Gains below
    ``1e-6 * max(diag L)`` count as 0, so the square root never sees a negative
    rounding residue (the reference has no guard and yields NaN) and, once the
    kernel's rank is exhausted, the remaining picks follow in index order.

    The residual rows ``L[j] - C[:, j] @ C`` are computed by :class:`SpeculativeRows`
    for the pick and the next best gains at once, as two matrix products (kernel rows,
    then the correction by the vectors so far); a later pick among them only subtracts
    the vectors added since.

    Args:
        kernel_rows: (B,) long indices ``J`` -> (B, N) float32 ``L[J]``, rows of a PSD kernel L.
        diagonal: (N,) float32 ``diag(L)``.
        k: number of picks, ``1 <= k <= N``.
        tolerance: relative tie tolerance (0: plain argmax, the reference).

    Returns:
        (k,) indices in pick order.
    """
    n = diagonal.numel()
    floor = _EXHAUSTED * float(diagonal.max().clamp_min(0))
    gains = torch.where(diagonal > floor, diagonal, 0.0)
    picked = torch.zeros(n, dtype=torch.bool)
    vectors = torch.zeros(k, n, dtype=torch.float32)
    step = 0

    def residual_rows(indices: Tensor) -> Tensor:
        rows = kernel_rows(indices)
        rows -= vectors[:step, indices].T @ vectors[:step]
        return rows

    residuals = SpeculativeRows(residual_rows)
    corrected_until = 0  # the vectors already subtracted from the rows in ``residuals``
    picks: list[int] = []
    for step in range(k):
        scores = gains.masked_fill(picked, float("-inf"))
        best = first_near_max(scores, tolerance)
        picks.append(best)
        picked[best] = True
        if gains[best] > floor:
            if best not in residuals:
                residuals.fetch(best, scores)
                corrected_until = step
            recent = vectors[corrected_until:step]
            residual = residuals[best] - recent[:, best] @ recent
            vectors[step] = residual / math.sqrt(float(gains[best]))
            gains = gains - vectors[step] ** 2
            gains = torch.where(gains > floor, gains, 0.0)
    return torch.tensor(picks, dtype=torch.long)


@register
@dataclass
class CDPrunerSelector(InputSelector):
    """Conditional DPP over projector outputs, conditioned on text relevance (CDPruner).

    Kernel ``L = diag(r) S diag(r)`` with ``S`` the cosine similarity of the (N, D)
    ``features`` and ``r`` the (N,) ``text_relevance`` min-max normalised as in the
    reference, ``r = (r - min r + 1e-6) / (max r - min r)`` (denominator floored at
    1e-6 so constant relevance gives r = 1; min and max over the whole image when the
    signals are one crop's, ``text_relevance_bounds``, as the reference's LLaVA-NeXT code
    normalises over all crops before its per-crop DPP); with ``theta`` set,
    ``r = exp(theta / (2 (1 - theta)) * r)``. The ``budget`` tokens are chosen by
    :func:`greedy_dpp_map` and returned in raster order. ``text_relevance`` must
    already carry the reference's sign flip (``mean_m -cos(E_i, T_m)``); the model
    adapter computes it. Follows Theia-4869/CDPruner ``llava_arch.py::encode_images``
    (theta off by default, as there). Kernel rows are computed on demand, a few
    rows per ``O(B N D)`` product, so no N x N matrix is built.

    Options:
        theta: None (reference) or a value in (0, 1) for the exponential relevance.
        ties: ``"argmax"`` (reference: plain float32 argmax) or ``"tolerance"`` (gains
            within a relative 1e-5 of the best are tied, the lower index wins).
        score_dtype: ``"float32"`` (default) or ``"model"``: the unit rows are computed in
            the model's dtype (``signals.model_dtype``; hand-built half-precision features
            keep theirs) and only then widened, as the reference normalises the projector
            outputs before its ``.float()``, and the relevance (``model_text_relevance``, the raw
            relevance as computed in that dtype, where the adapter passes it) is min-max normalised in that
            dtype (:meth:`relevance`); the kernel and the greedy stay float32 there too.
    """

    name: ClassVar[str] = "cdpruner"
    summary: ClassVar[str] = "conditional DPP (projector cosine x text relevance), fast greedy MAP (CDPruner)"
    requires: ClassVar[frozenset[str]] = frozenset({"features", "text_relevance"})
    reference: ClassVar[Reference] = Reference(
        "Beyond Attention or Similarity: Maximizing Conditional Diversity for Token Pruning in MLLMs "
        "(CDPruner, NeurIPS 2025, arXiv 2506.10967)",
        "Theia-4869/CDPruner",
        "linear min-max relevance (theta off); greedy MAP without early stop",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "9541616c",
        "conditional DPP, linear relevance (theta off), fast greedy MAP, plain float32 argmax",
        ("score_dtype=model",),
        (
            "no early stop and gains below 1e-6 x max diag count as 0 (the official code has no guard and yields NaN "
            "once the kernel's rank is exhausted)",
            "kernel rows computed on demand, no N x N matrix (memory at high resolution)",
            "unit rows and relevance in float32 by default (the official code normalises the projector outputs, "
            "computes the CLIP relevance and min-max normalises it in the model dtype, then computes the kernel and "
            "the greedy in float32); score_dtype=model does the same: the unit rows in the model dtype, the raw "
            "relevance as the adapter computes it in the CLIP dtype (model_text_relevance: unit embeddings, cosines "
            "and their mean rounded) normalised in the model dtype, every step rounded",
        ),
        random_agreement(
            30,
            "test_fidelity.py::test_plain_argmax_reproduces_the_official_greedy",
            "ties=tolerance: 30 of 30; fp16 and bf16 features: score_dtype=model 30 of 30 each, float32 26 and 9 of "
            "30 (test_cdpruner.py::test_cdpruner_model_dtype_reproduces_the_official_half_precision_normalisation)",
        ),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 random cases (and 10 of 10 each with a quarter of the tokens duplicated) "
        "with score_dtype=model against the official unit features, CLIP relevance and "
        "min-max normalisation written out in half on CPU, the kernel and greedy in float32 "
        "(test_cdpruner.py::test_cdpruner_model_dtype_reproduces_the_official_half_precision_relevance); from "
        "the float32 raw relevance rounded once (no model_text_relevance) 28 and 23 of 30, float32 throughout 29 and "
        "8 of 30; the adapter's model_text_relevance is checked on a half tiny LLaVA with its CLIP text tower",
        {"fp16": 30, "bf16": 30},
    )

    #: nominal: the speculative kernel rows vary with the data (``pruners.arithmetic``)
    flops_exact: ClassVar[bool] = False

    theta: float | None = option(
        None, Real(low=0.0, high=1.0, open_low=True, open_high=True, optional=True), "exponential relevance (off)"
    )
    ties: str = option("argmax", Choice(TIES), "argmax (official) or tolerance (relative 1e-5, lower index)")
    score_dtype: str = option("float32", Choice(SCORE_DTYPES), "float32, or unit rows in the model dtype (official)")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Kernel rows ``r_i r_j cos(f_i, f_j)`` for all N and, at greedy step t, the t-term Cholesky update of N
        entries."""
        updates = sum(matmul(1, step, work.tokens) for step in range(work.kept))
        return matmul(work.tokens, work.feature_width, work.tokens) + updates

    def relevance(
        self, text_relevance: Tensor, dtype: torch.dtype | None = None, bounds: Tensor | None = None
    ) -> Tensor:
        """(N,) float32 normalised relevance from the raw (N,) ``text_relevance``.

        ``dtype`` (a half dtype under ``score_dtype="model"``): the raw relevance rounded to it and
        min-max normalised in it, every step rounded (the official code normalises its half-precision
        relevance before the float32 kernel); None: in float32. ``bounds``: (2,) the min and max to
        normalise by (the whole image's, for one crop's tokens); None: those of ``text_relevance``.
        """
        raw = as_float32(text_relevance) if dtype is None else text_relevance.detach().to(dtype)
        low, high = (raw.min(), raw.max()) if bounds is None else bounds.to(raw.dtype)
        relevance = (raw - low + 1e-6) / (high - low).clamp_min(1e-6)
        relevance = relevance.float()
        if self.theta is not None:
            relevance = torch.exp(self.theta / (2 * (1 - self.theta)) * relevance)
        return relevance

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        dtype = half_dtype(signals.model_dtype, signals.features) if self.score_dtype == "model" else None
        unit = unit_rows(signals.features) if dtype is None else unit_rows_in(signals.features, dtype)
        official_raw = signals.model_text_relevance if dtype is not None else None
        if official_raw is None:
            relevance = self.relevance(signals.text_relevance, dtype, signals.text_relevance_bounds)
        else:
            relevance = self.relevance(official_raw, dtype, signals.model_text_relevance_bounds)
        diagonal = relevance**2 * (unit * unit).sum(dim=1)

        def kernel_rows(indices: Tensor) -> Tensor:
            return relevance[indices, None] * relevance * (unit[indices] @ unit.T)

        order = greedy_dpp_map(kernel_rows, diagonal, budget, tie_tolerance(self.ties))
        return Selection(kept=torch.sort(order).values)
