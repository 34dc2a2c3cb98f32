"""The inputs of a pruned prefill: processed prompts, their vision-tower outputs and the request's forced sets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from prune_audit.errors import PruneAuditError
from prune_audit.pruners.base import InputSelector, LayerSelector
from prune_audit.pruners.composed import ComposedSelector, RunSelector

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
        extras: family-specific tensors (Qwen: ``image_grid_thw``, ``positions``; a Qwen clip: ``video_grid_thw``,
            ``second_per_grid_ts`` on Qwen2.5-VL; ``visual_columns``: the (N,) prompt column of each visual token
            where the span holds text between them, LLaVA-NeXT's newlines and a Qwen3-VL clip's timestamps).
        dense_grid: on an image resized before the processor for an input selector acting on it
            (``VisionLanguageModel.prepare_for``), the (rows, cols) token grid of the image as given, whose tokens
            budgets resolve against and whose unpruned prefill is the dense cost (``grid``, ``geometry`` and ``pixel_values`` are the resized image's, ``image_size`` the
            original); None for an image as given.
        video_grid: on a video clip, its (T, h, w) token grid after the spatial merge (``grid`` is then (T * h, w),
            ``image_span`` the clip's tokens (from the first to the last: Qwen3-VL's timestamp text lies between steps), ``pixel_values`` its patches, ``image_size`` a frame's and
            ``geometry`` a :class:`prune_audit.data.video.ClipGeometry`); None for a still image.
    """

    input_ids: Tensor
    image_span: tuple[int, int]
    grid: tuple[int, int]
    pixel_values: Tensor
    question: str
    image_size: tuple[int, int]
    geometry: Any
    extras: dict[str, Tensor] = field(default_factory=dict)
    video_grid: tuple[int, int, int] | None = None
    dense_grid: tuple[int, int] | None = None

    @property
    def num_visual(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def budget_tokens(self) -> int:
        """The visual tokens a budget resolves against: the image's as given (``dense_grid``'s when resized)."""
        rows, cols = self.grid if self.dense_grid is None else self.dense_grid
        return rows * cols


class VisionOutput:
    """One image through the vision tower: (N, D) projector outputs plus optional signals (tensors, and the
    ``merging_tower`` function).

    ``features`` may be deferred, given as a function that runs the stock pass (the batch's, once) on first read: a
    selector that reruns the tower itself (``merging_tower``) reads nothing of the stock pass, which then runs only
    when the selector keeps every token (a budget of at least N) and the prompt needs the unpruned features.
    """

    def __init__(self, features: Tensor | Callable[[], Tensor], signals: dict[str, Any] | None = None):
        self._features = features
        self.signals = {} if signals is None else signals

    @property
    def features(self) -> Tensor:
        """(N, D) projector outputs of every visual token (a deferred stock pass runs here, once)."""
        if not isinstance(self._features, Tensor):
            self._features = self._features()
        return self._features

    @property
    def deferred(self) -> bool:
        """Whether the stock pass has not run (``features`` not read yet)."""
        return not isinstance(self._features, Tensor)


def check_resized(prepared: Sequence[Prepared], selector: str, budget: object) -> None:
    """One-line PruneAuditError unless every prompt's image was resized for the image-resizing ``selector``, or
    fits ``budget`` as given (a keep-all budget resizes nothing)."""
    fits = [isinstance(budget, int) and budget >= item.num_visual for item in prepared]
    if any(item.dense_grid is None and not fit for item, fit in zip(prepared, fits)):
        raise PruneAuditError(
            f"selector {selector!r} resizes the image before the processor; prepare the prompts with "
            f"prepare_for(image, question, selector, budget), not prepare"
        )


def check_request(
    num_questions: int,
    selector: RunSelector | None,
    budget: object,
    generator: torch.Generator | Sequence[torch.Generator] | None,
    forced_kept: Sequence[Sequence[int]] | None,
    forced_stages: Sequence[ForcedStages] | None,
) -> None:
    """One-line PruneAuditError when the options of a prefill request contradict each other or the batch."""
    if forced_kept is not None and forced_stages is not None:
        raise PruneAuditError("give forced_kept (input level) or forced_stages (in-LLM), not both")
    per_question = [("forced sets", forced_kept), ("forced sets", forced_stages)]
    if isinstance(generator, (list, tuple)):
        per_question.append(("generators", generator))
    for what, given in per_question:
        if given is not None and len(given) != num_questions:
            raise PruneAuditError(f"{len(given)} {what} for {num_questions} questions")
    if (forced_kept is not None or forced_stages is not None) and isinstance(selector, ComposedSelector):
        raise PruneAuditError(f"forced kept sets replace a selector; composed selector {selector.name!r} takes none")
    if forced_kept is not None and isinstance(selector, LayerSelector):
        raise PruneAuditError(f"forced_kept is input-level but selector {selector.name!r} prunes inside the LLM")
    if forced_stages is not None and isinstance(selector, InputSelector):
        raise PruneAuditError(f"forced_stages are in-LLM but selector {selector.name!r} is input-level")
    if selector is not None and budget is None and forced_kept is None and forced_stages is None:
        raise PruneAuditError(f"selector {selector.name!r} needs a budget (number of visual tokens)")


__all__ = ["Prepared", "VisionOutput", "ForcedStages", "find_image_span", "check_request", "check_resized"]
