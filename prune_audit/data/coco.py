"""COCO instance annotations: image lookup, category names and per-category masks.

Masks are decoded with pycocotools exactly as ``COCO.annToRLE`` / ``annToMask`` do
(polygons and uncompressed RLE through ``frPyObjects``, parts merged; compressed RLE
as is). The mask of a queried object is the union of every instance of its category
in the image, crowd regions included (evaluation spec, section C).
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prune_audit.errors import PruneAuditError

_TRAILING_ID = re.compile(r"(\d+)\.[A-Za-z]+$")


def image_id_from_file_name(file_name: str) -> int | None:
    """COCO image id from a 2014 (``COCO_val2014_%012d.jpg``) or 2017 (``%012d.jpg``) file name."""
    match = _TRAILING_ID.search(Path(file_name).name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class CocoImage:
    """One ``images`` entry: id, file name and original size."""

    id: int
    file_name: str
    width: int
    height: int

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        return (self.width, self.height)


def decode_rle(rle: dict[str, Any]) -> np.ndarray:
    """(H, W) bool mask of one RLE, decoded by pycocotools."""
    from pycocotools import mask as mask_utils

    # pycocotools 2.0.11 trips numpy 2's __array__ copy-keyword deprecation inside decode;
    # the result is unaffected, so keep the warning out of users' output.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="__array__ implementation", category=DeprecationWarning)
        return mask_utils.decode(rle).astype(bool)


def read_json(path: str | Path) -> Any:
    """Parse a JSON document; a syntax error becomes one line naming the file, line and column."""
    path = Path(path)
    with path.open("r", encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as error:
            raise PruneAuditError(f"{path}:{error.lineno}:{error.colno}: invalid JSON ({error.msg})") from None


def _require(record: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        raise PruneAuditError(f"{where} lacks {', '.join(missing)}")


class CocoInstances:
    """An instances file (``instances_val2014.json``, ``instances_val2017.json``, or any COCO export).

    Args:
        data: the parsed JSON with ``images``, ``annotations`` and ``categories``.
        source: where it came from, used in error messages.
    """

    def __init__(self, data: dict[str, Any], source: str = "<instances>") -> None:
        self.source = source
        if not isinstance(data, dict):
            raise PruneAuditError(f"{source}: expected a JSON object with images, annotations and categories")
        _require(data, ("images", "annotations", "categories"), source)
        self.images: dict[int, CocoImage] = {}
        for index, entry in enumerate(data["images"]):
            _require(entry, ("id", "file_name", "width", "height"), f"{source}: images[{index}]")
            image = CocoImage(int(entry["id"]), str(entry["file_name"]), int(entry["width"]), int(entry["height"]))
            self.images[image.id] = image
        self.category_names: dict[int, str] = {}
        for index, entry in enumerate(data["categories"]):
            _require(entry, ("id", "name"), f"{source}: categories[{index}]")
            self.category_names[int(entry["id"])] = str(entry["name"])
        self.category_ids: dict[str, int] = {name: cat_id for cat_id, name in self.category_names.items()}
        self._ids_by_file_name = {image.file_name: image.id for image in self.images.values()}
        self.annotations_by_image: dict[int, list[dict[str, Any]]] = {image_id: [] for image_id in self.images}
        for index, ann in enumerate(data["annotations"]):
            where = f"{source}: annotation {ann.get('id', f'#{index}')}"
            _require(ann, ("image_id", "category_id", "segmentation"), where)
            if ann["image_id"] not in self.images:
                raise PruneAuditError(f"{where} refers to unknown image {ann['image_id']}")
            if ann["category_id"] not in self.category_names:
                raise PruneAuditError(f"{where} refers to unknown category {ann['category_id']}")
            self.annotations_by_image[ann["image_id"]].append(ann)

    @classmethod
    def load(cls, path: str | Path) -> CocoInstances:
        """Read an instances JSON file."""
        return cls(read_json(path), source=str(path))

    def image(self, image_id: int) -> CocoImage:
        if image_id not in self.images:
            raise PruneAuditError(f"image {image_id} is not in {self.source}")
        return self.images[image_id]

    def image_id(self, file_name: str) -> int:
        """Image id for a file name; other COCO namings of the same id resolve too.

        POPE names images ``COCO_val2014_%012d.jpg``; val2017 keeps the val2014 ids, so such
        a name also resolves in a 2017 file when the image is there.
        """
        name = Path(file_name).name
        if name in self._ids_by_file_name:
            return self._ids_by_file_name[name]
        image_id = image_id_from_file_name(name)
        if image_id is None or image_id not in self.images:
            raise PruneAuditError(f"image {file_name} is not in {self.source}")
        return image_id

    def category_id(self, name: str) -> int:
        if name not in self.category_ids:
            raise PruneAuditError(f"unknown COCO category {name!r} in {self.source}")
        return self.category_ids[name]

    def object_names(self, image_id: int) -> list[str]:
        """Distinct category names in the image, in order of first appearance in the annotations."""
        names = (self.category_names[ann["category_id"]] for ann in self.annotations_by_image[self.image(image_id).id])
        return list(dict.fromkeys(names))

    def has_instances(self, image_id: int, category_name: str) -> bool:
        category_id = self.category_id(category_name)
        return any(ann["category_id"] == category_id for ann in self.annotations_by_image[self.image(image_id).id])

    def annotation_rle(self, ann: dict[str, Any]) -> dict[str, Any]:
        """The annotation's mask as one RLE, as ``COCO.annToRLE`` builds it."""
        from pycocotools import mask as mask_utils

        image = self.image(ann["image_id"])
        segmentation = ann["segmentation"]
        where = f"{self.source}: annotation {ann.get('id', '?')}"
        if isinstance(segmentation, list):
            if not segmentation or any(len(polygon) < 6 or len(polygon) % 2 for polygon in segmentation):
                raise PruneAuditError(f"{where} has an empty or odd-length polygon")
            return mask_utils.merge(mask_utils.frPyObjects(segmentation, image.height, image.width))
        if not isinstance(segmentation, dict) or "counts" not in segmentation or "size" not in segmentation:
            raise PruneAuditError(f"{where} has a segmentation that is neither polygons nor RLE")
        if list(segmentation["size"]) != [image.height, image.width]:
            raise PruneAuditError(
                f"{where} has RLE size {segmentation['size']} but the image is {image.height}x{image.width}"
            )
        if isinstance(segmentation["counts"], list):
            return mask_utils.frPyObjects(segmentation, image.height, image.width)
        return segmentation

    def annotation_mask(self, ann: dict[str, Any]) -> np.ndarray:
        """(H, W) bool mask of one annotation."""
        return decode_rle(self.annotation_rle(ann))

    def category_mask(self, image_id: int, category_name: str) -> np.ndarray:
        """(H, W) bool union of every instance of the category in the image (crowd included).

        All False when the image has no instance of it; an unknown category name is an error.
        """
        from pycocotools import mask as mask_utils

        category_id = self.category_id(category_name)
        image = self.image(image_id)
        rles = [self.annotation_rle(ann) for ann in self.annotations_by_image[image.id] if ann["category_id"] == category_id]
        if not rles:
            return np.zeros((image.height, image.width), dtype=bool)
        return decode_rle(mask_utils.merge(rles, intersect=False))
