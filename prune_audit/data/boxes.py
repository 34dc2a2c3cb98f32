"""Boxes of referring-expression grounding: their IoU, and each model family's box convention.

A grounding answer is a box in the frame its model family was trained on, written the way the family writes it;
scoring needs it in the original image's pixels. A :class:`BoxConvention` holds one family's three facts: the
prompt its official grounding evaluation asks, how its answer spells a box (``parse``), and the frame the numbers
are in (``to_image`` / ``from_image``, given the image's token geometry, which carries the original and the
processed sizes). The family adapters (``models/``) name their convention by ``BoxConvention.name`` (their
``grounding`` declaration); the grounding task reads it from here, so neither imports the other.

Conventions (each re-implemented from its reference, none copied):

- ``llava-1.5``: LLaVA-1.5's RefCOCO instruction data (``llava_v1_5_mix665k.json``, haotian-liu/LLaVA): "Please
  provide the bounding box coordinate of the region this sentence describes: <expression>." answered
  ``[x1, y1, x2, y2]`` in 0-1 (two decimals) relative to the image padded to a square (``expand2square``: the
  image pasted at ((S - W) // 2, (S - H) // 2) on an S = max(W, H) square; haotian-liu/LLaVA issue 606). Parsed
  as lmms-eval's ``refcoco_bbox_rec`` parses it (``utils_rec.parse_float_sequence_within``: the first four
  numbers within square brackets).
- ``qwen2.5-vl``: Qwen2.5-VL's grounding cookbook (QwenLM/Qwen2.5-VL ``cookbooks/spatial_understanding.ipynb``):
  "Locate <expression>, output its bbox coordinates using JSON format." answered ``{"bbox_2d": [x1, y1, x2,
  y2], ...}`` in absolute pixels of the resized input image (``smart_resize``, the geometry's processed size);
  a bare bracketed four-number list is taken when no ``bbox_2d`` is given.
- ``internvl``: InternVL's ``internvl_chat/eval/refcoco/evaluate_grounding.py`` (OpenGVLab/InternVL): "Please
  provide the bounding box coordinate of the region this sentence describes: <ref><expression></ref>"
  answered ``<ref>...</ref><box>[[x1, y1, x2, y2]]</box>`` on a 0-1000 grid of the original image; parsed by
  its pattern (the first ``[[a, b, c, d]]``, single brackets accepted, so the answer still parses when the
  tokenizer's special ``<box>`` tokens are skipped in decoding), divided by 1000 when the four numbers sum to
  4 or more (its rule), then scaled by the image's width and height.

IoU is lmms-eval's and InternVL's (``compute_iou``, ``torchvision.ops.box_iou``): continuous coordinates, no +1
pixel. A box with inverted corners (x2 < x1 or y2 < y1) or no area names no region, so its IoU is 0; the
references would give it a negative area instead.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from prune_audit.errors import PruneAuditError

Numbers = tuple[float, float, float, float]
"""Four numbers as a model wrote them, in its convention's frame."""

_NUMBER = r"\s*(-?\d+(?:\.\d+)?)\s*"
_BRACKETED = re.compile(r"\[" + ",".join([_NUMBER] * 4) + r"\]")
_BBOX_2D = re.compile(r'"bbox_2d"\s*:\s*\[' + ",".join([_NUMBER] * 4) + r"\]")
_INTERNVL = re.compile(r"\[*\[(.*?),(.*?),(.*?),(.*?)\]\]*")


@dataclass(frozen=True)
class Box:
    """An axis-aligned box in original image pixels, corners as given: (x1, y1) top left, (x2, y2) bottom right."""

    x1: float
    y1: float
    x2: float
    y2: float

    @classmethod
    def from_coco(cls, bbox: Any) -> Box:
        """A COCO annotation's ``bbox``, [x, y, width, height]."""
        x, y, width, height = (float(value) for value in bbox)
        return cls(x, y, x + width, y + height)

    @property
    def area(self) -> float:
        """Width x height; 0 for inverted corners (no region)."""
        return max(0.0, self.x2 - self.x1) * max(0.0, self.y2 - self.y1)

    def as_list(self) -> list[float]:
        return [self.x1, self.y1, self.x2, self.y2]


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes in the same frame; 0 when either has no area (inverted or flat) and for
    boxes that only touch."""
    if a.area <= 0 or b.area <= 0:
        return 0.0
    overlap = Box(max(a.x1, b.x1), max(a.y1, b.y1), min(a.x2, b.x2), min(a.y2, b.y2)).area
    return overlap / (a.area + b.area - overlap)


def _frame_sizes(geometry: Any) -> tuple[int, int]:
    """(width, height) of the original image a token geometry describes."""
    width, height = geometry.image_size
    return int(width), int(height)


class BoxConvention(ABC):
    """One model family's grounding convention: its prompt, how it writes a box, and the box's frame.

    Class attributes:
        name: the key a family adapter declares (``VisionLanguageModel.grounding``).
        families: the families that answer in it, in words (messages and docs).
        reference: the official evaluation or data it follows.
    """

    name: ClassVar[str]
    families: ClassVar[str]
    reference: ClassVar[str]

    @abstractmethod
    def prompt(self, expression: str) -> str:
        """The grounding question for a referring expression, as the family's official evaluation asks it."""

    @abstractmethod
    def parse(self, answer: str) -> Numbers | None:
        """The four numbers of the first box the answer writes; None when it writes none."""

    @abstractmethod
    def to_image(self, numbers: Numbers, geometry: Any) -> Box:
        """The box in the original image's pixels; ``geometry``: the image's token geometry under the model's
        processor (``image_size``; ``processed_width`` / ``processed_height`` where the frame is the input's)."""

    @abstractmethod
    def from_image(self, box: Box, geometry: Any) -> Numbers:
        """The inverse of ``to_image``: the numbers the family would write for ``box``."""


def _first_bracketed(answer: str) -> Numbers | None:
    match = _BRACKETED.search(answer)
    return None if match is None else tuple(float(v) for v in match.groups())  # type: ignore[return-value]


class LlavaSquare(BoxConvention):
    name = "llava-1.5"
    families = "LLaVA-1.5"
    reference = "LLaVA-1.5 llava_v1_5_mix665k RefCOCO data (padded square, 0-1); lmms-eval refcoco_bbox_rec parser"

    def prompt(self, expression: str) -> str:
        return f"Please provide the bounding box coordinate of the region this sentence describes: {expression}."

    def parse(self, answer: str) -> Numbers | None:
        return _first_bracketed(answer)

    @staticmethod
    def _square(geometry: Any) -> tuple[int, int, int]:
        """(side, pad_x, pad_y) of ``expand2square``."""
        width, height = _frame_sizes(geometry)
        side = max(width, height)
        return side, (side - width) // 2, (side - height) // 2

    def to_image(self, numbers: Numbers, geometry: Any) -> Box:
        side, pad_x, pad_y = self._square(geometry)
        x1, y1, x2, y2 = numbers
        return Box(x1 * side - pad_x, y1 * side - pad_y, x2 * side - pad_x, y2 * side - pad_y)

    def from_image(self, box: Box, geometry: Any) -> Numbers:
        side, pad_x, pad_y = self._square(geometry)
        return ((box.x1 + pad_x) / side, (box.y1 + pad_y) / side, (box.x2 + pad_x) / side, (box.y2 + pad_y) / side)


class QwenResized(BoxConvention):
    name = "qwen2.5-vl"
    families = "Qwen2.5-VL"
    reference = "QwenLM/Qwen2.5-VL cookbooks/spatial_understanding.ipynb (bbox_2d, absolute pixels of the input)"

    def prompt(self, expression: str) -> str:
        return f"Locate {expression}, output its bbox coordinates using JSON format."

    def parse(self, answer: str) -> Numbers | None:
        match = _BBOX_2D.search(answer)
        if match is not None:
            return tuple(float(v) for v in match.groups())  # type: ignore[return-value]
        return _first_bracketed(answer)

    @staticmethod
    def _scale(geometry: Any) -> tuple[float, float]:
        """Original pixels per input pixel, (x, y)."""
        width, height = _frame_sizes(geometry)
        return width / geometry.processed_width, height / geometry.processed_height

    def to_image(self, numbers: Numbers, geometry: Any) -> Box:
        sx, sy = self._scale(geometry)
        x1, y1, x2, y2 = numbers
        return Box(x1 * sx, y1 * sy, x2 * sx, y2 * sy)

    def from_image(self, box: Box, geometry: Any) -> Numbers:
        sx, sy = self._scale(geometry)
        return (box.x1 / sx, box.y1 / sy, box.x2 / sx, box.y2 / sy)


class InternThousand(BoxConvention):
    name = "internvl"
    families = "InternVL"
    reference = "OpenGVLab/InternVL internvl_chat/eval/refcoco/evaluate_grounding.py (0-1000 grid, its pattern)"

    def prompt(self, expression: str) -> str:
        return (
            f"Please provide the bounding box coordinate of the region this sentence describes: <ref>{expression}</ref>"
        )

    def parse(self, answer: str) -> Numbers | None:
        match = _INTERNVL.search(answer)
        if match is None:
            return None
        try:
            numbers = tuple(float(v) for v in match.groups())
        except ValueError:  # the reference's float() fails on these too: its (0, 0, 0, 0), no box
            return None
        return numbers if all(math.isfinite(v) for v in numbers) else None  # type: ignore[return-value]

    def to_image(self, numbers: Numbers, geometry: Any) -> Box:
        width, height = _frame_sizes(geometry)
        scale = 1000.0 if sum(numbers) >= 4 else 1.0  # the reference's rule: 0-1 boxes pass unscaled
        x1, y1, x2, y2 = (v / scale for v in numbers)
        return Box(x1 * width, y1 * height, x2 * width, y2 * height)

    def from_image(self, box: Box, geometry: Any) -> Numbers:
        width, height = _frame_sizes(geometry)
        return (box.x1 / width * 1000, box.y1 / height * 1000, box.x2 / width * 1000, box.y2 / height * 1000)


BOX_CONVENTIONS: dict[str, BoxConvention] = {
    convention.name: convention for convention in (LlavaSquare(), QwenResized(), InternThousand())
}
"""Every box convention by the name a family declares."""


def box_convention(name: str | None, model: str) -> BoxConvention:
    """The convention a family declares (``grounding``); one line naming the families that have one otherwise."""
    if name not in BOX_CONVENTIONS:
        offered = ", ".join(convention.families for convention in BOX_CONVENTIONS.values())
        raise PruneAuditError(
            f"{model} declares no box convention for grounding answers (boxes are asked and read as each family's "
            f"own evaluation does); run a checkpoint of a family that has one: {offered}"
        )
    return BOX_CONVENTIONS[name]  # type: ignore[index]


def format_box(box: Box) -> str:
    """``[x1, y1, x2, y2]`` in pixels, two decimals (a record's reference answer)."""
    return json.dumps([round(float(value), 2) for value in box.as_list()])


__all__ = ["BOX_CONVENTIONS", "Box", "BoxConvention", "Numbers", "box_convention", "box_iou", "format_box"]
