"""HoliTom's inner-LLM merge: at one deep decoder layer the last prompt row's attention keeps a share of the visual
tokens and every other one is folded into its most similar kept one, in that kept token's place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import Reference, Stage, TokenMerge, validate_budget
from prune_audit.pruners.fastv import last_row_attention
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Flag, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import REFERENCE_DEPTH, ReferenceLayer, SingleStageSelector
from prune_audit.pruners.signals import LayerSignals
from prune_audit.pruners.similarity import unit_rows

#: ``HOLITOM_k`` = 18 (the README's and the evaluation scripts' setting) on the 28 layers of LLaVA-OneVision-7B's
#: Qwen2-7B, given on the 32-layer reference as the other selectors' layers: ``scale_layers`` takes 21 back to 18
MERGE_LAYER = 21
#: ``HOLITOM_r``: the share of the visual tokens folded into the others
MERGE_RATIO = 0.5
#: ``official``: the official share at the layer, whatever the budget; ``average``: the count at that layer whose
#: layer average is the budget
HOLITOM_LLM_RULES = ("official", "average")


def official_keep(num_visual: int, ratio: float) -> int:
    """The official kept count, ``round(n (1 - HOLITOM_r))`` (Python's rounding, half to even, as the official)."""
    return round(num_visual * (1 - ratio))


def folded(hidden: Tensor, ranked: Tensor) -> TokenMerge | None:
    """The official inner-LLM merge of the alive tokens into the kept ones.

    Every token not in ``ranked``, in ascending position, is folded into the kept token of highest cosine
    similarity (similarities of the states before any fold; on a tie the first in ``ranked``, as the official
    ``torch.max`` over its top-k order) as ``h_kept <- (h_kept + h) / 2``.

    Args:
        hidden: (n, D) float32 layer-input states of the alive visual tokens.
        ranked: (k,) positions among them of the kept tokens, in descending attention (the official top-k order).

    Returns:
        The kept tokens that gained members, each in its own place (``replaces``), or None where none did.
    """
    others = torch.ones(hidden.shape[0], dtype=torch.bool)
    others[ranked] = False
    others = torch.nonzero(others).flatten()
    if others.numel() == 0 or ranked.numel() == 0:
        return None
    unit = unit_rows(hidden)
    nearest = torch.argmax(unit[others] @ unit[ranked].T, dim=1)  # (n - k,) slot in ranked; ties to the first
    targets = torch.sort(ranked[torch.unique(nearest)]).values  # in ascending position
    merged, members = [], []
    for target in targets.tolist():
        joined = others[ranked[nearest] == target]  # ascending: the official loop's order
        token = hidden[target].clone()
        for other in joined.tolist():
            token = (token + hidden[other]) / 2
        merged.append(token)
        members.append(torch.sort(torch.cat([torch.tensor([target]), joined])).values)
    return TokenMerge(torch.stack(merged), members, replaces=targets)


@register
@dataclass
class HoliTomLLMSelector(SingleStageSelector):
    """HoliTom's inner-LLM merge as one in-LLM stage (cokeshao/HoliTom ``holitom/modeling_qwen2.py``).

    Officially (``Qwen2Model_holitom.forward``, prefill only: a forward of more than one position), at the input of
    decoder layer ``HOLITOM_k`` the head-mean attention of the last prompt token in layer ``HOLITOM_k - 1`` (its
    ``output_attentions``) over the visual tokens keeps the top ``round(n (1 - HOLITOM_r))``; every other visual
    token, in ascending position, is folded into the kept token whose state (the layer's input, the residual
    stream) has the highest cosine similarity to its own (all similarities taken before any fold) as
    ``h_kept <- (h_kept + h) / 2``; the other tokens are dropped, and the kept ones keep their original positions
    (``position_ids = keep_indexs``) and their places in the sequence. Here the same is one stage at the input of
    ``layer`` (21 on the 32-layer reference, scaled: 18 on the 28 layers of LLaVA-OneVision-7B and Qwen2.5-VL-7B),
    scored by the previous layer's last prompt row (``signal_layer`` previous), the merged tokens written over the
    kept ones they extend (``TokenMerge.replaces``, as VScan's merge): their layout slots and position ids stay, so
    a Qwen2.5-VL clip's merged token keeps its kept token's 3-D M-RoPE position (the project allows in-LLM merges on
    keep-original-position families for this reason; only input-level merged tokens need new positions).

    ``budget_rule="official"`` (default): the official share at the layer, whatever the budget (a budget of every
    visual token keeps all); the budget is not a layer average (``averages_budget`` False).
    ``budget_rule="average"``: the same layer, the count solved so the layer average is the budget; a budget below
    what the layers before it hold is refused, naming the smallest reachable one. ``merge_pruned=false`` drops the other
    tokens without folding them in (an ablation, FastV's stage at HoliTom's layer). Composed after the outer-LLM
    merge as ``holitom+holitom_llm`` it is the official "HoliTom"; the outer part alone is "HoliTom (w/o M)".

    Official defaults: ``HOLITOM_k=18 HOLITOM_r=0.5`` (README.md and ``scripts/eval_*_holitom.sh``; the code's own
    environment default of ``HOLITOM_k`` is 3, which no script uses). Departures: float32 where the official runs
    in bf16; exact attention ties to the lower index (the official ``torch.topk``); the visual tokens are the
    project's (the official counts LLaVA-OneVision's row-end newline tokens among them, the project's Qwen2.5-VL
    has none); the official merges batch row 0's span in every row (batch size 1 in its evaluation), here each row
    its own.

    Reference: cokeshao/HoliTom ``holitom/modeling_qwen2.py`` (``Qwen2Model_holitom.forward``) and ``README.md``
    at commit e9b2972f.
    """

    name: ClassVar[str] = "holitom_llm"
    summary: ClassVar[str] = (
        "HoliTom's inner-LLM merge: at layer 18 of 28 the last prompt row's attention keeps half, the rest folded in"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", "hidden_states"})
    clip_method: ClassVar[bool] = True  # HoliTom's second stage: reads the LLM, not the clip's grid
    reference: ClassVar[Reference] = Reference(
        "HoliTom: Holistic Token Merging for Fast Video Large Language Models (NeurIPS 2025, arXiv 2505.21334)",
        "cokeshao/HoliTom",
        "holitom/modeling_qwen2.py: the inner-LLM merge at layer HOLITOM_k = 18, HOLITOM_r = 0.5",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "e9b2972f",
        "one stage at layer 18 of 28 (21 of the 32-layer reference, scaled): the last prompt row's head-mean "
        "attention at the layer before keeps round(n / 2) visual tokens, each other one folded in ascending order "
        "into its most cosine-similar kept one as (h_kept + h) / 2 in the kept one's place and position, whatever "
        "the budget",
        (),
        (
            "budget_rule=average (not official) keeps the count at the layer whose layer average is the budget",
            "a stage of the project's alive visual tokens: the official span of LLaVA-OneVision also holds its "
            "row-end newline tokens (Qwen2.5-VL has none); each batch row its own span (the official reads row 0's)",
            "exact attention ties to the lower index (the official torch.topk leaves them unspecified); float32 "
            "where the official runs in bf16",
            "the official code is LLaVA-OneVision's (1-D positions, none for Qwen2.5-VL); on a Qwen2.5-VL clip a "
            "merged token keeps its kept token's 3-D M-RoPE position (the in-place merge, as VScan's)",
        ),
        random_agreement(
            30,
            "test_holitom_llm.py::test_the_stage_equals_the_rederived_official_merge",
            "merged states within 1e-5 of a loop-by-loop float64 re-derivation of the official forward's merge "
            "(random attention rows and hidden states, 10 seeds, 3 shapes); on a tiny Qwen2.5-VL clip the prefill "
            "of holitom+holitom_llm equals the stock forward with the dropped keys masked and the folds written at "
            "the layer's input (test_qwen2_5_vl_holitom_llm.py::test_the_inner_merge_folds_half_the_fed_tokens_in_place)",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = True

    layer: int = option(MERGE_LAYER, ReferenceLayer(1, REFERENCE_DEPTH - 1), "the decoder layer whose input merges")
    merge_ratio: float = option(
        MERGE_RATIO, Real(0.0, 1.0, open_high=True), "HOLITOM_r: the share of the visual tokens folded into the rest"
    )
    budget_rule: str = option(
        "official", Choice(HOLITOM_LLM_RULES), "official: the official share, whatever the budget; average: solved"
    )
    merge_pruned: bool = option(True, Flag(), "fold the other tokens into the kept ones (official), or drop them")
    signal_layer = "previous"  # the official reads the previous layer's attention output (not an option)

    @property
    def averages_budget(self) -> bool:
        return self.budget_rule == "average"  # official: the official share, whatever the budget

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The folded tokens' cosines to the kept ones (:func:`folded`), at the stage that drops tokens; the folds
        themselves are sums."""
        if not work.options["merge_pruned"]:
            return 0
        return sum(matmul(alive - kept, work.hidden, kept) for alive, kept in work.stages if 0 < kept < alive)

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """One stage at the scaled layer: every token for a budget of all of them, else the official count or the
        count solved to the layer average."""
        budget = validate_budget(budget)
        (layer,) = self._layers(num_layers)
        if budget >= num_visual:
            return [Stage(layer, num_visual)]
        if self.budget_rule == "official":
            return [Stage(layer, official_keep(num_visual, self.merge_ratio))]
        smallest = -(-layer * num_visual // num_layers)  # the layers before it hold every token
        if budget < smallest:
            raise ValueError(
                f"holitom_llm merges at decoder layer {layer} of {num_layers}, so the layer average of {num_visual} "
                f"visual tokens is at least {smallest}; raise the budget to {smallest} or more, or use "
                f"budget_rule=official"
            )
        return self.solved_stages(num_layers, num_visual, budget)

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """The last prompt row's head-mean attention to each alive visual token."""
        return last_row_attention(signals)

    def merge(self, stage: Stage, signals: LayerSignals, state: dict[str, Any], kept: Tensor) -> TokenMerge | None:
        """The kept tokens with the others folded in, in their own places (None with ``merge_pruned=false``)."""
        if not self.merge_pruned or kept.numel() >= signals.num_alive:
            return None
        scores = self.model_precision(self.score(stage, self.inputs(signals), state), signals)[kept]
        ranked = kept[torch.sort(-scores, stable=True).indices]  # the top-k order; ties to the lower position
        return folded(signals.hidden_states.detach().float().cpu(), ranked.cpu())


__all__ = ["HoliTomLLMSelector", "folded", "official_keep"]
