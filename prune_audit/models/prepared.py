"""What a family adapter hands the pruned prefill: a processed prompt and its vision-tower output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from prune_audit.errors import PruneAuditError

#: per question, ``(decoder layer, kept grid indices)`` of forced in-LLM stages
ForcedStages = Sequence[tuple[int, Sequence[int]]]


def find_image_span(input_ids: Tensor, image_token_id: int) -> tuple[int, int]:
    """``[start, end)`` of the single contiguous run of image tokens in (L,) ``input_ids``."""
    where = torch.nonzero(input_ids == image_token_id).flatten()
    if where.numel() == 0:
        raise PruneAuditError("the prompt holds no image tokens; check the prompt template")
    start, end = int(where[0]), int(where[-1]) + 1
    if end - start != where.numel():
        raise PruneAuditError("the image tokens are not one contiguous span; one image per prompt is supported")
    return start, end


@dataclass
class Prepared:
    """One (image, question) prompt, processed by the model's own processor.

    Attributes:
        input_ids: (L,) prompt ids with the image span expanded to N image tokens.
        image_span: ``[start, end)`` of the image tokens in ``input_ids``.
        grid: (rows, cols) of the visual token grid, N = rows * cols.
        pixel_values: the processor's pixel tensor for this image.
        question: the raw question (CLIP text relevance reads it).
        image_size: original (width, height).
        geometry: :class:`prune_audit.data.geometry.TokenGeometry` of the image.
        extras: family-specific tensors (Qwen: ``image_grid_thw``, ``positions``).
    """

    input_ids: Tensor
    image_span: tuple[int, int]
    grid: tuple[int, int]
    pixel_values: Tensor
    question: str
    image_size: tuple[int, int]
    geometry: Any
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_visual(self) -> int:
        return self.grid[0] * self.grid[1]



@dataclass
class VisionOutput:
    """One image through the vision tower: (N, D) projector outputs plus optional signals."""

    features: Tensor
    signals: dict[str, Tensor] = field(default_factory=dict)



__all__ = ["Prepared", "VisionOutput", "ForcedStages", "find_image_span"]
