"""ToMe: bipartite soft matching merges the projector outputs down to the budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import InputSelector, InputSignals, Reference, Selection, as_float32, ranked_indices
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.similarity import unit_rows


@register
@dataclass
class ToMeSelector(InputSelector):
    """Token merging (ToMe) at the projector output, in rounds of bipartite soft matching, to the budget.

    Each round on the current ``n`` tokens merges ``r = min(n - budget, n // 2)`` of them
    (ToMe's cap of half the tokens): the tokens at even positions (A) each find their most
    cosine-similar token at an odd position (B); the ``r`` A tokens with the highest such
    similarity merge into their B partner by size-weighted average (``merge_wavg``: the sum of
    ``x * size`` over the sum of sizes), the others pass unmerged. The next round sees
    ``[unmerged A in descending-similarity order, B]`` (the official output order), its metric
    the merged tokens themselves. 576 tokens reach 64 in rounds of 288, 144, 72 and 8.

    Follows facebookresearch/ToMe ``tome/merge.py`` (commit af95e4b1):
    ``bipartite_soft_matching`` (no protected token: the projector output has no CLS),
    ``merge_wavg`` and ``merge_source`` for the cells each output token carries. Differences:
    the metric is the token itself (the official blocks use the head-mean keys of the layer
    that merges, which the projector output does not have); exact ties go to the lower index
    where ``argsort`` leaves them unspecified; the in-tower schedule and proportional
    attention (``log(size)`` added to the attention logits) are not implemented.

    Returns ``Selection(kept, sources, llm_tokens)``: ``llm_tokens`` (M, D) float32 in the
    language model's input space, ``sources`` the grid cells each carries, ``kept`` the cells
    whose token was never merged.

    Options:
        order: ``"official"`` (unmerged A tokens by similarity, then B, per round) or ``"raster"``
            (output tokens sorted by their first cell, the order the image's tokens had).
    """

    name: ClassVar[str] = "tome"
    summary: ClassVar[str] = "bipartite soft matching merges the projector outputs to the budget (ToMe)"
    requires: ClassVar[frozenset[str]] = frozenset({"features"})
    merges: ClassVar[bool] = True
    reference: ClassVar[Reference] = Reference(
        "Token Merging: Your ViT But Faster (ICLR 2023, arXiv 2210.09461)",
        "facebookresearch/ToMe",
        "bipartite_soft_matching + merge_wavg + merge_source, at the projector output, rounds of r <= n / 2",
    )

    order: str = option("official", Choice(("official", "raster")), "official round order, or raster order")

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        tokens = as_float32(signals.features)
        size = torch.ones(tokens.shape[0])
        sources = [torch.tensor([cell]) for cell in range(tokens.shape[0])]
        while tokens.shape[0] > budget:
            tokens, size, sources = merge_round(tokens, size, sources, min(tokens.shape[0] - budget, tokens.shape[0] // 2))
        if self.order == "raster":
            order = torch.argsort(torch.tensor([int(group.min()) for group in sources]))
            tokens, sources = tokens[order], [sources[i] for i in order.tolist()]
        singles = [int(group[0]) for group in sources if group.numel() == 1]
        return Selection(kept=torch.sort(torch.tensor(singles, dtype=torch.long)).values, sources=sources, llm_tokens=tokens)


def merge_round(tokens: Tensor, size: Tensor, sources: list[Tensor], r: int) -> tuple[Tensor, Tensor, list[Tensor]]:
    """One bipartite soft matching round merging ``r`` tokens (``r <= n // 2``).

    Args:
        tokens: (n, D) float32 current tokens (also the similarity metric).
        size: (n,) how many original tokens each stands for.
        sources: n ascending LongTensors, the grid cells each carries.
        r: tokens to merge away.

    Returns:
        ``(n - r, D)`` tokens, their sizes and sources, ordered ``[unmerged A, B]``.
    """
    unit = unit_rows(tokens)
    best, partner = (unit[0::2] @ unit[1::2].T).max(dim=1)  # (|A|,) each A token's most similar B token
    ranked = ranked_indices(best, best.numel())  # most similar first; ties to the lower index
    merged, unmerged = ranked[:r], ranked[r:]
    weighted = tokens * size[:, None]
    a_weighted, a_size = weighted[0::2], size[0::2]
    b_weighted = weighted[1::2].index_add(0, partner[merged], a_weighted[merged])
    b_size = size[1::2].index_add(0, partner[merged], a_size[merged])
    a_sources, b_sources = sources[0::2], list(sources[1::2])
    for a, b in zip(merged.tolist(), partner[merged].tolist()):
        b_sources[b] = torch.cat([b_sources[b], a_sources[a]])
    new_size = torch.cat([a_size[unmerged], b_size])
    new_tokens = torch.cat([a_weighted[unmerged], b_weighted]) / new_size[:, None]
    new_sources = [a_sources[i] for i in unmerged.tolist()] + [torch.sort(group).values for group in b_sources]
    return new_tokens, new_size, new_sources
