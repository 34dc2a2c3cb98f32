"""ToMe: bipartite soft matching merges the projector outputs down to the budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32, ranked_indices
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.layout import GRID_MERGE
from prune_audit.pruners.options import Choice, Flag, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals
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
    where ``argsort`` leaves them unspecified.

    ``location="tower"``: ToMe as the official blocks run it, inside the vision tower up to the
    feature layer: between attention and MLP of every layer one round (:class:`TowerMerging`,
    CLS protected, metric the layer's head-mean keys, ``merge_wavg`` on the residual stream),
    ``r`` per layer from :func:`tower_schedule` (the official constant ``r`` as a per-layer list
    that ends at the budget), with proportional attention (``proportional_attention``: the
    official ``prop_attn``); the adapter runs the tower (``merging_tower``, LLaVA only).

    Returns ``Selection(kept, sources, llm_tokens)``: ``llm_tokens`` (M, D) float32 in the
    language model's input space (``vision_tokens`` (M, Dv) from the tower), ``sources`` the grid
    cells each carries, ``kept`` the cells whose token was never merged.

    Options:
        order: ``"official"`` (unmerged A tokens by similarity, then B, per round) or ``"raster"``
            (output tokens sorted by their first cell, the order the image's tokens had).
        location: ``"projector"`` (the usual VLM baseline) or ``"tower"``.
        proportional_attention: in the tower, add ``log(size)`` to each key's attention logits.
    """

    name: ClassVar[str] = "tome"
    summary: ClassVar[str] = "bipartite soft matching merges the projector outputs to the budget (ToMe)"
    per_grid: ClassVar[str] = GRID_MERGE
    requires: ClassVar[frozenset[str]] = frozenset({"features"})
    merges: ClassVar[bool] = True
    reference: ClassVar[Reference] = Reference(
        "Token Merging: Your ViT But Faster (ICLR 2023, arXiv 2210.09461)",
        "facebookresearch/ToMe",
        "bipartite_soft_matching + merge_wavg + merge_source, at the projector output, rounds of r <= n / 2",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "af95e4b1",
        "rounds of bipartite soft matching at the projector output (r <= n / 2 per round) to the budget, "
        "size-weighted averages, official output order",
        ("location=tower",),
        (
            "merges the projector outputs to the budget in rounds, the usual VLM baseline; location=tower merges "
            "inside the vision tower as the official blocks (CLS protected, head-mean keys, proportional attention)",
            "at the projector the similarity metric is the token itself (no keys there)",
            "location=tower: r per layer as even as possible to end at the budget (the official constant r, as a "
            "per-layer list), front-loaded where halving caps a layer; budgets below halving in every layer refused",
            "exact ties go to the lower index (argsort leaves them unspecified)",
            "every output token carries its merge_source cells (merged_stages): retention counts them and an object "
            "carried only by a merged token is diluted, not lost; order=raster sorts the output by first cell",
        ),
        random_agreement(
            30,
            "test_tome.py::test_tome_reproduces_the_official_merging_rounds",
            "each output token's cells, and its vector within 1e-5; location=tower: 30 of 30 through 23 layers "
            "(test_tome.py::test_tome_tower_merging_reproduces_the_official_blocks)",
        ),
        30,
    )

    flops_exact: ClassVar[bool] = True

    order: str = option("official", Choice(("official", "raster")), "official round order, or raster order")
    location: str = option("projector", Choice(("projector", "tower")), "merge the projector outputs, or in the tower")
    proportional_attention: bool = option(True, Flag(), "in the tower: log(size) added to attention logits (official)")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Each bipartite round on n tokens: the ceil(n/2) x floor(n/2) cosine matrix (:func:`merge_round`) of the
        projector outputs, or with ``location=tower`` of the head-mean keys (CLS included) in each tower layer
        that merges (``tower_merges``; the tower run itself is the model's, ``compute.flops.merging_tower``)."""
        if work.tower_merges:
            total, count = 0, 1 + work.tokens
            for merged in work.tower_merges:
                total += matmul((count + 1) // 2, work.key_width, count // 2) if merged else 0
                count -= merged
            return total
        total, count = 0, work.tokens
        while count > work.kept:
            total += matmul((count + 1) // 2, work.feature_width, count // 2)
            count -= min(count - work.kept, count // 2)
        return total

    @staticmethod
    def tower_merges(tokens: int, budget: int, layers: int, stages: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """Tokens each of the ``layers`` tower layers merges with ``location=tower`` (:func:`tower_schedule`;
        the recorded stages are not needed); none without a rerun (the budget keeps every token)."""
        return tuple(tower_schedule(tokens, budget, layers)) if budget < tokens else ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.location == "tower":  # the adapter runs the tower with the merge step between its layers
            self.requires = frozenset({"merging_tower"})  # type: ignore[misc]  # an instance's own (Selector.requires_on)

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        if self.location == "tower":
            states, sources = signals.merging_tower(TowerMerging(budget, self.proportional_attention))
            return self._selection(as_float32(states[1:]), sources[1:], vision_space=True)  # CLS dropped
        tokens = as_float32(signals.features)
        size = torch.ones(tokens.shape[0])
        sources = [torch.tensor([cell]) for cell in range(tokens.shape[0])]
        while tokens.shape[0] > budget:
            tokens, size, sources = merge_round(
                tokens, size, sources, min(tokens.shape[0] - budget, tokens.shape[0] // 2)
            )
        return self._selection(tokens, sources, vision_space=False)

    def _selection(self, tokens: Tensor, sources: list[Tensor], vision_space: bool) -> Selection:
        """The output tokens ((M, Dv) pre-projector from the tower, else (M, D)) in the chosen order."""
        if self.order == "raster":
            order = torch.argsort(torch.tensor([int(group.min()) for group in sources]))
            tokens, sources = tokens[order], [sources[i] for i in order.tolist()]
        singles = [int(group[0]) for group in sources if group.numel() == 1]
        kept = torch.sort(torch.tensor(singles, dtype=torch.long)).values
        if vision_space:
            return Selection(kept=kept, sources=sources, vision_tokens=tokens)
        return Selection(kept=kept, sources=sources, llm_tokens=tokens)


def tower_schedule(num_patches: int, budget: int, num_layers: int) -> list[int]:
    """Tokens each of ``num_layers`` tower layers merges so that ``num_patches`` patches end at ``budget``.

    As even as possible (the official constant ``r``, as a per-layer list: the remainder one token more in
    the first layers); where a layer cannot merge its share (at most half the patches, the CLS token
    protected), every layer merges as many as it can until the budget is reached.

    Raises:
        ValueError: the budget is below what halving in every layer reaches.
    """

    def realised(schedule: list[int]) -> list[int]:
        merged, patches = [], num_patches
        for r in schedule:
            merged.append(min(r, patches // 2))
            patches -= merged[-1]
        return merged

    share, extra = divmod(num_patches - budget, num_layers)
    schedule = realised([share + (layer < extra) for layer in range(num_layers)])
    if sum(schedule) < num_patches - budget:
        schedule = realised([num_patches] * num_layers)
        remaining = num_patches - budget
        schedule = [max(0, min(r, remaining - sum(schedule[:layer]))) for layer, r in enumerate(schedule)]
    if sum(schedule) < num_patches - budget:
        raise ValueError(
            f"ToMe in the vision tower halves the {num_patches} patches at most once per layer: {num_layers} layers "
            f"reach {num_patches - sum(schedule)} at the least; raise the budget or use location=projector"
        )
    return schedule


@dataclass
class TowerMerging:
    """The merge step the adapter's vision tower runs between attention and MLP of each layer (ToMe's block).

    Called with the layer index (0-based) of the ``num_layers`` run, the (1 + n, Dv) states after the
    attention residual (CLS first), their (1 + n, d) head-mean keys (the metric), sizes (1 + n,) and
    sources (CLS: none); returns them merged by :func:`merge_round` with the CLS token protected, the
    layer's share of :func:`tower_schedule`. ``proportional``: the tower adds ``log(size)`` to the
    attention logits of each key (the official ``prop_attn``).
    """

    budget: int
    proportional: bool
    schedule: list[int] = field(default_factory=list)

    @staticmethod
    def metric(cls_probs: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """(L, d) what the step compares, of the layer's (H, L, d) keys: their mean over heads (the official
        metric); the CLS row and values are not read."""
        return keys.mean(dim=0)

    def __call__(
        self, layer: int, num_layers: int, hidden: Tensor, metric: Tensor, size: Tensor, sources: list[Tensor]
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        if layer == 0:
            self.schedule = tower_schedule(hidden.shape[0] - 1, self.budget, num_layers)
        if self.schedule[layer] == 0:
            return hidden, size, sources
        merged, size, sources = merge_round(
            hidden.float().cpu(), size, sources, self.schedule[layer], metric.float(), class_token=True
        )
        return merged.to(hidden.device, hidden.dtype), size, sources


def merge_round(
    tokens: Tensor, size: Tensor, sources: list[Tensor], r: int, metric: Tensor | None = None, class_token: bool = False
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """One bipartite soft matching round merging ``r`` tokens (``r <= n // 2``, ``(n - 1) // 2`` with a class token).

    Args:
        tokens: (n, D) float32 current tokens.
        size: (n,) how many original tokens each stands for.
        sources: n ascending LongTensors, the grid cells each carries.
        r: tokens to merge away.
        metric: (n, d) what the similarity compares (None: the tokens themselves).
        class_token: token 0 never merges and the unmerged A tokens keep their order (the official
            ``class_token=True``: CLS stays first).

    Returns:
        ``(n - r, D)`` tokens, their sizes and sources, ordered ``[unmerged A, B]``.
    """
    unit = unit_rows(tokens if metric is None else metric)
    scores = unit[0::2] @ unit[1::2].T
    if class_token:
        scores[0] = float("-inf")
    best, partner = scores.max(dim=1)  # (|A|,) each A token's most similar B token
    ranked = ranked_indices(best, best.numel())  # most similar first; ties to the lower index
    merged, unmerged = ranked[:r], ranked[r:]
    if class_token:
        unmerged = torch.sort(unmerged).values
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
