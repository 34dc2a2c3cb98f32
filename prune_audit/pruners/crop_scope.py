"""Per-crop budgets (``budget_scope="crop"``): the official LLaVA-NeXT convention of the pruning ports; and
per-grid budgets for the selectors that lay tokens on one regular grid (uniform, pool, ToMe) on a several-grid
image.

VisionZip (dvlab-research/VisionZip ``visionzip/clip_encoder.py`` and ``llava_arch.py``, 3151f6d), CDPruner
(Theia-4869/CDPruner ``llava/model/llava_arch.py``, 9541616) and FasterVLM (Theia-4869/FasterVLM
``llava/model/llava_arch.py``, f5d5f12) run their selection on each crop of the anyres tiling (the base view
and every tile) separately, keeping the same count in every crop. Here the run's budget is the image's:
``crop_budgets`` splits it evenly over the crops, and each crop's selection runs on that crop's visual tokens
alone. One difference, documented in docs/fidelity.md: the official code selects among a tile's 576 patches,
padding included, and keeps its padding picks (it never unpads); here a tile's tokens are its unpadded ones,
and a crop with fewer tokens than its share keeps them all.

Per grid (``budget_scope="image"`` on LLaVA-NeXT / LLaVA-OneVision, a project choice, not an official
convention: no official multi-grid code exists for those selectors): ``grid_budgets`` splits the image's budget
over its regular grids (the base view's and the unpadded tile grid) in proportion to their token counts, and
the selector runs on each grid alone (:func:`select_per_grid`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from prune_audit.pruners.base import InputSelector, Selection
from prune_audit.pruners.signals import InputSignals


def crop_budgets(budget: int, sizes: Sequence[int]) -> list[int]:
    """Each crop's share of ``budget``: ``budget // K``, the first ``budget % K`` crops one more (crop order),
    capped at the crop's token count ``sizes[c]``; what a small crop cannot use is not moved to another."""
    share, extra = divmod(budget, len(sizes))
    return [min(size, share + (crop < extra)) for crop, size in enumerate(sizes)]


def select_per_crop(
    selector: InputSelector,
    signals: InputSignals,
    crops: Sequence[tuple[Tensor, tuple[int, int]]],
    budget: int,
    generator: torch.Generator | None = None,
) -> Selection:
    """``selector`` on each crop's tokens alone at its share of ``budget`` (:func:`crop_budgets`).

    Args:
        signals: the whole image's signals (N tokens).
        crops: per crop, its (M_c,) ascending token indices and their (rows, cols) grid within the crop
            (row-major, rows x cols = M_c); together every token once.
        budget: visual tokens to keep over the image.

    Returns:
        The union of the crops' kept tokens, ascending, as image indices.

    Raises:
        ValueError: ``selector`` merges tokens (a merged token's crop would be undefined).
    """
    chosen = select_parts(selector, signals, crops, crop_budgets(budget, part_sizes(crops)), generator)
    if any(selection.sources is not None for _, _, selection in chosen):
        raise ValueError(
            "budget_scope=crop keeps plain tokens per crop and this selector merges tokens; drop "
            "--option budget_scope=crop"
        )
    return Selection(kept=kept_union(chosen))


def part_sizes(parts: Sequence[tuple[Tensor, tuple[int, int]]]) -> list[int]:
    """The token count of each part (crop or grid)."""
    return [int(tokens.numel()) for tokens, _ in parts]


def select_parts(
    selector: InputSelector,
    signals: InputSignals,
    parts: Sequence[tuple[Tensor, tuple[int, int]]],
    shares: Sequence[int],
    generator: torch.Generator | None = None,
) -> list[tuple[int, Tensor, Selection]]:
    """``selector`` on each part's (crop's or grid's) tokens alone at its share; parts with no share are skipped.

    Returns:
        Per selected part: its index in ``parts``, its (M,) image token indices and the selection, whose indices
        (``kept``, ``sources``) are positions within the part.
    """
    return [
        (index, tokens, selector.select(signals.subset(tokens, grid), share, generator))
        for index, ((tokens, grid), share) in enumerate(zip(parts, shares))
        if share > 0
    ]


def kept_union(chosen: Sequence[tuple[int, Tensor, Selection]]) -> Tensor:
    """(k,) ascending image indices of every selected part's kept tokens (``select_parts``' output)."""
    if not chosen:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([tokens[selection.kept] for _, tokens, selection in chosen]).sort().values


def grid_budgets(budget: int, sizes: Sequence[int]) -> list[int]:
    """Each grid's share of ``budget`` in proportion to its token count ``sizes[g]`` (largest remainder: every
    grid gets ``floor(budget x size / total)``, the leftover tokens go one each to the largest fractional parts,
    ties to the earlier grid); the shares sum to ``min(budget, total)`` and none exceeds its grid."""
    total = sum(sizes)
    if budget >= total:
        return list(sizes)
    shares = [budget * size // total for size in sizes]
    remainders = [budget * size % total for size in sizes]
    for grid in sorted(range(len(sizes)), key=lambda g: (-remainders[g], g))[: budget - sum(shares)]:
        shares[grid] += 1
    return shares


def select_per_grid(
    selector: InputSelector,
    signals: InputSignals,
    grids: Sequence[tuple[Tensor, tuple[int, int]]],
    budget: int,
    generator: torch.Generator | None = None,
) -> Selection:
    """``selector`` on each regular grid's tokens alone at its proportional share of ``budget`` (:func:`grid_budgets`).

    A merging selector (pool, ToMe) merges within each grid only: its output tokens carry image indices of one
    grid; a grid it keeps whole (share at least its size) passes its tokens on as one-cell outputs in the same
    space (pre-projector ``vision_features`` beside pooled tokens, projected ``features`` beside ToMe's).

    Args:
        signals: the whole image's signals (N tokens).
        grids: per grid, its (M_g,) ascending token indices and its (rows, cols) (row-major, rows x cols = M_g);
            together every token once.
        budget: visual tokens to keep over the image.

    Returns:
        The union of the grids' kept tokens, ascending, as image indices; for a merging selector also the
        output tokens grid by grid in the selector's order, their sources as image indices.
    """
    chosen = select_parts(selector, signals, grids, grid_budgets(budget, part_sizes(grids)), generator)
    merging = [selection for _, _, selection in chosen if selection.sources is not None]
    kept = kept_union(chosen)
    if not merging:
        return Selection(kept=kept)
    vision_space = merging[0].vision_tokens is not None
    space = signals.vision_features if vision_space else signals.features
    sources, outputs = [], []
    for _, tokens, selection in chosen:
        if selection.sources is None:  # a grid kept whole: one-cell outputs
            sources += [tokens[i : i + 1] for i in selection.kept.tolist()]
            outputs.append(space[tokens[selection.kept]].float())
        else:
            sources += [tokens[group] for group in selection.sources]
            outputs.append(selection.vision_tokens if vision_space else selection.llm_tokens)
    tokens_out = torch.cat(outputs)
    if vision_space:
        return Selection(kept=kept, sources=sources, vision_tokens=tokens_out)
    return Selection(kept=kept, sources=sources, llm_tokens=tokens_out)


__all__ = [
    "crop_budgets",
    "grid_budgets",
    "kept_union",
    "part_sizes",
    "select_parts",
    "select_per_crop",
    "select_per_grid",
]
