"""Deterministic synthetic clips of coloured shapes that move, appear and disappear, with exact per-frame masks.

The video counterpart of ``data.scenes`` (its classes, colours, background and noise): a clip holds 1-4 objects of
distinct classes on one static background (drawn once, as a fixed camera sees it), each moving along a straight
line from a start to an end centre over the clip, at constant speed, with a fixed orientation. An object is on
screen during an inclusive span of frames (``ClipObject.span``): the whole clip, or it enters after the first frame,
or it leaves before the last, or both; outside its span it is not drawn at all (it appears and vanishes, rather
than sliding in from the border, so that its every on-screen frame shows its whole shape unless occluded).

Masks are exact as in still scenes: a pixel belongs to a shape when its centre lies inside it, every frame is
painted from the same masks, and later objects occlude earlier ones, so ``ClipObject.masks[f]`` is precisely
the object's visible pixels in frame ``f``. Placement keeps any two objects' overlap in every frame they share
within ``MAX_OVERLAP`` of the smaller shape (as still scenes do), so occlusion stays partial. Per-pixel noise is
drawn afresh for every frame.

Everything is a pure function of ``(seed, index, split)`` (``clip_rng``): no global random state, and the clip
stream never shares a generator with the still-scene stream of the same ``(seed, index, split)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prune_audit.data.scenes import (
    MAX_OVERLAP,
    MIN_IMAGE_SIZE,
    MIN_VISIBLE_PIXELS,
    NOISE_STD,
    PLACEMENT_TRIES,
    RADIUS_RANGE,
    SPLITS,
    _background,
    _inside,
    _object_colour,
    _sample_categories,
)

CLIP_FRAMES = 8
"""Frames of a demo clip: four of Qwen2.5-VL's temporal steps (two frames each)."""
CLIP_FPS = 2.0
"""Frame rate of a demo clip; qwen-vl-utils samples 2 frames per second, so it reads every frame."""
CLIP_STREAM = 43  # the generator's last seed word: clip streams never equal the still scenes' (issue 43)
# how an object's span is drawn: the whole clip, entering late, leaving early, or both (a brief appearance)
SPAN_KINDS: tuple[str, ...] = ("whole", "enters", "leaves", "brief")
SPAN_WEIGHTS = np.array([0.4, 0.2, 0.2, 0.2])
STATIC_PROBABILITY = 0.25  # share of objects that stay put (start centre = end centre)


@dataclass(frozen=True)
class ClipObject:
    """One object of a clip.

    Attributes:
        category: class name (one of ``data.scenes.CATEGORIES``).
        masks: (F, H, W) bool, the object's visible pixels in each frame (all False outside its span).
        span: (first, last) inclusive frames the object is drawn in (it may be hidden behind later objects).
        start: (x, y) pixel centre in the span's first frame; ``end`` in its last.
    """

    category: str
    masks: np.ndarray
    span: tuple[int, int]
    start: tuple[float, float]
    end: tuple[float, float]

    @property
    def visible_frames(self) -> tuple[int, ...]:
        """The frames showing at least ``MIN_VISIBLE_PIXELS`` of the object (what questions call "visible")."""
        return tuple(int(f) for f in np.flatnonzero(self.masks.sum(axis=(1, 2)) >= MIN_VISIBLE_PIXELS))

    def shown(self, first: int, last: int) -> bool:
        """Whether any frame of the inclusive window ``[first, last]`` shows any pixel of the object."""
        return bool(self.masks[first : last + 1].any())


@dataclass(frozen=True)
class SceneClip:
    """A generated clip with its objects (bottom to top in drawing order).

    Attributes:
        frames: (F, H, W, 3) uint8 RGB frames.
        objects: the objects, classes distinct, each with its per-frame visible masks.
        fps: the clip's frame rate.
    """

    frames: np.ndarray
    objects: tuple[ClipObject, ...]
    fps: float = CLIP_FPS

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def categories(self) -> tuple[str, ...]:
        return tuple(obj.category for obj in self.objects)


def clip_rng(seed: int, index: int, split: str = "heldout") -> np.random.Generator:
    """The random generator of clip ``index`` in the stream ``(split, seed)``; train and held-out never meet."""
    if split not in SPLITS:
        raise ValueError(f"unknown clip split {split!r}; choose one of {', '.join(SPLITS)}")
    if seed < 0 or index < 0:
        raise ValueError(f"clip seed and index must be non-negative, got seed={seed}, index={index}")
    return np.random.default_rng([SPLITS[split], seed, index, CLIP_STREAM])


def generate_clip(
    seed: int, index: int, *, image_size: int = 96, frames: int = CLIP_FRAMES, split: str = "heldout"
) -> SceneClip:
    """Clip ``index`` of the stream ``(split, seed)``: ``frames`` frames of (image_size, image_size) pixels."""
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE} pixels, got {image_size}")
    if frames < 4:
        raise ValueError(f"a clip needs at least 4 frames (its beginning and end are quarters), got {frames}")
    rng = clip_rng(seed, index, split)
    placed: list[tuple[str, np.ndarray, tuple[int, int], tuple[float, float], tuple[float, float]]] = []
    for category in _sample_categories(rng):
        for _ in range(PLACEMENT_TRIES):
            shapes, span, start, end = _moving_shape(rng, category, image_size, frames)
            if all(_overlap_ok(shapes, other[1]) for other in placed):
                placed.append((category, shapes, span, start, end))
                break
    background = _background(rng, image_size)
    colours = [_object_colour(rng, category) for category, *_ in placed]
    objects = []
    for k, (category, shapes, span, start, end) in enumerate(placed):
        visible = shapes.copy()
        for later in placed[k + 1 :]:
            visible &= ~later[1]
        objects.append(ClipObject(category, visible, span, start, end))
    video = np.repeat(background[None], frames, axis=0)
    for obj, colour in zip(objects, colours, strict=True):
        video[obj.masks] = colour
    noisy = video + rng.normal(0.0, NOISE_STD, size=video.shape)
    return SceneClip(np.clip(np.rint(noisy), 0, 255).astype(np.uint8), tuple(objects))


def _moving_shape(
    rng: np.random.Generator, category: str, size: int, frames: int
) -> tuple[np.ndarray, tuple[int, int], tuple[float, float], tuple[float, float]]:
    """(F, size, size) bool full shape per frame (empty outside the span), the span, start and end centres."""
    radius = rng.uniform(*RADIUS_RANGE) * size
    start = rng.uniform(radius, size - radius, size=2)
    end = start if rng.random() < STATIC_PROBABILITY else rng.uniform(radius, size - radius, size=2)
    angle = rng.uniform(0.0, 2.0 * math.pi)
    span = _span(rng, frames)
    shapes = np.zeros((frames, size, size), dtype=bool)
    first, last = span
    for f in range(first, last + 1):
        progress = (f - first) / max(1, last - first)
        centre = start + progress * (end - start)
        shapes[f] = _shape_at(category, radius, angle, centre, size)
    return shapes, span, (float(start[0]), float(start[1])), (float(end[0]), float(end[1]))


def _span(rng: np.random.Generator, frames: int) -> tuple[int, int]:
    """The inclusive frames an object is drawn in; a late entry or early exit is at least a quarter away from
    the clip's edge, so that the beginning and the end of the clip (its first and last quarter) differ."""
    kind = SPAN_KINDS[int(rng.choice(len(SPAN_KINDS), p=SPAN_WEIGHTS))]
    quarter = frames // 4
    first = int(rng.integers(quarter, frames - quarter)) if kind in ("enters", "brief") else 0
    last = frames - 1
    if kind in ("leaves", "brief"):
        last = int(rng.integers(max(first, quarter), frames - quarter))
    return first, last


def _shape_at(category: str, radius: float, angle: float, centre: np.ndarray, size: int) -> np.ndarray:
    """(size, size) bool: pixels whose centre lies inside the shape of ``radius`` and ``angle`` at ``centre``."""
    coords = np.arange(size) + 0.5
    x, y = np.meshgrid(coords - centre[0], coords - centre[1])
    cos, sin = math.cos(angle), math.sin(angle)
    return _inside(category, (cos * x + sin * y) / radius, (-sin * x + cos * y) / radius)


def _overlap_ok(shapes: np.ndarray, other: np.ndarray) -> bool:
    """Whether two (F, H, W) shape stacks share at most ``MAX_OVERLAP`` of the smaller shape in every frame."""
    shared = np.logical_and(shapes, other).sum(axis=(1, 2))
    smaller = np.minimum(shapes.sum(axis=(1, 2)), other.sum(axis=(1, 2)))
    return bool(np.all(shared <= MAX_OVERLAP * smaller))


__all__ = ["CLIP_FRAMES", "CLIP_FPS", "ClipObject", "SceneClip", "clip_rng", "generate_clip"]
