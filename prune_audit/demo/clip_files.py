"""The video demo's clip files: frame folders, temporal presence and MVBench-layout questions, YouTube-VIS tracks.

Built from held-out clips of ``data.scene_clips`` (seed ``DEMO_CLIP_SEED``, a stream the video demo never trained
or monitored on), regenerated exactly, and written once into the cache (``demo_clip_files``):

* ``videos/{name}/frame_0000.png ...``: one folder per clip, its frames as PNG (lossless: masks stay exact),
  ``name`` = ``clips{seed}_{video_id:06d}``; ``data.video.sample_clip`` reads a folder at the entry's ``fps``
  (with ``demo.clip_train.demo_clip_sampling`` every frame at its own size, as the video demo trained).
* ``demo_video_presence.json`` (``video_presence``): a list of ``{"question_id", "video", "question", "answer",
  "category", "window", "fps"}``, up to ``PRESENCE_PER_CLIP`` distinct balanced questions per clip (``demo.clip_questions``),
  ``window`` the inclusive ``[first, last]`` frames asked about, null for "in the video"; question id
  ``video_id * 10 + k``.
* ``demo_mvbench.json`` (``video_mc``): MVBench's layout, a list of ``{"video", "question", "candidates",
  "answer", "fps"}``, the answer a candidate's text; one question per clip that answers a choice form
  unambiguously (others have none).
* ``demo_ytvis_instances.json``: the clips' object tracks in YouTube-VIS's layout: ``videos`` (``id``,
  ``file_names`` relative to ``videos/``, ``width``, ``height``, ``length``), ``annotations`` (``id`` =
  ``video_id * 10 + j`` for the j-th object, ``video_id``, ``category_id``, ``segmentations``: per frame the
  visible mask as COCO compressed RLE (pycocotools), or null where no pixel of the object shows; ``areas`` and
  ``bboxes`` likewise), ``categories`` (the still scenes' COCO categories, ids 1-10).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from prune_audit.data.scene_clips import CLIP_FRAMES, CLIP_STREAM, SceneClip, generate_clip
from prune_audit.data.scenes import CATEGORIES, coco_categories
from prune_audit.demo.clip_questions import ClipQuestion, choice_questions, presence_questions

DEMO_CLIP_SEED = 11  # the monitor's clips use seed 7 (demo.train.MONITOR_SEED), training clips the train split
DEMO_CLIPS = 200
DEMO_CLIP_SIZE = 96  # the video demo's frame size
CLIP_FILES_VERSION = 1  # part of the cache folder's name: a change of the files' contents gets a new folder
PRESENCE_PER_CLIP = 6


@dataclass(frozen=True)
class DemoClipFiles:
    """Paths of the demo's clip files (``root``)."""

    root: Path

    @property
    def videos(self) -> Path:
        """The folder holding one frame folder per clip."""
        return self.root / "videos"

    @property
    def presence(self) -> Path:
        return self.root / "demo_video_presence.json"

    @property
    def mvbench(self) -> Path:
        return self.root / "demo_mvbench.json"

    @property
    def tracks(self) -> Path:
        return self.root / "demo_ytvis_instances.json"

    def questions(self, task: str) -> tuple[Path, ...]:
        """The question files of the clip task ``task`` (``--questions``)."""
        return (self.presence,) if task == "video_presence" else (self.mvbench,)

    def evidence(self, task: str) -> Path | None:
        """The tracks file of ``task`` (``--annotations``): the presence task's; multiple choice names no regions."""
        return self.tracks if task == "video_presence" else None


def clip_name(seed: int, video_id: int) -> str:
    """The frame folder of clip ``video_id`` (``index + 1``) of the held-out stream ``seed``."""
    return f"clips{seed}_{video_id:06d}"


def frame_name(frame: int) -> str:
    return f"frame_{frame:04d}.png"


def distinct_presence(rng: np.random.Generator, clip: SceneClip, count: int) -> list[ClipQuestion]:
    """Up to ``count`` distinct presence questions about ``clip``, as many yes as no (from a draw of four times as
    many: a clip of one shape has few distinct yes-questions)."""
    drawn = list(dict.fromkeys(presence_questions(rng, clip, 4 * count)))
    yes = [q for q in drawn if q.answer == "yes"]
    no = [q for q in drawn if q.answer == "no"]
    half = min(count // 2, len(yes), len(no))
    return yes[:half] + no[:half]


def presence_entry(question: ClipQuestion, question_id: int, video: str, fps: float) -> dict:
    """One ``video_presence`` entry (module docstring)."""
    window = None if question.window is None else list(question.window)
    return {
        "question_id": question_id,
        "video": video,
        "question": question.question,
        "answer": question.answer,
        "category": question.category,
        "window": window,
        "fps": fps,
    }


def mvbench_entry(question: ClipQuestion, video: str, fps: float) -> dict:
    """One MVBench-layout entry: the answer is the candidate's text."""
    return {
        "video": video,
        "question": question.question,
        "candidates": list(question.candidates),
        "answer": question.answer,
        "fps": fps,
    }


def track_entries(clip: SceneClip, video_id: int, video: str) -> tuple[dict, list[dict]]:
    """(YouTube-VIS video entry, its annotations): per object its per-frame visible mask as compressed RLE."""
    from pycocotools import mask as mask_utils

    frames, height, width = clip.frames.shape[:3]
    annotations = []
    for j, obj in enumerate(clip.objects):
        segmentations: list[dict | None] = []
        areas: list[float | None] = []
        boxes: list[list[float] | None] = []
        for mask in obj.masks:
            if not mask.any():
                segmentations.append(None)
                areas.append(None)
                boxes.append(None)
                continue
            rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
            segmentations.append({"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")})
            areas.append(float(mask_utils.area(rle)))
            boxes.append([float(b) for b in mask_utils.toBbox(rle)])
        annotations.append(
            {
                "id": video_id * 10 + j,
                "video_id": video_id,
                "category_id": CATEGORIES.index(obj.category) + 1,
                "segmentations": segmentations,
                "areas": areas,
                "bboxes": boxes,
                "iscrowd": 0,
            }
        )
    names = [f"{video}/{frame_name(f)}" for f in range(frames)]
    return {"id": video_id, "file_names": names, "width": width, "height": height, "length": frames}, annotations


def write_clip_files(
    out_dir: Path, *, seed: int, clips: int, image_size: int = DEMO_CLIP_SIZE, frames: int = CLIP_FRAMES
) -> DemoClipFiles:
    """Write the first ``clips`` clips of the held-out stream ``seed`` and their question and track files."""
    if clips < 1:
        raise ValueError(f"clips must be at least 1, got {clips}")
    files = DemoClipFiles(Path(out_dir))
    presence, mvbench, videos, annotations = [], [], [], []
    for index in range(clips):
        clip = generate_clip(seed, index, image_size=image_size, frames=frames, split="heldout")
        video_id, name = index + 1, clip_name(seed, index + 1)
        folder = files.videos / name
        folder.mkdir(parents=True, exist_ok=True)
        for f, frame in enumerate(clip.frames):
            Image.fromarray(frame).save(folder / frame_name(f))
        rng = np.random.default_rng([seed, index, CLIP_STREAM])
        asked = distinct_presence(rng, clip, PRESENCE_PER_CLIP)
        presence += [presence_entry(q, video_id * 10 + k, name, clip.fps) for k, q in enumerate(asked)]
        mvbench += [mvbench_entry(q, name, clip.fps) for q in choice_questions(rng, clip, 1)]
        video, objects = track_entries(clip, video_id, name)
        videos.append(video)
        annotations += objects
    files.presence.write_text(json.dumps(presence))
    files.mvbench.write_text(json.dumps(mvbench))
    info = {"description": "prune-audit synthetic clips", "generator": "prune_audit.data.scene_clips", "seed": seed}
    tracks = {"info": info, "videos": videos, "annotations": annotations, "categories": coco_categories()}
    files.tracks.write_text(json.dumps(tracks))
    return files


def demo_clip_files(cache_dir: str | Path | None = None, *, clips: int = DEMO_CLIPS) -> DemoClipFiles:
    """The demo's clip files in ``cache_dir``, written on first use (``demo.questions``' cache: a staging folder
    renamed when complete, one builder at a time)."""
    from prune_audit.demo.questions import _cached_folder, _checked_cache

    cache = _checked_cache(cache_dir)
    name = f"demo-clips-seed{DEMO_CLIP_SEED}-clips{clips}-{DEMO_CLIP_SIZE}px-v{CLIP_FILES_VERSION}"

    def build(staging: Path) -> None:
        write_clip_files(staging, seed=DEMO_CLIP_SEED, clips=clips)

    return DemoClipFiles(_cached_folder(cache, name, build))


__all__ = [
    "DEMO_CLIP_SEED",
    "DEMO_CLIPS",
    "DemoClipFiles",
    "clip_name",
    "write_clip_files",
    "demo_clip_files",
]
