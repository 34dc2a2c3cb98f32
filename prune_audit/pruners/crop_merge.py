"""Per-crop budgets for a merging selector (``budget_scope="crop"``): VisionZip's LLaVA-NeXT arrangement.

VisionZip's official LLaVA-NeXT code (dvlab-research/VisionZip 3151f6d, ``visionzip/clip_encoder.py``
``CLIPVisionTower_VisionZip.forward`` on every crop, ``visionzip/llava_arch.py``
``prepare_inputs_labels_for_multimodal_visionzip`` and ``restore_image_features_sorted``) selects the same
dominant and contextual counts in every crop of the anyres tiling, each crop with its own CLS attention, CLS
state and keys, then lays the language model's image input out as:

1. the base view's tokens as its tower pass returns them: CLS, the dominant patches in raster order, the
   contextual tokens in target order;
2. the tiles' dominant patches scattered back to the joined tile grid, read row-major (no unpadding, no
   ``image_newline``: the newline tensor is built and not used);
3. every tile's CLS token, tile order;
4. every tile's contextual tokens, tile-major, target order within a tile.

:func:`select_merging_per_crop` runs the selector on each crop's tokens at its even share of the image's budget
(:func:`~prune_audit.pruners.crop_scope.crop_budgets`) and joins the crops' outputs in that order; the first
crop plays the base view. Tile tokens are the unpadded ones here (the official code selects among a tile's
padded patches too and keeps those it picks), so a crop with no more tokens than its share keeps them all,
each as itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from prune_audit.pruners.base import InputSelector, Selection
from prune_audit.pruners.crop_scope import crop_budgets, kept_union, part_sizes, select_parts
from prune_audit.pruners.signals import InputSignals


def select_merging_per_crop(
    selector: InputSelector,
    signals: InputSignals,
    crops: Sequence[tuple[Tensor, tuple[int, int]]],
    budget: int,
    generator: torch.Generator | None = None,
) -> Selection:
    """``selector`` (one that merges tokens before the projector) on each crop alone, joined as VisionZip's
    LLaVA-NeXT code joins them (module docstring).

    Args:
        signals: the whole image's signals (N tokens), ``vision_features`` (N, Dv) among them: a crop that keeps
            all its tokens passes those on.
        crops: per crop, its (M_c,) ascending token indices and their (rows, cols) grid within the crop; the
            first is the base view; together every token once.
        budget: output tokens over the image (a crop's CLS and merged tokens count, as in VisionZip's budgets).

    Returns:
        ``kept``: every crop's plain tokens, ascending image indices; ``sources`` and (budget, Dv) float32
        ``vision_tokens`` in the joined order, sources as image indices (empty for a CLS token).

    Raises:
        ValueError: the selector merges after the projector (``llm_tokens``).
    """
    selected = select_parts(selector, signals, crops, crop_budgets(budget, part_sizes(crops)), generator)
    if any(chosen.llm_tokens is not None for _, _, chosen in selected):
        raise ValueError("budget_scope=crop joins tokens merged before the projector; this selector merges after it")
    base: list[tuple[Tensor, Tensor]] = []  # (sources, vision token) in the base view's own order
    plain: list[tuple[Tensor, Tensor]] = []
    unlocated: list[tuple[Tensor, Tensor]] = []
    merged: list[tuple[Tensor, Tensor]] = []
    for crop, tokens, chosen in selected:
        if chosen.sources is None:  # the crop kept all its tokens: each passes on as itself
            outputs = [(index.reshape(1), signals.vision_features[index]) for index in tokens[chosen.kept]]
        else:
            outputs = [(tokens[sources], token) for sources, token in zip(chosen.sources, chosen.vision_tokens)]
        if crop == 0:
            base += outputs
            continue
        own = set(tokens[chosen.kept].tolist())
        for sources, token in outputs:
            if sources.numel() == 0:
                unlocated.append((sources, token))
            elif sources.numel() == 1 and int(sources[0]) in own:
                plain.append((sources, token))
            else:  # a contextual token, also one whose target has no members
                merged.append((sources, token))
    plain.sort(key=lambda output: int(output[0][0]))  # the joined tile grid, row-major
    joined = base + plain + unlocated + merged
    return Selection(
        kept=kept_union(selected),
        sources=[sources for sources, _ in joined],
        vision_tokens=torch.stack([token.float() for _, token in joined]),
        in_output_order=True,
    )


__all__ = ["select_merging_per_crop"]
