"""DART: keep pivot tokens and the tokens least duplicated with respect to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_audit.pruners.base import LayerSignals, Reference, Stage, top_k_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SingleStageSelector

VISUAL_PIVOTS = 4
TEXT_PIVOTS = 4


def picks_per_pivot(picks: int, num_pivots: int) -> list[int]:
    """Split ``picks`` over the pivots in order: equal shares, the first ``picks % num_pivots`` get one more."""
    share, extra = divmod(picks, num_pivots)
    return [share + (1 if index < extra else 0) for index in range(num_pivots)]


@register
@dataclass
class DARTSelector(SingleStageSelector):
    """DART (Wen et al., "Stop Looking for Important Tokens ... Duplication Matters More", 2025; ZichenWen1/DART).

    One stage at the input of decoder layer ``layer`` (K = 2, scaled on other depths),
    no attention weights:

    1. Pivots: the 4 alive visual tokens and the 4 text tokens (after the image) with
       the largest L1 norm of their post-RoPE keys (``key_norms``, ``text_key_norms``).
    2. Pivots are visited in ascending sequence order (visual pivots, then text
       pivots); the reference iterates a Python set, so its order is hash order.
    3. For each pivot, the candidates (alive visual tokens that are not pivots and not
       yet picked) with the **lowest** cosine similarity of ``normed_hidden_states``
       (the model's final norm on the layer input) to the pivot are picked.
    4. Kept: the visual pivots and every pick, in raster order; original positions kept.

    ``budget_rule="paper"``: ``per = budget // 8`` picks per pivot, so ``4 + 8 per``
    tokens are kept (68 / 132 / 196 for 64 / 128 / 192), the reference's
    ``max_num_trunction`` rule. ``budget_rule="average"`` (default): the kept count is
    solved so the layer average equals the budget (as FastV) and the
    ``keep - 4`` picks are split over the pivots in order, the first ones taking one
    more when it does not divide (in paper mode it always divides). With ``keep <= 4``
    the top-``keep`` visual pivots are kept.

    Deviations: ``key_norms`` are those the executor provides at the stage (the
    reference uses layer K-1's keys); fp32, ties to the lower index.
    """

    name: ClassVar[str] = "dart"
    summary: ClassVar[str] = "key-norm pivots + least-duplicated tokens by hidden-state cosine, layer K=2"
    requires: ClassVar[frozenset[str]] = frozenset(
        {"key_norms", "text_key_norms", "normed_hidden_states", "text_normed_hidden_states"}
    )
    reference: ClassVar[Reference] = Reference(
        "Stop Looking for Important Tokens in Multimodal Language Models: Duplication Matters More (DART), 2025",
        "ZichenWen1/DART",
        "code read from the vendored copy in Chenfei-Liao/VTC-Bench external/DART",
    )

    def paper_keep(self, budget: int) -> int:
        return VISUAL_PIVOTS + (VISUAL_PIVOTS + TEXT_PIVOTS) * (budget // 8)

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        if not 0 < stage.keep < signals.num_alive:
            return super().prune(stage, signals, state)  # nothing or everything: the base handles it
        self._check_signals(signals)
        visual_pivots = top_k_indices(signals.key_norms, min(VISUAL_PIVOTS, stage.keep))
        if visual_pivots.numel() == stage.keep:
            return visual_pivots
        text_pivots = top_k_indices(signals.text_key_norms, TEXT_PIVOTS)
        hidden = F.normalize(signals.normed_hidden_states.detach().float(), dim=-1)
        text_hidden = F.normalize(signals.text_normed_hidden_states.detach().float(), dim=-1)
        pivot_hidden = torch.cat([hidden[visual_pivots], text_hidden[text_pivots]])  # (P, D), sequence order
        candidate = torch.ones(signals.num_alive, dtype=torch.bool)
        candidate[visual_pivots] = False
        kept = [visual_pivots]
        shares = picks_per_pivot(stage.keep - visual_pivots.numel(), pivot_hidden.shape[0])
        for pivot, share in zip(pivot_hidden, shares):
            dissimilarity = (-(hidden @ pivot)).masked_fill(~candidate, float("-inf"))
            picks = top_k_indices(dissimilarity, share)
            candidate[picks] = False
            kept.append(picks)
        return torch.sort(torch.cat(kept)).values
