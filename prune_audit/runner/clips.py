"""``prune-audit run`` on video clips: frame folders checked, the family and selector checked to take clips, and each
question prepared through the model's video path.

A clip task's question names a video (``x.mp4``); ``--images DIR`` holds it as the folder ``DIR/x/`` of its frames
(PNG or JPEG, in name order: the clip as stored). A video file there is refused (no video decoder is a dependency:
extract its frames), as is a missing folder; every frame decodes and has one size before anything is written.
Frames are sampled and resized as the family's own pipeline reads a video (``VisionLanguageModel.read_clip``; on
Qwen2.5-VL qwen-vl-utils' ``data.video.sample_clip`` within its default pixel limits, or those the checkpoint
declares: ``models.video_sampling``) at the question's frame rate (``ClipTask.clip_fps``).

Selectors on clips: each part reads the clip's temporal grid (the video selectors), is declared part of a video
method (``Selector.clip_method``: DyCoke's KV stage) or is an image selector with a per-frame run
(``Selector.per_frame``: each temporal step selected alone at an even share of the budget, ``pruners.frame_scope``);
any other (an image selector needing a still image, an in-LLM image selector) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prune_audit.errors import PruneAuditError
from prune_audit.pruners.signals import VIDEO_GRID
from prune_audit.safety.inputs import path_under

if TYPE_CHECKING:
    from prune_audit.models import Prepared, VisionLanguageModel
    from prune_audit.pruners.composed import RunSelector
    from prune_audit.runner.request import RunRequest
    from prune_audit.tasks import Task, TaskQuestion
    from prune_audit.tasks.clips import ClipTask


def _frame_folder(request: RunRequest, task: ClipTask, question: TaskQuestion) -> Path:
    """The question's frame folder under ``--images``; a video file or a missing folder refused in one line."""
    if request.images is None:
        raise PruneAuditError("pass --images DIR, the folder holding one folder of frames per video")
    folder = path_under(request.images, question.image, "the question files")
    if folder.is_dir():
        return folder
    video = task.clip_name(question)
    if folder.exists() or (Path(request.images) / video).is_file():
        raise PruneAuditError(
            f"{Path(request.images) / video} is a video file, and clips are read as frame folders: extract its "
            f"frames into the folder {folder}/ (PNG or JPEG, in name order)"
        )
    raise PruneAuditError(
        f"no frame folder {folder} for video {video!r}; extract its frames into that folder (PNG or JPEG) or pass "
        "the --images DIR holding it"
    )


def check_clip_folders(
    request: RunRequest, task: ClipTask, questions: Sequence[TaskQuestion]
) -> tuple[dict[str, Path], dict[str, tuple[int, int]]]:
    """Every clip's frame folder exists and its frames decode at one size: folder and (width, height) by name."""
    from prune_audit.data.images import open_rgb
    from prune_audit.data.video import frame_files

    paths: dict[str, Path] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for question in questions:
        if question.image in paths:
            continue
        folder = _frame_folder(request, task, question)
        frames = {open_rgb(path).size for path in frame_files(folder)}  # each frame decodes (one line otherwise)
        if len(frames) > 1:
            raise PruneAuditError(f"the frames of {folder} differ in size; give frames of one size")
        paths[question.image], sizes[question.image] = folder, frames.pop()
    return paths, sizes


def frame_pins(folders: dict[str, Path]) -> dict[str, Path]:
    """Each clip's frame files by ``video/frame`` name: what the manifest pins by content."""
    from prune_audit.data.video import frame_files

    return {f"{name}/{path.name}": path for name, folder in folders.items() for path in frame_files(folder)}


def check_clip_model(vlm: VisionLanguageModel, selector: RunSelector | None, task: Task) -> None:
    """The family reads clips and the selector acts on them (module docstring); one line otherwise."""
    if not vlm.takes_video:
        from prune_audit.models.families import video_families

        raise PruneAuditError(
            f"task {task.name} asks about video clips, which {vlm.display_name} does not read here; use a "
            f"checkpoint of a family that takes clips ({', '.join(video_families())})"
        )
    if selector is None:
        return
    from prune_audit.pruners.composed import ComposedSelector

    parts = selector.parts if isinstance(selector, ComposedSelector) else (selector,)
    for part in parts:
        if not (part.clip_method or part.per_frame or VIDEO_GRID in vlm.signals_for(part)):
            why = (
                "prunes inside the language model over the whole sequence, with no per-frame run"
                if part.stage == "llm"
                else "reads no clip's temporal grid and has no per-frame run (its signals or its algorithm need a "
                "still image)"
            )
            raise PruneAuditError(
                f"selector {part.name} {why}, so it does not run on video clips here; choose a video selector or "
                f"one run per frame ({', '.join(_per_frame_selectors(vlm))})"
            )


def _per_frame_selectors(vlm: VisionLanguageModel) -> list[str]:
    """The registered image selectors ``vlm`` runs on each temporal step of a clip (``Selector.per_frame``)."""
    from prune_audit.pruners.registry import selector_class

    support = vlm.selector_support()
    return [name for name, refusal in support.items() if refusal is None and selector_class(name).per_frame]


def prepare_clip(vlm: VisionLanguageModel, task: ClipTask, question: TaskQuestion, folder: Path, text: str) -> Prepared:
    """The question's clip read from ``folder`` at its frame rate as the family reads clips, through its video
    path."""
    return vlm.prepare_video(vlm.read_clip(folder, task.clip_fps(question)), text)


__all__ = ["check_clip_folders", "check_clip_model", "frame_pins", "prepare_clip"]
