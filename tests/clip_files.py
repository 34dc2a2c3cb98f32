"""Tiny clip inputs shared by the clip CLI tests: a tiny random Qwen2.5-VL clip checkpoint, frame folders of a red
square sliding over a dark background, their object tracks (YouTube-VIS layout) and presence questions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils
from tiny_models import WORDS

W, H = 64, 48
CLIP_WORDS = [*WORDS, "beginning", "end", "video", "at", "A", "B", "C", "What", "moves"]


def square_mask(frame: int, first: int = 0, last: int = 2) -> np.ndarray:
    """(H, W) bool: a 20 x 20 square in frames ``first..last``, 8 px further right each frame; empty elsewhere."""
    mask = np.zeros((H, W), dtype=bool)
    if first <= frame <= last:
        left = 5 + 8 * (frame - first)
        mask[10:30, left : left + 20] = True
    return mask


def rle(mask: np.ndarray) -> dict | None:
    """The mask as a YouTube-VIS segmentation (compressed RLE); None where the object is absent."""
    if not mask.any():
        return None
    encoded = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"size": encoded["size"], "counts": encoded["counts"].decode()}


def tiny_clip_model(folder: Path, seed: int = 4, video_sampling: dict[str, int] | None = None) -> Path:
    """A tiny random Qwen2.5-VL whose vocabulary spells the clip questions; ``video_sampling``: the frame pixel
    limits it declares (``models.video_sampling``; None: qwen-vl-utils' defaults)."""
    from prune_audit.models.qwen import QwenModel
    from prune_audit.models.video_sampling import write_video_sampling

    model = QwenModel.build_tiny(folder, words=CLIP_WORDS, image_size=168, text_layers=2, seed=seed)
    if video_sampling is not None:
        write_video_sampling(model, video_sampling)
    return model


def write_clip(folder: Path, masks: list[np.ndarray]) -> None:
    """One PNG frame per mask in ``folder`` (named in frame order): the mask's pixels red on a dark background."""
    folder.mkdir(parents=True)
    for frame, mask in enumerate(masks):
        pixels = np.full((H, W, 3), 30, dtype=np.uint8)
        pixels[mask] = (220, 40, 40)
        Image.fromarray(pixels).save(folder / f"{frame:05d}.png")


def write_tracks(path: Path, clips: dict[str, list[np.ndarray]]) -> Path:
    """The tracks of ``clips`` (folder name -> per-frame masks of a cat), video ids 7, 8, ... in the given order,
    with a category (dog) no clip shows."""
    videos, annotations = [], []
    for index, (name, masks) in enumerate(clips.items()):
        files = [f"{name}/{frame:05d}.png" for frame in range(len(masks))]
        videos.append({"id": 7 + index, "file_names": files, "width": W, "height": H, "length": len(masks)})
        segmentations = [rle(mask) for mask in masks]
        annotations.append({"id": 1 + index, "video_id": 7 + index, "category_id": 3, "segmentations": segmentations})
    categories = [{"id": 3, "name": "cat"}, {"id": 4, "name": "dog"}]
    path.write_text(json.dumps({"videos": videos, "annotations": annotations, "categories": categories}))
    return path
