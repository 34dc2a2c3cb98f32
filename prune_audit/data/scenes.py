"""Deterministic synthetic scenes of coloured shapes, with exact masks and a COCO export.

A scene holds 1-4 objects of distinct classes on a muted, textured, noisy background.
Each class has one fixed colour (the demo model's feasibility study found that a
from-scratch ViT does not learn shape-only classes within a CPU budget). Masks are
exact: a pixel belongs to an object when its centre lies inside the shape, and the
image is painted from the same masks, so the mask is precisely what the model sees.
Later objects occlude earlier ones; the stored masks are the visible parts.

Class frequencies follow a Zipf-like prior and 70 % of a scene's objects come from
one of three co-occurrence groups, so POPE's *popular* and *adversarial* negatives
really differ from *random* ones when questions are built from the exported file.

Everything is a pure function of ``(seed, index, split)``: no global random state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from prune_audit.data.scene_text import SceneText, paint_word, place_word

CATEGORIES: tuple[str, ...] = (
    "circle",
    "square",
    "triangle",
    "star",
    "cross",
    "ring",
    "diamond",
    "arrow",
    "crescent",
    "heart",
)

CATEGORY_COLOURS: dict[str, tuple[int, int, int]] = {
    "circle": (220, 40, 40),  # red
    "square": (40, 170, 60),  # green
    "triangle": (40, 80, 225),  # blue
    "star": (240, 215, 40),  # yellow
    "cross": (245, 135, 25),  # orange
    "ring": (140, 55, 190),  # purple
    "diamond": (248, 248, 248),  # white
    "arrow": (15, 15, 15),  # black
    "crescent": (40, 215, 225),  # cyan
    "heart": (245, 120, 185),  # pink
}

CATEGORY_COLOUR_NAMES: dict[str, str] = {
    "circle": "red",
    "square": "green",
    "triangle": "blue",
    "star": "yellow",
    "cross": "orange",
    "ring": "purple",
    "diamond": "white",
    "arrow": "black",
    "crescent": "cyan",
    "heart": "pink",
}
"""The colour of each class in words (referring expressions name it)."""

CO_OCCURRENCE_GROUPS: tuple[tuple[str, ...], ...] = (
    ("circle", "ring", "crescent"),
    ("square", "diamond", "cross"),
    ("triangle", "star", "arrow", "heart"),
)

# Zipf-like class prior (exponent 0.5 keeps the rarest class at a third of the most common).
CATEGORY_PRIOR: np.ndarray = 1.0 / np.sqrt(np.arange(1, len(CATEGORIES) + 1))

SPLITS: dict[str, int] = {"train": 0, "heldout": 1}

MAX_OBJECTS = 4
RADIUS_RANGE = (0.08, 0.16)  # object radius as a fraction of the image side
MAX_OVERLAP = 0.15  # largest share of either object's area two objects may share
MIN_VISIBLE_PIXELS = 12
# from 64 px on, the smallest unoccluded shape covers over 30 pixels, so the top object
# always survives and every scene holds at least one object
MIN_IMAGE_SIZE = 64
IN_GROUP_PROBABILITY = 0.7
PLACEMENT_TRIES = 30
NOISE_STD = 8.0
BACKGROUND_SATURATION = 0.2


@dataclass(frozen=True)
class SceneObject:
    """One object of a scene.

    Attributes:
        category: class name (one of ``CATEGORIES``).
        mask: (H, W) bool, the visible pixels of the object.
    """

    category: str
    mask: np.ndarray


@dataclass(frozen=True)
class Scene:
    """A generated image with its objects (bottom to top in drawing order).

    Attributes:
        image: (H, W, 3) uint8 RGB.
        objects: the objects, each with its visible mask; classes are distinct.
        texts: the words drawn in the scene (``data.scene_text``; none unless asked for), clear of every object.
    """

    image: np.ndarray
    objects: tuple[SceneObject, ...]
    texts: tuple[SceneText, ...] = ()

    @property
    def categories(self) -> tuple[str, ...]:
        return tuple(obj.category for obj in self.objects)


def scene_rng(seed: int, index: int, split: str = "heldout") -> np.random.Generator:
    """The random generator of scene ``index`` in the stream ``(split, seed)``.

    Train and held-out streams never share a scene, whatever the seeds.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown scene split {split!r}; choose one of {', '.join(SPLITS)}")
    if seed < 0 or index < 0:
        raise ValueError(f"scene seed and index must be non-negative, got seed={seed}, index={index}")
    return np.random.default_rng([SPLITS[split], seed, index])


def generate_scene(
    seed: int, index: int, *, image_size: int = 96, split: str = "heldout", words: bool = False
) -> Scene:
    """Scene ``index`` of the stream ``(split, seed)``, an (image_size, image_size) image; ``words``: also a word
    in a free spot (``data.scene_text``; the shapes are those of the scene without it, the pixels differ)."""
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE} pixels, got {image_size}")
    rng = scene_rng(seed, index, split)
    categories = _sample_categories(rng)
    masks = _place_objects(rng, categories, image_size)
    objects = tuple(
        SceneObject(category, mask)
        for category, mask in zip(categories, masks, strict=True)
        if mask is not None and mask.sum() >= MIN_VISIBLE_PIXELS
    )
    occupied = np.zeros((image_size, image_size), dtype=bool)
    for obj in objects:
        occupied |= obj.mask
    placed = place_word(rng, occupied, PLACEMENT_TRIES) if words else None
    texts = () if placed is None else (placed,)
    image = _background(rng, image_size)
    for obj in objects:
        image[obj.mask] = _object_colour(rng, obj.category)
    for text in texts:
        paint_word(image, text)
    noisy = image + rng.normal(0.0, NOISE_STD, size=image.shape)
    return Scene(image=np.clip(np.rint(noisy), 0, 255).astype(np.uint8), objects=objects, texts=texts)


def _sample_categories(rng: np.random.Generator) -> list[str]:
    """1-4 distinct classes; each is drawn from the scene's group with probability 0.7."""
    count = int(rng.integers(1, MAX_OBJECTS + 1))
    group = CO_OCCURRENCE_GROUPS[int(rng.integers(len(CO_OCCURRENCE_GROUPS)))]
    chosen: list[str] = []
    for _ in range(count):
        pool = [c for c in CATEGORIES if c not in chosen]
        in_group = [c for c in pool if c in group]
        if in_group and rng.random() < IN_GROUP_PROBABILITY:
            pool = in_group
        weights = np.array([CATEGORY_PRIOR[CATEGORIES.index(c)] for c in pool])
        chosen.append(pool[int(rng.choice(len(pool), p=weights / weights.sum()))])
    return chosen


def _place_objects(rng: np.random.Generator, categories: list[str], size: int) -> list[np.ndarray | None]:
    """Visible masks in drawing order; ``None`` for an object that found no free spot."""
    masks: list[np.ndarray | None] = []
    for category in categories:
        placed = None
        for _ in range(PLACEMENT_TRIES):
            candidate = _shape_mask(rng, category, size)
            if _overlap_ok(candidate, masks):
                placed = candidate
                break
        if placed is not None:
            for earlier in masks:
                if earlier is not None:
                    earlier &= ~placed
        masks.append(placed)
    return masks


def _overlap_ok(candidate: np.ndarray, masks: Iterable[np.ndarray | None]) -> bool:
    area = candidate.sum()
    for earlier in masks:
        if earlier is None:
            continue
        shared = np.logical_and(candidate, earlier).sum()
        if shared > MAX_OVERLAP * min(area, earlier.sum()):
            return False
    return True


def _shape_mask(rng: np.random.Generator, category: str, size: int) -> np.ndarray:
    """(size, size) bool: pixels whose centre lies inside a randomly placed, rotated shape."""
    radius = rng.uniform(*RADIUS_RANGE) * size
    cx, cy = rng.uniform(radius, size - radius, size=2)
    angle = rng.uniform(0.0, 2.0 * math.pi)
    coords = np.arange(size) + 0.5
    x, y = np.meshgrid(coords - cx, coords - cy)
    cos, sin = math.cos(angle), math.sin(angle)
    # rotate pixel centres into the shape's frame, radius 1
    u = (cos * x + sin * y) / radius
    v = (-sin * x + cos * y) / radius
    return _inside(category, u, v)


def _inside(category: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Membership of points (u, v) in the unit-radius shape of ``category``."""
    r2 = u * u + v * v
    if category == "circle":
        return r2 <= 1.0
    if category == "ring":
        return (r2 <= 1.0) & (r2 >= 0.55**2)
    if category == "crescent":
        return (r2 <= 1.0) & ((u - 0.45) ** 2 + v * v > 0.8**2)
    if category == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.75
    if category == "diamond":
        return np.abs(u) / 0.62 + np.abs(v) <= 1.0
    if category == "cross":
        arm, reach = 0.3, 0.95
        return ((np.abs(u) <= arm) & (np.abs(v) <= reach)) | ((np.abs(u) <= reach) & (np.abs(v) <= arm))
    if category == "heart":
        # the classic implicit heart (x^2 + y^2 - 1)^3 - x^2 y^3 <= 0, scaled to radius ~1
        hx, hy = u * 1.25, -v * 1.25 + 0.15
        return (hx * hx + hy * hy - 1.0) ** 3 - hx * hx * hy**3 <= 0.0
    return _inside_polygon(_POLYGONS[category], u, v)


def _star_polygon(points: int = 5, inner: float = 0.45) -> np.ndarray:
    angles = np.arange(2 * points) * math.pi / points - math.pi / 2
    radii = np.where(np.arange(2 * points) % 2 == 0, 1.0, inner)
    return np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)


_POLYGONS: dict[str, np.ndarray] = {
    "triangle": np.array([[0.0, -1.0], [0.866, 0.5], [-0.866, 0.5]]),
    "star": _star_polygon(),
    "arrow": np.array([[1.0, 0.0], [0.2, -0.75], [0.2, -0.28], [-1.0, -0.28], [-1.0, 0.28], [0.2, 0.28], [0.2, 0.75]]),
}


def _inside_polygon(vertices: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Even-odd rule for points (u, v) against a closed polygon of (K, 2) vertices."""
    inside = np.zeros(u.shape, dtype=bool)
    for (x0, y0), (x1, y1) in zip(vertices, np.roll(vertices, -1, axis=0), strict=True):
        crosses = (y0 > v) != (y1 > v)
        with np.errstate(divide="ignore", invalid="ignore"):
            x_at = x0 + (v - y0) * (x1 - x0) / (y1 - y0)
        inside ^= crosses & (u < x_at)
    return inside


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """(size, size, 3) float: a smooth desaturated colour field with faint stripes."""
    field = rng.uniform(70.0, 190.0, size=(4, 4, 3))
    smooth = np.asarray(
        Image.fromarray(field.astype(np.uint8)).resize((size, size), Image.Resampling.BICUBIC), dtype=np.float64
    )
    grey = smooth.mean(axis=2, keepdims=True)
    muted = grey + BACKGROUND_SATURATION * (smooth - grey)
    angle = rng.uniform(0.0, math.pi)
    period = rng.uniform(6.0, 20.0)
    coords = np.arange(size)
    x, y = np.meshgrid(coords, coords)
    stripes = rng.uniform(4.0, 12.0) * np.sin(2 * math.pi * (x * math.cos(angle) + y * math.sin(angle)) / period)
    return muted + stripes[..., None]


def _object_colour(rng: np.random.Generator, category: str) -> np.ndarray:
    """The class colour with a small brightness jitter, (3,) float."""
    return np.clip(np.array(CATEGORY_COLOURS[category], dtype=np.float64) * rng.uniform(0.88, 1.08), 0, 255)


def export_coco(
    out_dir: Path,
    *,
    seed: int,
    count: int,
    image_size: int = 96,
    split: str = "heldout",
) -> Path:
    """Write ``count`` scenes as PNG files and a COCO instances file; return its path.

    Layout: ``out_dir/images/scenes{seed}_{image_id:012d}.png`` and ``out_dir/instances.json``.
    Masks are compressed RLE (``iscrowd`` 0, one instance per class and image), with
    ``area`` and ``bbox`` computed by pycocotools, so ``COCO.annToMask`` gives back the
    generator's masks exactly. Image ids are ``index + 1``; category ids ``1..10``.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    out_dir = Path(out_dir)
    image_dir = out_dir / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for index in range(count):
        scene = generate_scene(seed, index, image_size=image_size, split=split)
        image_id = index + 1
        # the name ends in the image id, as COCO's do, so readers can parse it back
        file_name = f"scenes{seed}_{image_id:012d}.png"
        Image.fromarray(scene.image).save(image_dir / file_name)
        image, objects = export_coco_entries(scene, image_id, file_name, first_annotation_id=len(annotations) + 1)
        images.append(image)
        annotations += objects
    coco = {
        "info": {
            "description": "prune-audit synthetic scenes",
            "generator": "prune_audit.data.scenes",
            "seed": seed,
            "split": split,
            "image_size": image_size,
        },
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": coco_categories(),
    }
    path = out_dir / "instances.json"
    path.write_text(json.dumps(coco))
    return path


def coco_categories() -> list[dict]:
    """The COCO ``categories`` of the scenes' classes (ids ``1..10`` in ``CATEGORIES`` order)."""
    return [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(CATEGORIES)]


def export_coco_entries(scene: Scene, image_id: int, file_name: str, *, first_annotation_id: int) -> tuple[dict, list]:
    """(COCO image entry, annotations) of ``scene``: one annotation per object, ids ``first_annotation_id + j`` for
    the j-th object, its exact mask as compressed RLE with pycocotools' ``area`` and ``bbox``."""
    from pycocotools import mask as mask_utils

    size = scene.image.shape[0]
    annotations = []
    for j, obj in enumerate(scene.objects):
        rle = mask_utils.encode(np.asfortranarray(obj.mask.astype(np.uint8)))
        annotations.append(
            {
                "id": first_annotation_id + j,
                "image_id": image_id,
                "category_id": CATEGORIES.index(obj.category) + 1,
                "segmentation": {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")},
                "area": float(mask_utils.area(rle)),
                "bbox": [float(b) for b in mask_utils.toBbox(rle)],
                "iscrowd": 0,
            }
        )
    return {"id": image_id, "file_name": file_name, "width": size, "height": size}, annotations
