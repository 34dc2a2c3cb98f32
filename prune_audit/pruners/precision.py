"""Arithmetic in the model's dtype: what ``score_dtype="model"`` rounds, and how, so that a selector scores
as its official code does in fp16 / bf16 (``docs/fidelity.md``'s fp16 / bf16 column)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from prune_audit.pruners.signals import InputSignals

MODEL_ATTENTIONS = ("eager", "scaled")
"""How ``score_dtype="model"`` forms decoder attention in the model dtype: ``q.k`` rounded, then ``"eager"``
(LLaVA-era ``LlamaAttention``: divided by sqrt(d) and rounded, float32 softmax rounded) or ``"scaled"``
(SparseVLM's own path: multiplied by 1/sqrt(d) in the model dtype, softmax of the half logits)."""


def as_float32(tensor: Tensor) -> Tensor:
    return tensor.detach().to(torch.float32)


def rounded_to(values: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``values`` rounded to ``dtype`` and kept float32 (``score_dtype="model"``); unchanged for None."""
    return values if dtype is None else values.to(dtype).float()


def cls_probabilities(signals: InputSignals, dtype: torch.dtype | None) -> Tensor:
    """(H, N) float32 CLS attention to the patches as a selector scores it.

    ``dtype`` None: ``cls_attention`` (float32). A half dtype (``score_dtype="model"``):
    the probabilities the official eager attention computes in it, the softmax of the
    (H, 1 + N) ``cls_logits`` rounded to ``dtype``, itself rounded; without logits
    (hand-built signals) ``cls_attention`` rounded to ``dtype``.
    """
    if dtype is None or dtype == torch.float32:
        return as_float32(signals.cls_attention)
    if signals.cls_logits is None:
        return as_float32(signals.cls_attention).to(dtype).float()
    logits = as_float32(signals.cls_logits).to(dtype).float()
    return torch.softmax(logits, dim=-1).to(dtype).float()[:, 1:]
