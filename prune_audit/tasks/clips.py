"""What the video tasks share: a question asks about a clip (a folder of frames), and its records carry the clip's
per-frame evidence.

A :class:`ClipTask` says its questions are clips (``reads_clips``): the run prepares each through the model's
video path (frames sampled as the family's own pipeline samples them, ``data.video``) at the question's frame rate
(``clip_fps``), and asks about a window of its frames (``clip_window``, None: the whole clip). Its records hold
:data:`CLIP_COLUMNS`, defined once here and placed by the run schema before the first clip task's own columns
(``records.schema.tasks_columns``); ``runner.build`` fills them from each stage's kept set (the unsuffixed ones from
the first stage's, as the core ``retention`` and ``lost``) and the question's
:class:`~prune_audit.data.clip_retention.ClipArea` (``ClipEvidence.clip_area``).

Evidence from object tracks (:class:`TrackEvidence`, the YouTube-VIS layout of ``data.youtube_vis``): the asked
category's union mask in each sampled frame; the clip-wide region (core ``retention`` / ``lost``) counts every
sampled frame's pixels.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa

from prune_audit.data.files import stable_image_id
from prune_audit.data.video_questions import DEFAULT_FRAME_RATE
from prune_audit.record_columns import INT_LIST, Column, column
from prune_audit.tasks.base import Task

if TYPE_CHECKING:
    from prune_audit.data.clip_retention import ClipArea, Window
    from prune_audit.data.retention import ObjectArea
    from prune_audit.data.video import ClipGeometry
    from prune_audit.data.youtube_vis import VideoTracks


CLIP_COLUMNS: tuple[Column, ...] = (
    column(
        "sampled_frames",
        INT_LIST,
        "the clip's sampled frames as indices of its frames as stored (2 per temporal step on the Qwen families: "
        "token t * h * w + cell covers sampled frames 2t and 2t + 1; 1 on LLaVA-OneVision: geometry frames_per_step)",
    ),
    column(
        "frame_retention",
        pa.list_(pa.float64()),
        "per sampled frame, the share of the evidence object's pixels in that frame covered by the FIRST stage's kept "
        "tokens of its temporal step (and the cells its merged tokens carry); NaN where the object has no pixels in "
        "the frame; null without evidence",
        nullable=True,
    ),
    column(
        "frame_retention_stages",
        pa.list_(pa.list_(pa.float64())),
        "frame_retention at each stage (stage_layers): per stage, per sampled frame, the share of the object's pixels "
        "in that frame covered by that stage's kept tokens of its temporal step and the cells its merged tokens carry; "
        "null without evidence",
        nullable=True,
    ),
    column(
        "window",
        INT_LIST,
        "the frames the question asks about, [first, last] of the clip as stored (inclusive); null: the whole clip",
        nullable=True,
    ),
    column(
        "window_retention",
        pa.float64(),
        "share of the evidence object's pixels in the window's sampled frames covered at the first stage (NaN without "
        "pixels there)",
    ),
    column(
        "lost_in_window",
        pa.bool_(),
        "the object has pixels in the window's sampled frames and no first-stage kept token covers any of them (null: "
        "no pixels there, or no evidence); `lost` says the same of the whole clip",
        nullable=True,
    ),
    column(
        "lost_in_window_stages",
        pa.list_(pa.bool_()),
        "lost_in_window at each stage (stage_layers); null entries where it is null; null without evidence",
        nullable=True,
    ),
)
"""The record columns every clip task's rows hold (``runner.build.clip_values`` writes them)."""


class ClipEvidence(Protocol):
    """Evidence of clip questions: besides the clip-wide region (``Evidence.area``), the per-frame masks."""

    def clip_area(self, question: Any, image_id: int, geometry: ClipGeometry) -> ClipArea | None:
        """The question's object over the clip's sampled frames; None when it names none."""
        ...


class ClipTask(Task):
    """A task whose questions ask about video clips (``reads_clips``)."""

    reads_clips = True

    def clip_fps(self, question: Any) -> float:
        """Frames per second of the question's frame folder: its ``fps`` field, else ``DEFAULT_FRAME_RATE``."""
        return question.fps if question.fps is not None else DEFAULT_FRAME_RATE

    def clip_window(self, question: Any) -> Window | None:
        """The frames the question asks about (None: the whole clip)."""
        return None

    def clip_name(self, question: Any) -> str:
        """The video as the question file names it (``x.mp4``), for messages."""
        return str(question.video)

    def image_id(self, question: Any) -> int:
        """Without annotations the clip's id is its folder name's (``data.files.stable_image_id``)."""
        return stable_image_id(question.image)

    def summary_rows(self, records: pa.Table) -> list[tuple[str, str]]:
        """The objects lost in the asked window, of those with pixels there, and the accuracy on those questions."""
        rows = records.select(["lost_in_window", "correct"]).to_pylist()
        lost = [row["correct"] for row in rows if row["lost_in_window"] is True]
        measured = sum(row["lost_in_window"] is not None for row in rows)
        if not measured:
            return []
        accuracy = f"{sum(lost) / len(lost):.4f}" if lost else "-"
        return [
            ("objects lost in the asked window, first stage", f"{len(lost)} of {measured}"),
            ("accuracy on the questions whose object is lost in the window", accuracy),
        ]


class TrackEvidence:
    """Object tracks (YouTube-VIS layout) as the evidence of clip questions: the asked category's masks per frame."""

    def __init__(self, tracks: VideoTracks, category: Any) -> None:
        """``category``: question -> the category it asks about (None: no evidence)."""
        self.tracks = tracks
        self.category = category
        self._areas: dict[tuple[str, str, ClipGeometry], ClipArea] = {}

    def image_id(self, image: str) -> int:
        return self.tracks.video_id(image)

    def check_image_size(self, image: str, size: tuple[int, int], path: Path) -> None:
        from prune_audit.data.video import frame_files

        self.tracks.check_clip(image, len(frame_files(path)), size, path)

    def clip_area(self, question: Any, image_id: int, geometry: ClipGeometry) -> ClipArea | None:
        from prune_audit.data.clip_retention import clip_area

        category = self.category(question)
        if category is None:
            return None
        key = (question.image, category, geometry)
        if key not in self._areas:
            masks = self.tracks.category_masks(question.image, category, geometry.frames)
            self._areas[key] = clip_area(masks, geometry)
        return self._areas[key]

    def area(self, question: Any, image_id: int, geometry: Any) -> ObjectArea | None:
        found = self.clip_area(question, image_id, geometry)
        return None if found is None or not found.has_mask else found.object_area()

    def objects(self, question: Any, image_id: int, geometry: Any) -> list[tuple[str, ObjectArea]]:
        area = self.area(question, image_id, geometry)
        return [] if area is None else [(self.category(question), area)]

    def record_mask(self, record: dict[str, Any]) -> np.ndarray | None:
        """None: a clip's record has no single image to draw its evidence over (:meth:`record_masks` has its frames)."""
        return None

    def record_masks(self, record: dict[str, Any]) -> list[np.ndarray] | None:
        """(H, W) bool mask of the record's evidence object (its ``evidence_objects``' category) in each of its
        ``sampled_frames``; None when the record names no category of the tracks."""
        categories = [name for name in record["evidence_objects"] or [] if name in self.tracks.frames.category_ids]
        if not categories:
            return None
        return self.tracks.category_masks(record["image"], categories[0], record["sampled_frames"])


__all__ = ["CLIP_COLUMNS", "ClipEvidence", "ClipTask", "TrackEvidence"]
