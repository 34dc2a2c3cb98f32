"""VisPruner: important tokens by CLS attention plus diverse tokens by removing duplicates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import (
    InputSelector,
    Reference,
    Selection,
    as_float32,
    cls_probabilities,
    ranked_indices,
    rounded_to,
)
from prune_audit.pruners.fidelity import INPUT_DTYPE, Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Integer, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SCORE_DTYPES
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.similarity import unit_rows, unit_rows_in


@register
@dataclass
class VisPrunerSelector(InputSelector):
    """Important patches by CLS attention, the rest of the budget by removing near-duplicates (VisPruner).

    With ``T`` the budget: ``T_imp = int(T * important_ratio)`` important patches are the
    top of the head-mean CLS attention (``cls_attention``, (H, N)); the other ``N - T_imp``
    patches R, in descending attention order, lose duplicates until ``T - T_imp`` remain.
    Each round splits R alternately into A (positions 0, 2, ...) and B (1, 3, ...), gives
    every a in A its highest cosine similarity to B (unit ``vision_features``, (N, Dv)),
    drops the ``r = min(removal_step, |R| - (T - T_imp))`` members of A with the highest
    similarity and continues with ``[A's survivors in descending-similarity order, B]``.
    Kept: important and surviving patches, ascending (the official boolean mask).

    Follows Theia-4869/VisPruner ``llava/model/llava_arch.py::encode_images`` (commit
    aefa01ad) with ``clip_encoder.py::feature_select``: CLIP layer -2 attentions and
    hidden states, ``important_ratio`` 0.5, ``r`` at most 8 per round. Differences:
    exact ties go to the lower index (attention) and the lower position (similarity)
    where ``argsort`` leaves them unspecified, and an odd |R| (where the official batched
    indexing fails: it needs ``|A| == |B|``) gives A the extra member.

    Options:
        important_ratio: share of the budget taken by attention (the official ``--important_ratio``).
        removal_step: most duplicates removed per round (the official 8).
        score_dtype: ``"float32"`` (default) or ``"model"``: the CLS attention as the official eager
            attention forms it in the model dtype (:func:`cls_probabilities`), its head mean, the unit
            features and the A-B cosines rounded to the model dtype, as the official code computes in
            fp16/bf16 (reductions accumulate in float32).
    """

    name: ClassVar[str] = "vispruner"
    summary: ClassVar[str] = "top CLS-attention patches plus duplicates removed from the rest (VisPruner)"
    requires: ClassVar[frozenset[str]] = frozenset({"cls_attention", "vision_features"})
    reference: ClassVar[Reference] = Reference(
        "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning in VLMs "
        "(VisPruner, ICCV 2025, arXiv 2412.01818v2)",
        "Theia-4869/VisPruner",
        "CLIP layer -2 CLS row (head mean) and hidden states; important_ratio 0.5; 8 duplicates per round",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "aefa01ad",
        "important_ratio 0.5 of the budget by head-mean CLS attention, the rest by removing duplicates 8 per round, "
        "float32 scores",
        ("score_dtype=model",),
        (
            "ties to the lower index in the attention ranking and to the lower position in the duplicate ranking "
            "(argsort leaves them unspecified)",
            "an odd number of residual tokens (e.g. budget 63 or 65 at ratio 0.5) splits A = even positions, one "
            "longer than B; the official batched indexing needs |A| == |B| and fails there",
            INPUT_DTYPE + "; under score_dtype=model the head mean, the unit features and the A-B cosines are "
            "rounded to the model dtype as well",
        ),
        random_agreement(
            30,
            "test_vispruner.py::test_vispruner_reproduces_the_official_important_and_diverse_tokens",
            "1024-dim CLIP states; against the official code run in fp16 / bf16 with a GPU's float32 accumulation "
            "(norms and cosines rounded once): score_dtype=model 30 of 30 each, float32 scoring 0 of 30; CPU fp16 "
            "kernels round some norms and cosines differently (18 of 30 there)",
        ),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 with score_dtype=model against the official forward in that dtype with a "
        "GPU's float32 accumulation (norms and cosines rounded once) "
        "(test_vispruner.py::test_vispruner_reproduces_the_official_important_and_diverse_tokens); against the CPU "
        "fp16 kernels 18 of 30: they round some norms and cosines differently (kernel rounding)",
        {"fp16": 30, "bf16": 30},
    )

    flops_exact: ClassVar[bool] = True

    important_ratio: float = option(0.5, Real(low=0.0, high=1.0), "share of the budget chosen by CLS attention")
    removal_step: int = option(8, Integer(low=1), "most duplicates removed per round")
    score_dtype: str = option("float32", Choice(SCORE_DTYPES), "float32, or the model dtype as the official code")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Each duplicate-removal round on R residual tokens: the ceil(R/2) x floor(R/2) cosine matrix."""
        important = int(work.kept * work.options["important_ratio"])
        keep, residual, total = work.kept - important, work.tokens - important, 0
        if keep <= 0:
            return 0
        while (removed := min(work.options["removal_step"], residual - keep)) > 0:
            total += matmul((residual + 1) // 2, work.vision_width, residual // 2)
            residual -= removed
        return total

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        dtype = signals.model_dtype if self.score_dtype == "model" and signals.model_dtype != torch.float32 else None
        attention = rounded_to(cls_probabilities(signals, dtype).mean(dim=0), dtype)  # (N,)
        important_count = int(budget * self.important_ratio)
        ranked = ranked_indices(attention, signals.num_tokens)  # every patch, most attended first
        important, residual = ranked[:important_count], ranked[important_count:]
        diverse_count = budget - important_count
        if diverse_count > 0:
            features = as_float32(signals.vision_features)
            unit = unit_rows(features) if dtype is None else unit_rows_in(features, dtype)
            residual = remove_duplicates(residual, unit, diverse_count, self.removal_step, dtype)
            important = torch.cat([important, residual])
        return Selection(kept=torch.sort(important).values)


def remove_duplicates(residual: Tensor, unit: Tensor, keep: int, step: int, dtype: torch.dtype | None = None) -> Tensor:
    """VisPruner's iterative matching: drop the most duplicated members of ``residual`` until ``keep`` remain.

    Args:
        residual: (R,) grid indices in their current order (descending attention at first).
        unit: (N, Dv) float32 unit-norm features (rounded to ``dtype`` when given).
        keep: how many to keep, ``keep <= R``.
        step: most members removed per round.
        dtype: None, or the half dtype the cosines are rounded to before they are ranked.

    Returns:
        (keep,) grid indices in the official order: each round's A survivors, then B.
    """
    while (removed := min(step, residual.numel() - keep)) > 0:
        a, b = residual[0::2], residual[1::2]
        similarity = rounded_to(unit[a] @ unit[b].T, dtype).max(dim=1).values  # (|A|,) best match in B
        survivors = ranked_indices(similarity, a.numel())[removed:]  # most similar first, then dropped
        residual = torch.cat([a[survivors], b])
    return residual
