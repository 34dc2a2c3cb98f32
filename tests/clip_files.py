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


CLIPS, FRAMES = 8, 4
CLIP_SET_SAMPLING = {"min_pixels": 112 * 84}
"""The clip set's 64 x 48 px frames read at 112 x 84 px: a 4 x 3 grid of merged tokens per temporal step (28 px
cells at scale 1.75), 2 steps, 24 tokens a clip."""


def clip_set_masks(clip: int) -> list[np.ndarray]:
    """The square in frames 0-1 of an even clip, 2-3 of an odd one."""
    first = 0 if clip % 2 == 0 else 2
    return [square_mask(frame, first, first + 1) for frame in range(FRAMES)]


def clip_set_questions() -> list[dict]:
    """Per clip: a cat at the beginning (frames 0-1) and at the end (frames 2-3); ids 2c + 1 and 2c + 2."""
    questions = []
    for clip in range(CLIPS):
        for where, window in (("beginning", [0, 1]), ("end", [2, 3])):
            present = (clip % 2 == 0) == (where == "beginning")
            questions.append(
                {"question_id": len(questions) + 1, "video": f"c{clip}.mp4", "window": window, "category": "cat",
                 "question": f"Is there a cat at the {where} of the video?", "answer": "yes" if present else "no"}
            )  # fmt: skip
    return questions


def write_clip_set(root: Path) -> dict[str, Path]:
    """Eight 4-frame clips c0..c7 under ``root/videos`` (:func:`clip_set_masks`), their tracks, the 16 presence
    questions and a tiny checkpoint declaring the frame size (``CLIP_SET_SAMPLING``)."""
    videos = root / "videos"
    for clip in range(CLIPS):
        write_clip(videos / f"c{clip}", clip_set_masks(clip))
    (root / "presence.json").write_text(json.dumps(clip_set_questions()))
    return {
        "model": tiny_clip_model(root / "qwen", seed=5, video_sampling=CLIP_SET_SAMPLING),
        "videos": videos,
        "tracks": write_tracks(root / "tracks.json", {f"c{clip}": clip_set_masks(clip) for clip in range(CLIPS)}),
        "presence": root / "presence.json",
    }
