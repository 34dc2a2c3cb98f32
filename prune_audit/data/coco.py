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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prune_audit.errors import PruneAuditError
from prune_audit.safety.inputs import loads_json, read_input

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


def read_json(path: str | Path, role: str = "JSON file", fix: str = "pass the JSON file itself") -> Any:
    """Parse a JSON document; a syntax or encoding error becomes one line naming the file and place.

    ``role`` and ``fix`` word the refusal of a path that is no readable regular file, is too large or
    nests too deep (``safety.inputs``).
    """
    path = Path(path)
    data = read_input(path, role, fix)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise PruneAuditError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x}); save the file as UTF-8"
        ) from None
    try:
        return loads_json(text, str(path))
    except json.JSONDecodeError as error:
        raise PruneAuditError(f"{path}:{error.lineno}:{error.colno}: invalid JSON ({error.msg})") from None


def _require_object(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise PruneAuditError(f"{where} is a JSON {type(entry).__name__}, not an object")
    return entry


def _integer(value: Any, where: str) -> int:
    """An id or size that must be an integer (JSON 3 or 3.0; not "3", 3.5, true)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise PruneAuditError(f"{where} must be an integer, got {value!r}")
    return int(value)


def _require(record: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        raise PruneAuditError(f"{where} lacks {', '.join(missing)}")


POLYGON_MARGIN = 1.0
"""Polygon coordinates may lie up to this many image sizes outside the image (COCO's own
polygons overshoot by a pixel or so); beyond that they are refused, before pycocotools,
which crashes the process on absurd coordinates."""


def check_segmentation(segmentation: Any, image: CocoImage, where: str) -> None:
    """Refuse a segmentation pycocotools would mis-handle: validated at load, before any output.

    Polygons: a non-empty list of even-length lists of >= 6 finite numbers within
    ``POLYGON_MARGIN`` image sizes of the image. RLE: ``size`` equal to the image's
    (height, width); uncompressed counts are non-negative integers summing to height x width.
    """
    if isinstance(segmentation, list):
        if not segmentation:
            raise PruneAuditError(f"{where} has an empty polygon list")
        for polygon in segmentation:
            _check_polygon(polygon, image, where)
        return
    if not isinstance(segmentation, dict) or "counts" not in segmentation or "size" not in segmentation:
        raise PruneAuditError(f"{where} has a segmentation that is neither polygons nor RLE")
    size = segmentation["size"]
    if not isinstance(size, list) or size != [image.height, image.width]:
        raise PruneAuditError(
            f"{where} has RLE size {size!r} but the image is {image.height}x{image.width} (height x width)"
        )
    counts = segmentation["counts"]
    if isinstance(counts, list):
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise PruneAuditError(f"{where} has RLE counts that are not non-negative integers")
        if sum(counts) != image.height * image.width:
            raise PruneAuditError(
                f"{where} has RLE counts summing to {sum(counts)}, not the image's {image.height * image.width} pixels"
            )
    elif not isinstance(counts, (str, bytes)):
        raise PruneAuditError(f"{where} has RLE counts that are neither a list nor a compressed string")


def _check_polygon(polygon: Any, image: CocoImage, where: str) -> None:
    if not isinstance(polygon, list) or len(polygon) < 6 or len(polygon) % 2:
        length = len(polygon) if isinstance(polygon, list) else type(polygon).__name__
        raise PruneAuditError(f"{where} has a polygon of {length} coordinates; need an even number, at least 6")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in polygon):
        raise PruneAuditError(f"{where} has a polygon with non-numeric coordinates")
    xy = np.asarray(polygon, dtype=float).reshape(-1, 2)
    if not np.isfinite(xy).all():
        raise PruneAuditError(f"{where} has a polygon with non-finite coordinates")
    limits = np.array([image.width, image.height], dtype=float)
    if (xy < -POLYGON_MARGIN * limits).any() or (xy > (1 + POLYGON_MARGIN) * limits).any():
        raise PruneAuditError(
            f"{where} has polygon coordinates far outside its {image.width}x{image.height} image "
            f"(beyond {POLYGON_MARGIN:g} image size); fix the annotation"
        )


def _image_entry(entry: Any, where: str) -> CocoImage:
    """One ``images`` entry, its id and positive size checked."""
    _require(_require_object(entry, where), ("id", "file_name", "width", "height"), where)
    width, height = _integer(entry["width"], f"{where}.width"), _integer(entry["height"], f"{where}.height")
    if width <= 0 or height <= 0:
        raise PruneAuditError(f"{where} has size {width}x{height}; width and height must be positive")
    file_name = entry["file_name"]
    if not isinstance(file_name, str) or not file_name.strip():
        raise PruneAuditError(f"{where}.file_name must be a file name, got {file_name!r}; fix the entry")
    return CocoImage(_integer(entry["id"], f"{where}.id"), file_name, width, height)


def _category_entry(entry: Any, where: str) -> tuple[int, str]:
    """(id, name) of one ``categories`` entry."""
    _require(_require_object(entry, where), ("id", "name"), where)
    return _integer(entry["id"], f"{where}.id"), str(entry["name"])


def check_unambiguous(images: Sequence[CocoImage], categories: Sequence[tuple[int, str]], source: str) -> None:
    """Refuse annotations in which a name does not pick one entry.

    An image id or file name listed twice splits an image's instances between entries (its
    masks vanish under one of them); a category id or name listed twice does the same to a
    category's instances. Files are matched by base name, as questions name them.
    """
    _refuse_repeats([image.id for image in images], source, "images", "id", "list each image once")
    _refuse_repeats(
        [Path(image.file_name).name for image in images],
        source,
        "images",
        "file_name",
        "list each image file under one id",
    )
    _refuse_repeats([cat_id for cat_id, _ in categories], source, "categories", "id", "give each category its own id")
    _refuse_repeats(
        [name for _, name in categories],
        source,
        "categories",
        "name",
        "give each category its own name (merge the duplicates)",
    )


def _refuse_repeats(values: Sequence[Any], source: str, section: str, key: str, fix: str) -> None:
    """One line naming the first two entries of ``section`` sharing a ``key`` value, if any."""
    first: dict[Any, int] = {}
    for index, value in enumerate(values):
        if value in first:
            raise PruneAuditError(
                f"{source}: {section}[{first[value]}] and {section}[{index}] have the same {key} {value!r}, "
                f"so masks would be split between them; {fix}"
            )
        first[value] = index


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
        for key in ("images", "annotations", "categories"):
            if not isinstance(data[key], list):
                raise PruneAuditError(f"{source}: {key} must be a JSON list, got {type(data[key]).__name__}")
        images = [_image_entry(entry, f"{source}: images[{index}]") for index, entry in enumerate(data["images"])]
        categories = [
            _category_entry(entry, f"{source}: categories[{index}]") for index, entry in enumerate(data["categories"])
        ]
        check_unambiguous(images, categories, source)
        self.images: dict[int, CocoImage] = {image.id: image for image in images}
        self.category_names: dict[int, str] = dict(categories)
        self.category_ids: dict[str, int] = {name: cat_id for cat_id, name in categories}
        self._ids_by_file_name = {Path(image.file_name).name: image.id for image in images}
        self.annotations_by_image: dict[int, list[dict[str, Any]]] = {image_id: [] for image_id in self.images}
        for index, ann in enumerate(data["annotations"]):
            _require_object(ann, f"{source}: annotations[{index}]")
            where = f"{source}: annotation {ann.get('id', f'#{index}')}"
            _require(ann, ("image_id", "category_id", "segmentation"), where)
            image_id = _integer(ann["image_id"], f"{where}: image_id")
            category_id = _integer(ann["category_id"], f"{where}: category_id")
            if image_id not in self.images:
                raise PruneAuditError(f"{where} refers to unknown image {image_id}")
            if category_id not in self.category_names:
                raise PruneAuditError(f"{where} refers to unknown category {category_id}")
            check_segmentation(ann["segmentation"], self.images[image_id], where)
            self.annotations_by_image[image_id].append({**ann, "image_id": image_id, "category_id": category_id})

    @classmethod
    def load(cls, path: str | Path) -> CocoInstances:
        """Read an instances JSON file."""
        return cls(
            read_json(path, "annotations file", "pass the COCO instances JSON with --annotations"), source=str(path)
        )

    def image(self, image_id: int) -> CocoImage:
        if image_id not in self.images:
            raise PruneAuditError(f"image {image_id} is not in {self.source}")
        return self.images[image_id]

    def check_image_size(self, image_id: int, size: tuple[int, int], path: str | Path) -> None:
        """Refuse the image file at ``path`` when its (width, height) ``size`` is not the annotated one.

        Masks are drawn at the annotated size; on another size they would not line up with the pixels.
        """
        width, height = self.image(image_id).size
        if tuple(size) != (width, height):
            raise PruneAuditError(
                f"image {path} is {size[0]}x{size[1]} pixels but {self.source} annotates it as {width}x{height} "
                f"(width x height), so its masks would not line up; pass the images and annotations that belong "
                f"together"
            )

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
        check_segmentation(segmentation, image, f"{self.source}: annotation {ann.get('id', '?')}")
        if isinstance(segmentation, list):
            return mask_utils.merge(mask_utils.frPyObjects(segmentation, image.height, image.width))
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
        rles = [
            self.annotation_rle(ann) for ann in self.annotations_by_image[image.id] if ann["category_id"] == category_id
        ]
        if not rles:
            return np.zeros((image.height, image.width), dtype=bool)
        return decode_rle(mask_utils.merge(rles, intersect=False))
