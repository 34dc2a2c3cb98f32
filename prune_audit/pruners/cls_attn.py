"""CLS-attention selection (FasterVLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import TOP_K_TIES, InputSelector, LayerSelector, Reference, cls_probabilities
from prune_audit.pruners.fidelity import CLS_HALF, INPUT_DTYPE, TIES_TOPK_HALF, Fidelity, random_agreement
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SCORE_DTYPES
from prune_audit.pruners.signals import InputSignals


@register
@dataclass
class ClsAttentionSelector(InputSelector):
    """Keep the patches the vision CLS token attends to most (FasterVLM).

    ``score_j = mean_h A[h, j]`` over the CLS row of the feature layer's attention
    probabilities (patch columns only, not renormalised); keep the top ``budget`` in
    raster order. ``head_aggregation="sum"`` gives the same ranking (VisionZip /
    HiRED / SCOPE write it as a sum). Follows Theia-4869/FasterVLM
    ``clip_encoder.py::feature_select`` with ``select_layer=-2``; ties go to the lower
    index instead of ``torch.topk``'s unspecified order.

    Options:
        head_aggregation: ``"mean"`` (reference) or ``"sum"`` over the H heads.
        score_dtype: ``"float32"`` (default) or ``"model"``: the probabilities are formed
            from the CLS logits in the model dtype (``signals.model_dtype``) as the
            reference's eager attention forms them (:func:`cls_probabilities`) and the
            aggregated scores rounded to it, the head mean in between stays float32, as the
            reference ranks the fp16/bf16 head mean of fp16/bf16 probabilities (ties then go
            to the lower index).
    """

    name: ClassVar[str] = "cls_attn"
    summary: ClassVar[str] = "top-k of the vision CLS token's attention to the patches (FasterVLM)"
    requires: ClassVar[frozenset[str]] = frozenset({"cls_attention"})
    reference: ClassVar[Reference] = Reference(
        "[CLS] Attention is All You Need for Training-Free Visual Token Pruning: Make VLM Inference Faster "
        "(FasterVLM, arXiv 2412.01818)",
        "Theia-4869/FasterVLM",
        "CLIP layer 22 (attentions[-2]) CLS row, head mean",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "f5d5f120",
        "head mean of the CLS row at CLIP layer -2, top-k, float32 scores",
        ("score_dtype=model", "ties=topk"),
        (TIES_TOPK_HALF, "ties to the lower index (torch.topk leaves them unspecified)", INPUT_DTYPE),
        random_agreement(
            30,
            "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k",
            "score_dtype=model: the top-k of the rounded head mean on an fp16 case where float32 differs "
            "(test_input_selectors.py), and on the adapter's bf16 signals (test_fidelity.py); "
            + CLS_HALF
            + "score_dtype=model 30 of 30 in both, float32 29 and 16 of 30",
        ),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 with score_dtype=model, ties=topk against the official torch.topk of the "
        "head mean of the official half CLS attention (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); lower-index ties "
        "at most 29 and 23 of 30, float32 29 and 16 of 30",
        {"fp16": 30, "bf16": 30},
    )

    flops_exact: ClassVar[bool] = True  # no products of its own: it ranks the CLS attention the model gives it

    head_aggregation: str = option("mean", Choice(("mean", "sum")), "head mean (reference) or sum; same ranking")
    score_dtype: str = option("float32", Choice(SCORE_DTYPES), "float32, or the model dtype as the official code")
    ties: str = option("lower", Choice(TOP_K_TIES), "exact ties to the lower index, or torch.topk's order (official)")

    # the in-LLM selectors' rounding under score_dtype="model": it reads only score_dtype and signals.model_dtype
    model_precision = LayerSelector.model_precision

    def score(self, signals: InputSignals, generator: torch.Generator | None) -> Tensor:
        """(N,) aggregated CLS attention from ``cls_attention`` (H, N), rounded under ``score_dtype="model"``."""
        attention = cls_probabilities(signals, signals.model_dtype if self.score_dtype == "model" else None)
        scores = attention.mean(dim=0) if self.head_aggregation == "mean" else attention.sum(dim=0)
        return self.model_precision(scores, signals)  # type: ignore[misc, arg-type]  # reads only score_dtype and model_dtype
