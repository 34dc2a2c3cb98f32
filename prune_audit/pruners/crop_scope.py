"""Per-crop budgets (``budget_scope="crop"``): the official LLaVA-NeXT convention of the pruning ports.

VisionZip (dvlab-research/VisionZip ``visionzip/clip_encoder.py`` and ``llava_arch.py``, 3151f6d), CDPruner
(Theia-4869/CDPruner ``llava/model/llava_arch.py``, 9541616) and FasterVLM (Theia-4869/FasterVLM
``llava/model/llava_arch.py``, f5d5f12) run their selection on each crop of the anyres tiling (the base view
and every tile) separately, keeping the same count in every crop. Here the run's budget is the image's:
``crop_budgets`` splits it evenly over the crops, and each crop's selection runs on that crop's visual tokens
alone. One difference, documented in docs/fidelity.md: the official code selects among a tile's 576 patches,
padding included, and keeps its padding picks (it never unpads); here a tile's tokens are its unpadded ones,
and a crop with fewer tokens than its share keeps them all.
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
    kept = []
    for (tokens, grid), share in zip(crops, crop_budgets(budget, [int(tokens.numel()) for tokens, _ in crops])):
        if share == 0:
            continue
        chosen = selector.select(signals.subset(tokens, grid), share, generator)
        if chosen.sources is not None:
            raise ValueError("budget_scope=crop keeps plain tokens per crop; this selector merges tokens")
        kept.append(tokens[chosen.kept])
    return Selection(kept=torch.cat(kept).sort().values if kept else torch.zeros(0, dtype=torch.long))


__all__ = ["crop_budgets", "select_per_crop"]
