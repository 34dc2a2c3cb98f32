"""SparseVLM v2.0 (SparseVLM+): rater attention corrected for RoPE's position "gravity", on the priority heads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import PositionMode, Reference, Stage, ranked_indices, rounded_to
from prune_audit.pruners.fidelity import HALF_EXACT_CASES, ROPE_ONCE, Fidelity, half_exact, random_agreement
from prune_audit.pruners.options import Choice, Flag, Integer, option
from prune_audit.pruners.precision import MODEL_ATTENTIONS
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SIGNAL_LAYERS, ScheduledSelector
from prune_audit.pruners.signals import LayerSignals
from prune_audit.pruners.sparsevlm import SPARSEVLM_LAYERS, rater_flops, select_raters

# tokens kept after each stage in v2.0 mode (score.py of branch v2.0 with USE_VERSION=2_0)
SPARSEVLM2_COUNTS = {64: (66, 34, 20), 96: (246, 54, 28), 128: (238, 108, 60), 192: (300, 200, 118)}
REFERENCE_HEADS = 32  # query heads of LLaVA-1.5-7B, of which the official code keeps 14


def priority_head_count(priority_heads: int, num_heads: int) -> int:
    """Heads kept on a model with ``num_heads``: ``round(priority_heads * num_heads / 32)``, at least 1."""
    return min(num_heads, max(1, round(priority_heads * num_heads / REFERENCE_HEADS)))


def priority_head_mean(attention: Tensor, heads: int, ties: str, dtype: torch.dtype | None) -> Tensor:
    """(n,) the mean over the ``heads`` heads of largest summed rater attention, then over the raters.

    Args:
        attention: (H, R, n) corrected rater attention; ``dtype``: the model's half dtype under
            ``score_dtype="model"``, where the official ``select_attn_head_by_sum`` and ``attn_postprocess_topk``
            round the head sums, the head mean and the rater mean (the last rounded by the caller).
        ties: ``"topk"``: the heads as ``torch.topk`` orders them on the (half) sums, the official order the head
            mean accumulates in; ``"lower"``: best first, ties to the lower index.
    """
    if heads < attention.shape[0]:
        sums = rounded_to(attention.sum(dim=(1, 2)), dtype)
        chosen = torch.topk(sums, heads).indices if ties == "topk" else ranked_indices(sums, heads)
        attention = attention[chosen]
    if dtype is None:
        return attention.mean(dim=(0, 1))
    return rounded_to(attention.mean(dim=0), dtype).mean(dim=0)


@register
@dataclass
class SparseVLM2Selector(ScheduledSelector):
    """SparseVLM v2.0 / SparseVLM+ (Gumpest/SparseVLMs, branch ``v2.0``, ``USE_VERSION=2_0``).

    Raters as SparseVLM v1.5 (:func:`~prune_audit.pruners.sparsevlm.select_raters`, once per question).
    At each stage the rater rows' attention probabilities to the alive visual tokens (``text_probs``,
    (H, T, n)) are divided element-wise by ``rope_ones_logits`` ((T, n): the logit of all-ones query
    and key under the layer's RoPE at the same positions, the "text-visual attention gravity
    correction", section 4.2); the ``priority_heads`` heads with the largest sum of corrected rater
    attention over the visual tokens are kept (section 4.3); the score is the mean over those heads
    and the raters. Scoring layers 2, 6, 15 with the reference's semantics (their outputs pruned,
    ``signal_layer="previous"``); counts 66/34/20, 246/54/28, 238/108/60 and 300/200/118 for 64 / 96 /
    128 / 192 (``budget_rule="paper"``; ``"average"`` solves a schedule of the nearest shape); no
    recycling (v2.0 cancels the merge); positions kept (v2.0 keeps the position ids).

    Follows ``llava/model/language_model/modelling_sparse_llama.py::LlamaDynamicvitModel.forward`` and
    ``score.py`` (``select_attn_head_by_sum``, ``attn_postprocess_topk``) of branch v2.0 (commit
    9e1f649e). Its FlashAttention module forms the same softmax rows for scoring as the SDPA path, so
    the scoring has no separate FlashAttention switch here.

    ``score_dtype="model"`` (a half model dtype): as the reference computes in it, the raters from the
    rounded embeddings (:func:`~prune_audit.pruners.sparsevlm.select_raters`), the attention formed by its
    own ``scaled_dot_product_attention`` (``model_attention="scaled"``), the RoPE logits formed in the model
    dtype by the adapter, their quotient, the head sums, head mean and rater mean each rounded
    (:func:`priority_head_mean`); ``ties="topk"`` ranks heads and tokens with ``torch.topk``.

    Differences: exactly ``keep`` tokens are kept (the reference caps at ``n - 1``); ties to the lower
    index unless ``ties="topk"``; scores in float32 unless ``score_dtype="model"``; the 14 heads of the
    32 of LLaVA-1.5-7B scale with the model's heads (:func:`priority_head_count`); a RoPE logit of exactly 0
    (degenerate signals only) leaves its pair uncorrected where the reference divides by zero.

    Options:
        gravity_correction: divide by the all-ones RoPE logits (official; false: v1.5's raw probabilities).
        priority_heads: heads kept of the 32 on the reference (14 official; 32: every head).
        model_attention: the attention recipe under ``score_dtype="model"`` (``"scaled"``: the reference's own).
    """

    name: ClassVar[str] = "sparsevlm2"
    summary: ClassVar[str] = "SparseVLM v2.0: rater attention / RoPE gravity on priority heads, layers 2/6/15"
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", "embeddings", "text_embeddings", "rope_ones_logits"})
    reference: ClassVar[Reference] = Reference(
        "SparseVLM+ (SparseVLM v2.0; SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model "
        "Inference, arXiv 2410.04417v4)",
        "Gumpest/SparseVLMs",
        "branch v2.0, USE_VERSION=2_0: gravity correction, 14 priority heads, no merging, position ids kept",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "9e1f649e",
        "branch v2.0 (USE_VERSION=2_0): rater attention divided by the all-ones RoPE logits, 14 of 32 heads by their "
        "rater attention, layers 2/6/15 (outputs pruned), average rule on the v2.0 counts, no merging, positions kept",
        ("budget_rule=paper", "score_dtype=model", "ties=topk"),
        (
            "exactly keep tokens (the reference caps at n - 1); lower-index ties, float32 (ties=topk, score_dtype=model)",
            "14 priority heads of LLaVA-1.5-7B's 32 scaled with the model's heads (round(14 H / 32))",
            "a RoPE logit of exactly 0 (degenerate signals only) leaves its pair uncorrected (official: divides by 0)",
            "no FlashAttention switch: the v2.0 FlashAttention module forms the same softmax rows for scoring",
        ),
        random_agreement(
            30,
            "test_sparsevlm2.py::test_sparsevlm2_reproduces_the_official_gravity_corrected_priority_head_ranking",
            "32 heads, the library's RoPE probe against the official all-ones RoPE",
        ),
        30,
        half_agreement=half_exact("its scaled attention and RoPE logits in half", ROPE_ONCE, 25, 9),
        half_cases=HALF_EXACT_CASES,
    )

    flops_exact: ClassVar[bool] = True

    reference_counts: ClassVar[Mapping[int, Sequence[int]]] = SPARSEVLM2_COUNTS

    positions: PositionMode = option(
        "keep_original", Choice(get_args(PositionMode)), "position ids after pruning (v2.0 keeps)"
    )
    signal_layer: str = option(
        "previous", Choice(SIGNAL_LAYERS), "prune layer l's output by its attention (reference) or its input by a probe"
    )
    gravity_correction: bool = option(True, Flag(), "divide the attention by the all-ones RoPE logits (v2.0)")
    priority_heads: int = option(14, Integer(low=1, high=REFERENCE_HEADS), "heads kept of the 32 on the reference")
    model_attention: str = option(
        "scaled", Choice(MODEL_ATTENTIONS), "attention under score_dtype=model: the reference's own (scaled) or eager"
    )

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        return rater_flops(work)

    @property
    def reference_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        """Stage layers (inputs) on the 32-layer reference: after the scoring layers, or at them."""
        shift = 1 if self.signal_layer == "previous" else 0
        return tuple(layer + shift for layer in SPARSEVLM_LAYERS)

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        half = self.ranking_dtype(signals.model_dtype)
        if "raters" not in state:
            state["raters"] = select_raters(signals.embeddings, signals.text_embeddings, half)
        raters = state["raters"]
        attention = signals.text_probs.detach().float()[:, raters, :]  # (H, R, n)
        if self.gravity_correction:
            rope = signals.rope_ones_logits.float()[raters]  # (R, n)
            # an exact 0 leaves a pair uncorrected; the official quotient of half tensors is rounded
            attention = rounded_to(attention / torch.where(rope == 0, 1.0, rope)[None], half)
        heads = priority_head_count(self.priority_heads, attention.shape[0])
        return priority_head_mean(attention, heads, self.ties, half)
