"""HiPrune: anchor, buffer and register tokens from the hierarchical attention of the vision encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32, rounded_to
from prune_audit.pruners.fidelity import HALF_EXACT_CASES, HALF_ONCE, QWEN_TOWER, Fidelity, half_exact, random_agreement
from prune_audit.pruners.layout import ONE_GRID
from prune_audit.pruners.options import Choice, Integer, Real, option
from prune_audit.pruners.ranking import TOP_K_TIES, top_k_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SCORE_DTYPES
from prune_audit.pruners.signals import InputSignals

#: encoder layers LLaVA-1.5 runs up to its feature layer (CLIP-L layers 1..23 of 24): the depth the
#: official layer numbers refer to; other towers scale them proportionally (:func:`scaled_vision_layer`)
REFERENCE_VISION_LAYERS = 23
#: blocks of Qwen2.5-VL's vision tower (3B and 7B), the depth HiPrune's Qwen layer numbers refer to
QWEN_REFERENCE_LAYERS = 32
NEIGHBOURS = ("official", "grid")


def scaled_vision_layer(layer: int, depth: int, reference: int = REFERENCE_VISION_LAYERS) -> int:
    """0-based row of a (depth, N) per-layer signal for the official 1-based ``layer`` of ``reference``
    (at least the first)."""
    return min(depth, max(1, round(layer * depth / reference))) - 1


def object_layer_row(signals: InputSignals, clip_layer: int, qwen_layer: int) -> int:
    """0-based row of ``signals.layer_attention`` holding the anchors' layer for the signals' tower:
    ``clip_layer`` of the 23 LLaVA-1.5 runs, or ``qwen_layer`` of Qwen2.5-VL's 32 blocks, scaled to its depth."""
    depth = signals.layer_attention.shape[0]
    if signals.vision_tower == "qwen2_5_vl":
        return scaled_vision_layer(qwen_layer, depth, QWEN_REFERENCE_LAYERS)
    return scaled_vision_layer(clip_layer, depth)


def buffer_cells(anchors: Tensor, grid: tuple[int, int], neighbours: str) -> Tensor:
    """(m,) ascending unique cells: the anchors and their four neighbours.

    ``"official"``: the flat offsets -1, +1, -cols, +cols clamped to ``[0, N)``, as the official
    code forms them (a left neighbour of a row's first cell is the previous row's last cell).
    ``"grid"``: only neighbours inside the grid (no wrap across rows, nothing clamped onto an edge).
    """
    rows, cols = grid
    if neighbours == "official":
        cells = torch.cat([anchors, anchors - 1, anchors + 1, anchors - cols, anchors + cols])
        return torch.unique(cells.clamp(0, rows * cols - 1))
    row, col = anchors // cols, anchors % cols
    parts = [anchors]
    for d_row, d_col in ((0, -1), (0, 1), (-1, 0), (1, 0)):
        inside = (row + d_row >= 0) & (row + d_row < rows) & (col + d_col >= 0) & (col + d_col < cols)
        parts.append(((row + d_row) * cols + col + d_col)[inside])
    return torch.unique(torch.cat(parts))


def register_cells(deep: Tensor, near: Tensor, count: int, ties: str, dtype: torch.dtype | None) -> Tensor:
    """(count,) ascending registers: the cells of largest ``deep`` attention (N,) outside ``near`` (m,).

    ``ties="topk"`` ranks as the official code does, ``torch.topk`` over every cell of the deep attention
    lowered by 1 on ``near`` (in ``dtype``, where the official subtraction rounds), so its order among exact
    ties is the kernel's over the full row; ``"lower"`` ranks only the other cells, ties to the lower index.
    """
    if ties == "topk":
        lowered = deep.clone()
        lowered[near] -= 1
        return top_k_indices(rounded_to(lowered, dtype), count, ties, dtype)
    rest = torch.ones(deep.numel(), dtype=torch.bool)
    rest[near] = False
    candidates = torch.nonzero(rest).flatten()
    return candidates[top_k_indices(deep[candidates], count)]


@register
@dataclass
class HiPruneSelector(InputSelector):
    """Anchors and their buffers from a middle vision layer, registers from the deep one (HiPrune).

    With ``T`` the budget and ``layer_attention`` (Lv, N) the attention each patch receives
    per encoder layer (mean over heads and all query rows, CLS column dropped):
    ``a = round(T * alpha / 5)`` anchors are the top of the object layer's attention; each
    brings its four neighbours (buffer tokens, :func:`buffer_cells`); the ``T - |anchors and
    buffers|`` registers are the top of the deep (feature) layer's attention among the rest.
    Kept: anchors, buffers and registers, ascending.

    Follows Danielement321/HiPrune ``LLaVA/llava/model/llava_arch.py::encode_images`` (commit
    6e83a124; ``bench_llava.sh``: ``HIPRUNE_ALPHA`` 0.1, ``HIPRUNE_OBJECT_LAYER`` 9): the object
    layer's attention is ``attentions[object_layer - 1]`` and the deep one ``attentions[-2]``,
    the layer producing CLIP's penultimate features. On a tower of another depth the object
    layer scales with the ``Lv`` layers run up to the feature layer (23 on LLaVA-1.5):
    ``round(object_layer * Lv / 23)``, at least 1 (:func:`scaled_vision_layer`).

    ``score_dtype="model"``: the per-layer attention rounded to the model dtype (the official
    ``mean(dim=1).mean(dim=1)`` of its half attention, exact when the adapter's signal is that
    half mean) and ranked in it; ``ties="topk"``: ``torch.topk`` there, the registers over the
    full row lowered by 1 on anchors and buffers (:func:`register_cells`), as the official code.

    Differences: ties go to the lower index by default (``torch.topk`` leaves them unspecified);
    the attention is formed in float32 by default (the official eager CLIP attention in fp16); the anchor count
    is capped at ``T // 5`` so anchors and buffers never exceed the budget (the official code
    fails there, only reachable with ``alpha`` near 1); the official registers are the top of the
    deep attention minus 1 on anchors and buffers, the same set whenever some probability is
    below 1. ``neighbours="grid"`` keeps buffers inside the grid instead of the official flat
    offsets.

    On Qwen2.5-VL, as ``Qwen2_5_VL/qwen2_5_vl_HiPrune.py`` (same commit; ``bench_qwen.sh``:
    ``HIPRUNE_OBJECT_LAYER`` 16, ``HIPRUNE_ALPHA`` 0.1): ``layer_attention`` has every vision block
    (``models.qwen``: each merged token's mean over its 4 patches, windows ignored as the official
    flash-attention path recomputes them), the anchors come from block ``qwen_object_layer`` of 32
    (scaled to the tower's depth; 16 is a full-attention block of the 32) and the registers from the
    last block, the merger's input; buffers are the flat offsets on the merged grid. There the
    official deep attention is a sum over query patches, so its "minus 1" can leave an anchor or
    buffer among the registers (fewer distinct tokens than the budget); here registers exclude them.

    Options:
        alpha: share of the budget given to anchors and their buffers (``a = round(T alpha / 5)``).
        object_layer: 1-based encoder layer of the anchors on the 23-layer reference, scaled.
        qwen_object_layer: the same on Qwen2.5-VL's 32-block reference (signals with ``vision_tower="qwen2_5_vl"``).
        neighbours: ``"official"`` flat offsets clamped, or ``"grid"`` 4-neighbours inside the grid.
        score_dtype: ``"float32"`` or ``"model"`` (the attention rounded to and ranked in the model dtype).
        ties: ``"lower"`` index or ``"topk"`` (``torch.topk``'s order, the official kept set).
    """

    name: ClassVar[str] = "hiprune"
    summary: ClassVar[str] = "anchors + neighbours from a middle vision layer, registers from the deep one (HiPrune)"
    layout_need: ClassVar[str] = ONE_GRID  # its neighbours and buffers lie on one grid
    #: its official LLaVA-NeXT code (Danielement321/HiPrune 6e83a12 ``LLaVA/llava/model/llava_arch.py``) builds one
    #: index mask per crop
    per_crop_grid: ClassVar[bool] = True
    requires: ClassVar[frozenset[str]] = frozenset({"layer_attention"})
    reference: ClassVar[Reference] = Reference(
        "HiPrune: Training-Free Visual Token Pruning via Hierarchical Attention in Vision Encoders (arXiv 2508.00553)",
        "Danielement321/HiPrune",
        "global attention (head and query mean) of CLIP layers 9 and 23; alpha 0.1",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "6e83a124",
        f"alpha 0.1, object layer 9 of 23 CLIP layers (scaled), flat offsets; {QWEN_TOWER}: block 16 of 32, the last",
        ("score_dtype=model", "ties=topk"),
        (
            "ties to the lower index and registers ranked outside anchors and buffers unless ties=topk (official: topk of the row minus 1 there, the same set without ties); attention in float32 unless score_dtype=model (official: fp16)",
            "anchors capped at budget // 5 so anchors and buffers fit (the official code fails there; alpha near 1)",
            "Qwen: the official sum over query patches can exceed 1, so its minus 1 can re-pick a cell (fewer distinct tokens); here never",
            "neighbours=grid keeps buffers inside the grid (the official +-1 wraps across rows)",
            "object layer round(9 Lv / 23) on a tower running Lv layers (Qwen: round(16 Lv / 32) of its Lv blocks)",
        ),
        random_agreement(
            30,
            "test_hiprune.py::test_hiprune_reproduces_the_official_anchors_buffers_and_registers",
            "23 x 576 attention, budgets 64/128/192; Qwen path: test_qwen_attention_signals.py 40 of 40 unrepeated",
        ),
        30,  # fmt: skip
        half_agreement=half_exact("the official half mean(1).mean(1)", HALF_ONCE + " (head and query)", 27, 11),
        half_cases=HALF_EXACT_CASES,
    )

    flops_exact: ClassVar[bool] = True  # no products of its own: it ranks the attention the model gives it

    alpha: float = option(0.1, Real(low=0.0, high=1.0), "share of the budget given to anchors and buffers")
    object_layer: int = option(
        9, Integer(low=1, high=REFERENCE_VISION_LAYERS), "1-based anchor layer of the 23 run on LLaVA-1.5 (scaled)"
    )
    qwen_object_layer: int = option(
        16, Integer(low=1, high=QWEN_REFERENCE_LAYERS), "1-based anchor block of Qwen2.5-VL's 32 (scaled)"
    )
    neighbours: str = option("official", Choice(NEIGHBOURS), "buffer cells: official flat offsets or grid neighbours")
    score_dtype: str = option("float32", Choice(SCORE_DTYPES), "float32, or the model dtype as the official code")
    ties: str = option("lower", Choice(TOP_K_TIES), "exact ties to the lower index, or torch.topk's order (official)")

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        half = self.ranking_dtype(signals.model_dtype)
        official = signals.model_layer_attention if half is not None else None  # the half model's own, if passed
        attention = rounded_to(as_float32(signals.layer_attention if official is None else official), half)  # (Lv, N)
        shallow = attention[object_layer_row(signals, self.object_layer, self.qwen_object_layer)]
        anchor_count = min(round(budget * self.alpha / 5), budget // 5)
        anchors = top_k_indices(shallow, anchor_count, self.ties, half)
        near = buffer_cells(anchors, signals.grid, self.neighbours)
        registers = register_cells(attention[-1], near, budget - near.numel(), self.ties, half)
        return Selection(kept=torch.sort(torch.cat([near, registers])).values)
