"""Evidence regions from a COCO instances file: the union mask of one category in an image.

POPE's evidence is the queried object's mask; the caption task's, each annotated object's.
The masks are decoded once per (image, category, geometry) by ``data.retention.ObjectAreaCache``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from prune_audit.data.coco import CocoInstances
from prune_audit.data.retention import ObjectArea, ObjectAreaCache

if TYPE_CHECKING:
    from prune_audit.data.geometry import TokenGeometry


class CocoEvidence:
    """A COCO instances file as evidence regions, each a category's union mask in an image."""

    def __init__(self, coco: CocoInstances) -> None:
        self.coco = coco
        self._areas = ObjectAreaCache(coco)

    def image_id(self, image: str) -> int:
        return self.coco.image_id(image)

    def check_image_size(self, image: str, size: tuple[int, int], path: Path) -> None:
        self.coco.check_image_size(self.image_id(image), size, path)

    def category_area(self, image_id: int, category: str, geometry: TokenGeometry) -> ObjectArea:
        """The union mask of ``category`` in the image, under ``geometry``."""
        return self._areas.get(image_id, category, geometry)

    def record_mask(self, record: dict[str, Any]) -> np.ndarray | None:
        """(height, width) bool: the union of the masks of the record's ``evidence_objects`` (POPE: the queried
        object of a yes question; captions: every annotated object); None when it names none."""
        names = record["evidence_objects"]
        if not names:
            return None
        return np.logical_or.reduce([self.coco.category_mask(record["image_id"], name) for name in names])


__all__ = ["CocoEvidence"]
