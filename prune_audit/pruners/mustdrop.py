"""MustDrop: multi-stage vision token dropping; a key token set by CLS attention survives every prefill stage,
the rest drops by the text's global and individual attention."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from prune_audit.pruners.base import PositionMode, Reference, Stage, top_k_indices
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import (
    REFERENCE_DEPTH,
    ScheduledSelector,
    merge_stages,
    scale_layers,
    solve_schedule,
)
from prune_audit.pruners.signals import LayerSignals

#: the decoder layers whose attention scores (``pruning_layers``); their outputs are pruned: stages at layer + 1
MUSTDROP_LAYERS = (2, 6, 10, 14)
KEY_SHARE = 0.08  # ``keep_rate``: the key set is ceil(0.08 N) patches by CLS attention
GLOBAL_THRESHOLD = 0.011  # ``--global_thr`` of the 64-token scripts (textvqa_64.sh, vizwiz_64.sh)
INDIVIDUAL_THRESHOLD = 0.01  # ``--individual_thr`` of the same scripts
#: ``average``: counts solved to the budget; ``paper`` (the in-LLM selectors' name for the reference rule): the script thresholds, the count they give
MUSTDROP_RULES = ("average", "paper")


def dual_attention_score(text_probs: Tensor, global_thr: float, individual_thr: float) -> Tensor:
    """(n,) float32 score whose ``>= 1`` is the official keep rule (``dual_attention_filter``).

    The official filter drops a token when its global attention (head-mean probabilities summed over the text
    rows, ``g``) is below ``global_thr * sum(g)`` *and* its individual attention (their maximum over the text
    rows, ``m``) is below ``individual_thr``; so a token survives iff ``max(g / (global_thr sum g), m /
    individual_thr) >= 1``, which this returns. Ranking by it keeps the official survivors first under a count.

    Args:
        text_probs: (H, T, n) attention probabilities of the text rows after the image to the alive visual tokens.
    """
    attention = text_probs.detach().float().mean(dim=0)  # (T, n)
    total = attention.sum(dim=0)  # (n,) global attention
    return torch.maximum(total / (total.sum() * global_thr), attention.max(dim=0).values / individual_thr)


def key_set(cls_attention: Tensor, share: float = KEY_SHARE) -> Tensor:
    """(ceil(share N),) ascending patch indices of the largest CLS attention (``cls_attention`` (N,) float32,
    head-mean probabilities of the CLS row); exact ties to the lower index."""
    return top_k_indices(cls_attention.float(), math.ceil(share * cls_attention.numel()), "lower")


@register
@dataclass
class MustDropSelector(ScheduledSelector):
    """MustDrop (Liu et al., "Multi-Stage Vision Token Dropping", arXiv 2411.10803; liuting20/MustDrop).

    Key set: the ``ceil(0.08 N)`` patches with the largest head-mean CLS attention of the vision tower
    (``layer_cls_attention`` of the feature layer, the last row), fixed at the first stage; its tokens survive
    every stage. Prefill stages: the attention of decoder layers 2, 6, 10 and 14 (``signal_layer`` previous:
    each layer's own probabilities, as the official code reads ``output_attentions``) prunes their outputs
    (stages at the inputs of layers 3, 7, 11, 15, scaled to the model's depth), head-mean over the text rows
    after the image, scored by :func:`dual_attention_score` (the official dual-attention filter as a score).
    Positions are compacted after every stage (the official code narrows ``position_ids`` to ``0..L'-1``). The
    decoding stage only slices the KV cache to the prefill's kept tokens, which the executor does.

    ``budget_rule="average"`` (default): one count at the four stages (nudged by single tokens), solved so the
    layer average is the budget: the official thresholds drop almost everything they drop at the first stage and
    little after (realised 19.5 / 19.5 / 19.5 / 19.5 on the demo). Each stage keeps the key set's alive tokens
    first (by score; all of them when the count allows), then the highest scores. ``budget_rule="paper"``:
    the official thresholds (``global_thr`` 0.011, ``individual_thr`` 0.01, the 64-token scripts) keep every
    token scoring at least 1 plus the key set, whatever the budget; the realised counts are recorded per stage
    (``kept_stages``).

    Follows liuting20/MustDrop (commit 909afa53): ``modelling_sparse_llama.py`` (``pruning_layers``,
    ``dual_attention_filter``, the key set joined by ``torch.unique``) and ``clip_encoder.py`` (the key set of
    ``keep_rate`` 0.08). Differences (docs/fidelity.md): the vision stage (3 x 3 windows of mean pairwise cosine
    >= 0.8 merged after CLIP layer 0, the tower rerun on the merged tokens) is not run, so the language model
    sees the 576 unmerged patches; the key set is ranked by the feature layer's CLS attention (22) instead of the
    last layer's (23) on the merged tokens.
    """

    name: ClassVar[str] = "mustdrop"
    summary: ClassVar[str] = "key set by CLS attention kept; text global/individual attention drops at layers 2/6/10/14"
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", "layer_cls_attention"})
    reference: ClassVar[Reference] = Reference(
        "Multi-Stage Vision Token Dropping: Towards Efficient Multimodal Large Language Model (arXiv 2411.10803)",
        "liuting20/MustDrop",
        "key set (top 8% CLS attention) + dual-attention thresholds at layers 2/6/10/14 (global 0.011, individual "
        "0.01); vision-stage 3x3 window merge not run",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "909afa53",
        "key set of the top 8% feature-layer CLS attention kept; the dual-attention score of layers 2/6/10/14 "
        "prunes their outputs to one count solved to the budget average; positions compacted",
        ("budget_rule=paper",),
        (
            "the vision stage is not run: the official tower merges 3x3 windows whose mean pairwise cosine is >= 0.8 "
            "after CLIP layer 0 and reruns layers 1..23 on the merged tokens; the tower hook here (merging_tower) "
            "merges between attention and MLP and returns no last-layer attention, so the language model sees "
            "the unmerged patches",
            "the key set ranks the feature layer's (22) head-mean CLS attention over the unmerged patches; the "
            "official ranks layer 23's over the merged tokens (ceil(0.08 N) of them)",
            "budget_rule=average replaces the thresholds by one count at the four stages solved to the budget "
            "average (derived, not official: the thresholds' realised counts fall at the first stage and stay), "
            "the key set first (all of it where the count allows), ranking the rest by the threshold rule as a "
            "score (max(g / (0.011 sum g), m / 0.01)); "
            "budget_rule=paper runs the official thresholds and ignores the budget (realised counts recorded per stage)",
            "exact ties to the lower index (ties=lower); the official threshold rule has no ranking",
            "fp32 scores (the official attention is fp16); no half-precision agreement measured",
        ),
        random_agreement(
            30,
            "tests/pruners/test_mustdrop.py::test_official_rule_reproduces_the_dual_attention_filter",
            "kept sets of each prefill stage and the key set against the official filter re-derived on LLaVA "
            "shapes (32 heads, 576 tokens); the count rule keeps the official survivors first",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = True  # no products of its own: sums and maxima of the attention it is given

    budget_rule: str = option(
        "average", Choice(MUSTDROP_RULES), "average (counts solved to the budget) or paper (the official thresholds)"
    )
    positions: PositionMode = option(
        "compact", Choice(get_args(PositionMode)), "position ids after pruning (reference compacts)"
    )
    global_thr: float = option(GLOBAL_THRESHOLD, Real(low=0.0), "global attention threshold (share of the sum)")
    individual_thr: float = option(INDIVIDUAL_THRESHOLD, Real(low=0.0), "individual attention threshold")
    signal_layer = "previous"  # each scoring layer prunes its own output (not an option)

    def _layers(self, num_layers: int) -> list[int]:
        return sorted(set(scale_layers([layer + 1 for layer in MUSTDROP_LAYERS], REFERENCE_DEPTH, num_layers)))

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """Official rule: the four stages with no count limit (the thresholds decide); else the solved counts."""
        if self.budget_rule == "paper":
            layers, counts = merge_stages(self._layers(num_layers), [num_visual] * len(MUSTDROP_LAYERS))
            return [Stage(layer, count) for layer, count in zip(layers, counts, strict=True)]
        return super().schedule(num_layers, num_visual, budget)

    def solved_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        layers = self._layers(num_layers)
        return solve_schedule(layers, [1.0] * len(layers), num_layers, num_visual, budget)

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """(k,) ascending alive positions that survive: the key set's and the best scores (or the thresholds')."""
        self._check_signals(signals)
        if "key_set" not in state:  # fixed at the first stage, over every patch, in grid indices
            state["key_set"] = signals.alive.cpu()[key_set(signals.layer_cls_attention.float().cpu()[-1])]
        keys = torch.isin(signals.alive.cpu(), state["key_set"])
        scores = self.model_precision(
            dual_attention_score(self.inputs(signals).text_probs, self.global_thr, self.individual_thr), signals
        ).cpu()
        if self.budget_rule == "paper":
            return torch.nonzero((scores >= 1) | keys).flatten()
        keep = min(stage.keep, signals.num_alive)
        if keep <= 0:  # nothing left to rank (a tiny model's solved count can reach 0)
            return torch.zeros(0, dtype=torch.long)
        priority = torch.where(keys, scores + scores.max() + 1, scores)  # key tokens first, in score order
        return top_k_indices(priority, keep, self.ties)
