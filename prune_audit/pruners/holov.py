"""HoloV: the budget allotted over crops of the token sequence by their CLS attention, top CLS attention in each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.flop_convention import matmul
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Integer, Real, option
from prune_audit.pruners.ranking import TOP_K_TIES, ranked_indices, top_k_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals

#: the official constants: attention scale, and the epsilon of the unit rows, the variance scaling and the weights
ATTENTION_SCALE = 1e3
EPSILON = 1e-6
#: what becomes of the budget a crop cannot spend (its share exceeds its tokens)
LEFTOVERS = ("drop", "refill")


def crop_bounds(tokens: int, crops: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each non-empty crop: ``crops`` contiguous runs of the raster order, the first
    ``tokens % crops`` one token longer (the official ``HoloV`` partition; empty runs are left out)."""
    size, longer = divmod(tokens, crops)
    bounds, start = [], 0
    for crop in range(crops):
        end = start + size + (crop < longer)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


def crop_score(features: Tensor, attention: Tensor, variance_weight: float) -> Tensor:
    """() score of one crop: the mean over its m tokens of ``1e3 a_i + w v_i s``.

    ``a_i`` is the token's CLS attention, ``v_i`` the spread of its cosine similarities to the crop:
    with ``c_ij`` the cosine of ``x_i / (||x_i|| + 1e-6)`` rows for ``j != i`` and ``c_ii = 0``,
    ``mu_i = sum_j c_ij / (m - 1)`` and ``v_i = sum_j (c_ij - mu_i)^2 / (m - 1)`` (the zeroed diagonal
    counts as a term, as the official code sums it); ``s = mean|1e3 a| / (mean|v| + 1e-6)`` scales the
    spread to the attention's size. A crop of one token scores its raw attention (official special case).

    Args:
        features: (m, D) float32 projector outputs of the crop.
        attention: (m,) float32 head-mean CLS attention of the crop.
    """
    count = features.shape[0]
    if count <= 1:
        return attention.mean()
    unit = features / (features.norm(dim=1, keepdim=True) + EPSILON)
    cosine = unit @ unit.T  # (m, m)
    cosine.fill_diagonal_(0.0)
    mean = cosine.sum(dim=1) / (count - 1)
    spread = ((cosine - mean[:, None]) ** 2).sum(dim=1) / (count - 1)
    scaled = attention * ATTENTION_SCALE
    spread = spread * (scaled.abs().mean() / (spread.abs().mean() + EPSILON))
    return (scaled + variance_weight * spread).mean()


def allot(scores: Tensor, budget: int, ties: str) -> Tensor:
    """(P,) tokens per crop: ``floor(budget w_p)`` with ``w = scores / (sum + 1e-6)``, the tokens the floors
    leave one each to the crops of largest weight (``ties="topk"``: ``torch.topk``'s order among equal
    weights, else the lower crop)."""
    weights = scores / (scores.sum() + EPSILON)
    shares = torch.floor(weights * budget).long()
    remaining = min(budget - int(shares.sum()), weights.numel())
    if remaining > 0:
        best = torch.topk(weights, remaining).indices if ties == "topk" else ranked_indices(weights, remaining)
        shares[best] += 1
    return shares


@register
@dataclass
class HoloVSelector(InputSelector):
    """Holistic allocation of the budget over crops of the image (HoloV).

    The N tokens in raster order are cut into ``crops`` contiguous runs (576 / 16: 36 tokens, a row and a
    half of the 24 x 24 grid), each scored by :func:`crop_score` from the projector outputs ``features``
    (N, D) and the head-mean CLS attention (``cls_attention``, (H, N)); :func:`allot` splits the budget
    over the crops in proportion to their scores, and each crop keeps its tokens of highest CLS attention
    (a crop whose share reaches its size keeps all of them). Follows obananas/HoloV ``utils.py::HoloV``
    (LLaVA-1.5 in ``llava/model/llava_arch.py``: 16 crops, attention ``attentions[-2][:, :, 0, 1:]`` head
    mean, the projector's outputs); the paper (arXiv 2510.02912) speaks of spatial crops without defining
    them, so the code's runs are followed.

    Returns ``Selection(kept=(k,) ascending)``; k may fall short of the budget: a crop's share above its
    size is lost (``leftover="drop"``, the official kept set: the official code feeds zero vectors in those
    places, which are not fed here), or ``leftover="refill"`` gives it to the unkept tokens of highest CLS
    attention (a project choice that spends the whole budget).

    Options:
        crops: number of runs (16, official).
        variance_weight: weight of the similarity spread (0.09, official).
        leftover: ``"drop"`` (official set) or ``"refill"``.
        ties: ``"lower"`` (exact ties to the lower index) or ``"topk"`` (``torch.topk``'s order, official).

    Deviations: kept tokens are passed in raster order (the official code orders them crop by crop,
    each crop's by descending attention); float32 throughout (the official code scores fp16 features).
    """

    name: ClassVar[str] = "holov"
    summary: ClassVar[str] = (
        "budget allotted over crops of the image by CLS attention, top CLS attention in each (HoloV)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"cls_attention", "features"})
    fills_budget: ClassVar[bool] = False  # a crop's share beyond its tokens is lost, as in the official code
    reference: ClassVar[Reference] = Reference(
        'Don\'t Just Chase "Highlighted Tokens" in MLLMs: Revisiting Visual Holistic Context Retention '
        "(HoloV, NeurIPS 2025, arXiv 2510.02912)",
        "obananas/HoloV",
        "16 contiguous crops of the raster order, CLIP layer -2 CLS attention head mean, projector outputs",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "ddcc937e",
        "16 crops, shares by 1e3 x attention + 0.09 x scaled similarity spread, top CLS attention per crop, "
        "a share above a crop's size lost, float32",
        ("ties=topk",),
        (
            "the official code pads the output with zero vectors where a crop's share exceeds its size; here "
            "those tokens are not fed (leftover=drop, the official kept set) or spent on the unkept tokens of "
            "highest CLS attention (leftover=refill, a project choice)",
            "kept tokens in raster order (official: crop by crop, each by descending attention)",
            "float32 (the official code scores the fp16 projector outputs)",
            "exact ties to the lower index (torch.topk leaves them unspecified; ties=topk uses it)",
            "llava/model/utils.py (commit 07c159b8) writes the same formula with the spread weight 0.09 and "
            "attention weight 1; utils.py (ddcc937e) as alpha=1, beta=0.09, power=1",
        ),
        random_agreement(
            30,
            "tests/pruners/test_holov.py::test_holov_reproduces_the_official_kept_set",
            "576 tokens, 4096-dim features, 16-head CLS attention with two artifact patches, budgets 64/128/192, "
            "seeds 0-9, ties=lower and ties=topk; in 9 of the 30 (budget 192) a crop's share exceeds its 36 tokens "
            "and the kept set is short of the budget, as the official one",
        ),
        30,
    )

    flops_exact: ClassVar[bool] = True

    crops: int = option(16, Integer(low=1), "contiguous runs of the raster order the budget is allotted over")
    variance_weight: float = option(0.09, Real(low=0.0), "weight of the similarity spread in a crop's score")
    leftover: str = option("drop", Choice(LEFTOVERS), "a crop's share above its size: drop (official) or refill")
    ties: str = option("lower", Choice(TOP_K_TIES), "exact ties to the lower index, or torch.topk's order (official)")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Each crop's (m x D) @ (D x m) cosine matrix of the projector outputs (crops of more than one token)."""
        if work.kept >= work.tokens:
            return 0
        crops = cls(**work.options).crops
        return sum(
            matmul(end - start, work.feature_width, end - start)
            for start, end in crop_bounds(work.tokens, crops)
            if end - start > 1
        )

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        features = as_float32(signals.features)
        attention = as_float32(signals.cls_attention).mean(dim=0)  # (N,)
        bounds = crop_bounds(signals.num_tokens, self.crops)
        scores = torch.stack([crop_score(features[a:b], attention[a:b], self.variance_weight) for a, b in bounds])
        shares = allot(scores, budget, self.ties)
        picks = [
            start + top_k_indices(attention[start:end], min(int(share), end - start), self.ties)
            for (start, end), share in zip(bounds, shares.tolist(), strict=True)
            if share > 0
        ]
        kept = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long)
        if self.leftover == "refill" and kept.numel() < budget:
            rest = attention.clone()
            rest[kept] = float("-inf")
            kept = torch.cat([kept, top_k_indices(rest, budget - kept.numel(), self.ties)])
        return Selection(kept=torch.sort(kept).values)
