"""Training and monitoring batches of the video demo: clips, their questions and dense per-token labels.

Per clip: ``presence`` temporal presence questions (balanced yes/no, hard negatives, ``demo.clip_questions``)
and ``choices`` multiple-choice questions; a clip that answers no choice form gets as many more presence
questions instead, so every clip keeps the same number of questions (the shared prefix needs it).

Dense vision targets, as the still demos' (``demo.batches``): the clip's classes (present in any frame) and,
per merged token of temporal step t (frames 2t and 2t + 1), the class covering more than a quarter of its cell
in the union of the two frames' visible masks, else background.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from prune_audit.data.scene_clips import CLIP_STREAM, SceneClip, generate_clip
from prune_audit.data.scenes import CATEGORIES, Scene, SceneObject
from prune_audit.data.video import FRAME_FACTOR
from prune_audit.demo.batches import patch_labels
from prune_audit.demo.clip_questions import ClipQuestion, choice_questions, presence_questions


@dataclass(frozen=True)
class ClipBatch:
    """Clips with their questions and dense vision targets.

    Attributes:
        clips: the generated clips (all of one size and frame count).
        questions: the same number per clip, grouped by clip in clip order.
        presence: (B, C) float, 1 where class c is in clip b (any frame).
        patch_labels: (B, T * h * w) long, per merged token (time-major, then row-major) its class or
            ``demo.batches.BACKGROUND_CLASS``.
    """

    clips: tuple[SceneClip, ...]
    questions: tuple[ClipQuestion, ...]
    presence: Tensor
    patch_labels: Tensor

    @property
    def per_clip(self) -> int:
        return len(self.questions) // len(self.clips)


def sample_clip_batch(
    seed: int,
    step: int,
    *,
    clips: int,
    presence: int,
    choices: int,
    image_size: int,
    frames: int,
    cell: int,
    split: str = "train",
) -> ClipBatch:
    """Batch ``step`` of the clip stream ``(split, seed)``: clips ``step * clips ...`` and their questions.

    Args:
        presence: presence questions per clip (even: half yes, half no).
        choices: choice questions per clip (even, so that a clip without one stays balanced).
        cell: pixels per side of one merged token (patch times merge).
    """
    if choices % 2:
        raise ValueError(f"choices per clip must be even (presence questions replace missing ones), got {choices}")
    made = tuple(
        generate_clip(seed, step * clips + i, image_size=image_size, frames=frames, split=split) for i in range(clips)
    )
    rng = np.random.default_rng([seed, step, len(CATEGORIES), CLIP_STREAM])
    questions: list[ClipQuestion] = []
    for clip in made:
        asked = presence_questions(rng, clip, presence)
        chosen = choice_questions(rng, clip, choices)
        questions += asked + (chosen or (presence_questions(rng, clip, choices) if choices else []))
    labels = torch.zeros(clips, len(CATEGORIES))
    for b, clip in enumerate(made):
        labels[b, [CATEGORIES.index(c) for c in clip.categories]] = 1.0
    patches = torch.stack([clip_patch_labels(clip, cell) for clip in made])
    return ClipBatch(made, tuple(questions), labels, patches)


def clip_patch_labels(clip: SceneClip, cell: int) -> Tensor:
    """(T * h * w,) long: per merged token of each temporal step, ``demo.batches.patch_labels`` of the union of the
    step's two frames' visible masks."""
    steps = []
    for t in range(clip.num_frames // FRAME_FACTOR):
        pair = slice(FRAME_FACTOR * t, FRAME_FACTOR * (t + 1))
        objects = tuple(SceneObject(obj.category, np.asarray(obj.masks[pair].any(axis=0))) for obj in clip.objects)
        steps.append(patch_labels(Scene(clip.frames[pair.start], objects), cell))
    return torch.cat(steps)


__all__ = ["ClipBatch", "sample_clip_batch", "clip_patch_labels"]
