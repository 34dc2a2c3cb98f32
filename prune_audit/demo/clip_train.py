"""The video demo's training forward and held-out monitor: clips through Qwen2.5-VL's video path.

A clip's F frames are flattened as the Qwen2-VL video processor does (``models.qwen.video_patches``: two frames
per temporal patch), the vision tower runs once per batch of clips (differentiable) and gives the clip's
T * h * w merged tokens, time-major then row-major. The language model sees them at the ``<|video_pad|>`` span
of the prompt ``QwenModel.prepare_video`` builds, with that prompt's M-RoPE ids (the time axis included), and
the shared-prefix trick of the still demos (``models.shared_prefix``): the prompt up to the clip's last token
runs once per clip, its questions' suffixes reuse its cache. The suffixes after the clip's span are those of
the still-image prompt, so the still demos' teacher forcing (``demo.answer_targets``) builds them.

Losses, as the still demos': the answer token (a presence question's yes/no, a choice question's letter among
the offered letters), each offered candidate's "is this the answer" at its last word through the language
model's own yes/no logits (``answer_targets.option_loss``, the still demos' option target), and the two
auxiliary vision losses: the clip's classes from the mean merged token and each merged token's class
(``demo.clip_batches``).

Clips are sampled for the model as ``data.video.sample_clip`` reads the demo's frame folders with
``demo_clip_sampling``: every frame kept at its own size (a multiple of 16 px).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from prune_audit.data.pope_build import question_text
from prune_audit.data.video import FRAME_FACTOR, sample_clip
from prune_audit.demo.answer_targets import (
    AnswerTarget,
    PromptPieces,
    answer_loss,
    exact_matches,
    option_loss,
    prompt_pieces,
    teacher_forcing,
)
from prune_audit.demo.clip_batches import ClipBatch
from prune_audit.demo.clip_questions import CHOICE_LINE, ClipQuestion
from prune_audit.demo.scene_questions import CHOICE_LETTERS
from prune_audit.models.qwen import video_patches

if TYPE_CHECKING:
    from prune_audit.data.scene_clips import SceneClip
    from prune_audit.demo.train import VisionHeads
    from prune_audit.models.base import VisionLanguageModel


def demo_clip_sampling(image_size: int, frames: int) -> dict[str, int]:
    """``sample_clip`` keywords that keep every frame of a demo clip at its (image_size, image_size) pixels:
    qwen-vl-utils' frame limit ``max(min(.., total / count * 2), 1.05 * min_pixels)`` then allows 5 % more than
    ``min_pixels`` = the frame's own area, and ``smart_resize`` leaves a multiple of 16 px unchanged."""
    return {"min_pixels": image_size * image_size, "total_pixels": image_size * image_size * frames // FRAME_FACTOR}


@dataclass(frozen=True)
class ClipPrompt:
    """The token ids of a clip prompt, split around the clip's span.

    Attributes:
        pieces: the still-image prompt pieces of as many image tokens (their suffix cache builds the suffixes).
        prefix: (P,) ids up to and including the clip's last ``<|video_pad|>``.
        video_positions: (N,) positions of the clip's tokens in ``prefix``.
        prefix_positions: (3, P) M-RoPE ids of the prefix (the time axis advancing per temporal step).
        suffix_start: the M-RoPE id of every suffix's first token.
    """

    pieces: PromptPieces
    prefix: Tensor
    video_positions: Tensor
    prefix_positions: Tensor
    suffix_start: int


def clip_prompt(vlm: VisionLanguageModel, image_size: int, frames: int, fps: float) -> ClipPrompt:
    """The prompt of every clip of ``frames`` frames of ``image_size`` px at ``fps``, built by ``prepare_video``
    (probed with a blank clip: the prefix does not depend on the pixels)."""
    processor = vlm.image_processor  # type: ignore[attr-defined]
    blank = [Image.new("RGB", (image_size, image_size))] * frames
    probe = sample_clip(
        blank,
        fps,
        patch_size=processor.patch_size,
        merge_size=processor.merge_size,
        **demo_clip_sampling(image_size, frames),
    )
    item = vlm.prepare_video(probe, question_text("circle"))
    start, end = item.image_span
    positions = item.extras["positions"]
    return ClipPrompt(
        prompt_pieces(vlm, end - start),
        item.input_ids[:end],
        torch.arange(start, end),
        positions[:, :end],
        int(positions[0, end]),
    )


def clip_features(vlm: VisionLanguageModel, clips: tuple[SceneClip, ...]) -> Tensor:
    """(B, T * h * w, D) merged tokens of clips of one size, the vision tower once, differentiable."""
    processor = vlm.image_processor  # type: ignore[attr-defined]
    pixels = torch.cat([video_patches(list(clip.frames), processor) for clip in clips])
    frames, height, width = clips[0].frames.shape[:3]
    patch = processor.patch_size
    grid = torch.tensor([[frames // FRAME_FACTOR, height // patch, width // patch]] * len(clips))
    return vlm.vision_states(pixel_values=pixels, grid_thw=grid)[0]  # the tower as for still images, per clip


def clip_target(question: ClipQuestion, instruction: str) -> AnswerTarget:
    """The trained target of a clip question; ``instruction`` follows a presence question (as POPE's vary)."""
    if question.kind == "presence":
        return AnswerTarget(f"{question.prompt} {instruction}".strip(), question.answer, False)
    letters = CHOICE_LETTERS[: len(question.candidates)]
    present = tuple(candidate == question.answer for candidate in question.candidates)
    return AnswerTarget(question.prompt, question.letter, False, letters, question.candidates, present, CHOICE_LINE)


def clip_logits(
    vlm: VisionLanguageModel, prompt: ClipPrompt, features: Tensor, suffixes: list[Tensor], every_position: bool
) -> Tensor:
    """(B * per_clip, V) logits after each suffix (or (B * per_clip, T, V) at ``every_position``), the clip
    prefix once per clip with the clip prompt's M-RoPE ids; ``suffixes`` grouped by clip."""
    return vlm.shared_prefix_logits(  # type: ignore[call-arg]  # the clip recipes train Qwen2.5-VL
        features,
        prompt.prefix,
        prompt.video_positions,
        suffixes,
        len(suffixes) // features.shape[0],
        every_position=every_position,
        rope=(prompt.prefix_positions, prompt.suffix_start),
    )


def clip_batch_loss(
    vlm: VisionLanguageModel, heads: VisionHeads, prompt: ClipPrompt, batch: ClipBatch, instruction: str
) -> dict[str, Tensor]:
    """Answer CE, presence BCE (mean merged token), per-token class CE and, when the batch asks a choice, the
    candidates' CE (module docstring) of one batch, and their sum (``total``)."""
    features = clip_features(vlm, batch.clips)
    forcing = teacher_forcing(vlm, prompt.pieces, [clip_target(q, instruction) for q in batch.questions])
    logits = clip_logits(vlm, prompt, features, forcing.suffixes, forcing.every_position)
    losses = {
        "answer": answer_loss(logits, forcing),
        "presence": F.binary_cross_entropy_with_logits(heads.presence(features.mean(dim=1)), batch.presence),
        "patch": F.cross_entropy(heads.patch(features).flatten(0, 1), batch.patch_labels.flatten()),
    }
    if forcing.option_rows.numel():
        losses["options"] = option_loss(logits, forcing)
    losses["total"] = sum(losses.values())  # type: ignore[assignment]
    return losses


def clip_accuracy(vlm: VisionLanguageModel, prompt: ClipPrompt, batch: ClipBatch, chunk: int = 10) -> dict[str, float]:
    """Teacher-forced exact match of ``batch``'s questions (equal to greedy decoding's first token; a choice's
    letter among the offered letters): ``presence`` overall, ``presence:{window}`` per window and ``choice``."""
    hits: dict[str, list[bool]] = {}
    per_clip = batch.per_clip
    with torch.no_grad():
        for first in range(0, len(batch.clips), chunk):
            clips = batch.clips[first : first + chunk]
            asked = batch.questions[first * per_clip : (first + len(clips)) * per_clip]
            forcing = teacher_forcing(vlm, prompt.pieces, [clip_target(q, "") for q in asked])
            logits = clip_logits(vlm, prompt, clip_features(vlm, clips), forcing.suffixes, forcing.every_position)
            for question, hit in zip(asked, exact_matches(logits, forcing).tolist(), strict=True):
                keys = ("presence", f"presence:{question.form}") if question.kind == "presence" else ("choice",)
                for key in keys:
                    hits.setdefault(key, []).append(hit)
    return {key: round(sum(found) / len(found), 4) for key, found in sorted(hits.items())}


__all__ = [
    "ClipPrompt",
    "demo_clip_sampling",
    "clip_prompt",
    "clip_features",
    "clip_target",
    "clip_logits",
    "clip_batch_loss",
    "clip_accuracy",
]
