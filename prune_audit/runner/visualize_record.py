"""``visualize --run``: redraw a recorded question of a run from its records, without the model.

The image and the annotations are read from the run's manifest and checked against its sha256
pins first, so the recorded tokens are never drawn over another picture.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from prune_audit.analysis.overlay import Panel, draw_panels
from prune_audit.data.clip_retention import clip_area, frames_in_window
from prune_audit.data.multigrid import geometry_from_dict
from prune_audit.data.video import ClipGeometry
from prune_audit.errors import PruneAuditError
from prune_audit.records.stages import FIRST, StageChoice, budget_words, record_stage
from prune_audit.runner.manifest_selector import averages_budget
from prune_audit.runner.visualize import (
    FIGURES_DIR,
    DrawnFigure,
    PanelAnswer,
    load_rgb,
    merged_cells,
    output_path,
    stage_labels,
)
from prune_audit.safety.inputs import loads_json, path_under

if TYPE_CHECKING:
    import pyarrow as pa

    from prune_audit.tasks import FigureBoxes, Task


def visualize_record(
    run_dir: Path, question_id: int, split: str | None, out: Path | None, stage: StageChoice = FIRST
) -> DrawnFigure:
    """Redraw exactly the recorded kept sets of one question of a run (no model needed): a still image's every
    stage at its recorded decoder layer, the title giving the retention of ``stage``; a clip's sampled frames, each
    with ``stage``'s kept cells of its temporal step (:func:`_clip_figure`)."""
    from prune_audit.records.store import read_run
    from prune_audit.tasks import manifest_task

    manifest, records = read_run(run_dir)
    task = manifest_task(manifest)
    row = _record_row(records, question_id, split, run_dir)
    draw = _clip_figure if task.reads_clips else _still_figure
    return draw(run_dir, manifest, task, row, out, stage)


def _still_figure(
    run_dir: Path, manifest: dict[str, Any], task: Task, row: dict[str, Any], out: Path | None, stage: StageChoice
) -> DrawnFigure:
    """The figure of a still-image record: one picture per stage, over the run's pinned image."""
    question_id = row["question_id"]
    geometry = geometry_from_dict(loads_json(row["geometry"], f"{run_dir}: question {question_id}'s geometry"))
    image = _run_image(manifest, row["image"], run_dir)
    pixels = load_rgb(image)
    mask, boxes, missing = _evidence_drawing(task, manifest, row, image, pixels, run_dir)
    stages = [list(k) for k in row["kept_stages"]]
    merged = row["merged_stages"]
    level = manifest["selector"]["stage"]
    labels = stage_labels(level, stages, row["stage_layers"], merged, geometry.num_tokens)
    chosen = record_stage(stages, stage, str(run_dir), merged)
    retention = row["retention_stages"][chosen]
    title = _selector_title(manifest, row)
    notes = (
        {}
        if retention is None or math.isnan(retention)
        else {chosen: f"retention {retention:.2f} at stage {stage.name} (layer {row['stage_layers'][chosen]})"}
    )
    about, truth = _question_words(row)
    caption = f"answer {row['answer_text']} (confidence {row['confidence']:.3f}), {truth}"
    panel = Panel(
        title + (f"\n{boxes.note}" if boxes.note else ""),
        geometry,
        stages,
        labels,
        caption,
        mask,
        merged_cells(merged),
        stage_notes=notes,
        evidence_label=task.evidence_label,
        evidence_boxes=list(boxes.evidence),
        answer_boxes=[boxes.answer] if boxes.answer else [],
    )
    out = output_path(out, FIGURES_DIR / Path(run_dir).resolve().name, f"tokens-{row['split']}-{question_id}")
    suptitle = f"{Path(manifest['model']['id']).name} | {about} ({row['split']} #{question_id})"
    path = draw_panels(pixels, [panel], out, suptitle=suptitle)
    question = f"{row['split']} #{question_id} about {about} ({truth})"
    return DrawnFigure(
        path,
        question,
        (PanelAnswer(title, row["answer_text"], row["confidence"]),),
        notes=(missing,) if missing else (),
    )


def _clip_figure(
    run_dir: Path, manifest: dict[str, Any], task: Task, row: dict[str, Any], out: Path | None, stage: StageChoice
) -> DrawnFigure:
    """The frame strip of a clip record: one picture per sampled frame (2 per temporal step), each the frame with
    ``stage``'s kept cells of its step (``ClipGeometry.frame_cells``), the asked object's outline in that frame (from
    the run's pinned tracks) and its retention at ``stage`` and place in the asked window under it."""
    question_id = row["question_id"]
    clip = ClipGeometry.from_dict(loads_json(row["geometry"], f"{run_dir}: question {question_id}'s geometry"))
    frames = _clip_frames(manifest, row, clip, run_dir)
    masks, missing = _clip_masks(task, manifest, row, frames, run_dir)
    stages, merged = [list(k) for k in row["kept_stages"]], merged_cells(row["merged_stages"])
    chosen = record_stage(stages, stage, str(run_dir), row["merged_stages"])
    kept, carried = (stages[chosen], merged[chosen]) if stages else (list(range(clip.num_tokens)), [])
    covered = sorted(set(kept) | set(carried))
    retention = clip_area(masks, clip).frame_retention(covered) if masks else None
    window = row["window"]
    in_window = frames_in_window(clip.frames, None if window is None else (window[0], window[1]))
    place = "in the asked window" if window is not None else "the whole clip is asked"
    kept_cells = [clip.frame_cells(k, kept) for k in range(len(clip.frames))]
    panels = [
        Panel(
            f"frame {stored} (step {k // clip.frames_per_step})",
            clip.frame,
            [kept_cells[k]],
            [f"{len(kept_cells[k])} of {clip.frame.num_tokens} cells kept"],
            _frame_retention_words(retention, k),
            None if masks is None else masks[k],
            [clip.frame_cells(k, carried)],
            stage_notes={0: place if in_window[k] else "outside the asked window"},
            evidence_label=task.evidence_label,
            image=frames[k],
        )
        for k, stored in enumerate(clip.frames)
    ]
    title, (about, truth) = _selector_title(manifest, row), _question_words(row, "the clip")
    answer = f"answer {row['answer_text']} (confidence {row['confidence']:.3f}), {truth}"
    layer = row["stage_layers"][chosen] if stages else 0
    suptitle = (
        f"{Path(manifest['model']['id']).name} | {about} ({row['split']} #{question_id}) | {title}\n"
        f"{answer}; kept cells of stage {stage.name} (layer {layer})"
    )
    out = output_path(out, FIGURES_DIR / Path(run_dir).resolve().name, f"frames-{row['split']}-{question_id}")
    path = draw_panels(frames[0], panels, out, suptitle=suptitle, note=missing or "")
    question = f"{row['split']} #{question_id} about {about} ({truth})"
    answers = (PanelAnswer(title, row["answer_text"], row["confidence"]),)
    return DrawnFigure(path, question, answers, notes=(missing,) if missing else ())


def _frame_retention_words(retention: list[float] | None, frame: int) -> str:
    """The caption of sampled frame ``frame``: its object's retention (``retention``: one per sampled frame, None
    without an object outline), or that the object has no pixels there."""
    if retention is None:
        return ""
    return "no asked object in this frame" if math.isnan(retention[frame]) else f"retention {retention[frame]:.2f}"


def _clip_frames(manifest: dict[str, Any], row: dict[str, Any], clip: ClipGeometry, run_dir: Path) -> list[np.ndarray]:
    """(H, W, 3) uint8 of each sampled frame of the record's clip, each verified against the manifest's pin."""
    from prune_audit.data.video import frame_files
    from prune_audit.records.manifest import images_folder

    stored = frame_files(path_under(images_folder(manifest), row["image"], f"{run_dir}'s records"))
    if max(clip.frames) >= len(stored):
        raise PruneAuditError(
            f"{run_dir}: clip {row['image']} now holds {len(stored)} frames, fewer than the run sampled; restore the "
            "run's frames to redraw the question"
        )
    return [load_rgb(_run_image(manifest, f"{row['image']}/{stored[k].name}", run_dir)) for k in clip.frames]


def _clip_masks(
    task: Task, manifest: dict[str, Any], row: dict[str, Any], frames: list[np.ndarray], run_dir: Path
) -> tuple[list[np.ndarray] | None, str | None]:
    """(H, W) bool mask of the asked object in each sampled frame, from the run's pinned tracks
    (``TrackEvidence.record_masks``), and the reason the figure has none (None when it has them)."""
    from prune_audit.records.manifest import images_folder
    from prune_audit.tasks.clips import TrackEvidence

    annotations = manifest.get("annotations") or {}
    if not annotations.get("path"):
        return None, "no object outline: the run was made without --annotations"
    evidence = task.load_evidence(_pinned_input(Path(annotations["path"]), annotations.get("sha256"), run_dir), [])
    if isinstance(evidence, TrackEvidence):
        folder = path_under(images_folder(manifest), row["image"], f"{run_dir}'s records")
        evidence.check_image_size(row["image"], (frames[0].shape[1], frames[0].shape[0]), folder)
        masks = evidence.record_masks(row)
        if masks is not None:
            return masks, None
    return None, f"no object outline: this question names no tracked object ({task.evidence_noun})"


def _selector_title(manifest: dict[str, Any], row: dict[str, Any]) -> str:
    """The run's selector and budget in words (``records.stages.budget_words``), or "(unpruned)"."""
    selector, budget = manifest["selector"]["name"], manifest.get("budget")
    if budget is None:
        return f"{selector} (unpruned)"
    return f"{selector}, {budget_words(budget, row['stage_layers'], averages_budget(manifest['selector']))}"


def _some_ids(records: pa.Table, split: str | None, count: int = 5) -> str:
    """The first ``count`` question ids of ``records`` (of ``split``, when given; "none" when it has none)."""
    ids = [
        row["question_id"]
        for row in records.select(["question_id", "split"]).to_pylist()
        if split is None or row["split"] == split
    ]
    return ", ".join(str(value) for value in ids[:count]) or f"none in split {split}"


def _record_row(records: pa.Table, question_id: int, split: str | None, run_dir: Path) -> dict[str, Any]:
    """The one record of ``question_id`` (in ``split``, when given); a one-line refusal when there is none or
    several."""
    import pyarrow.compute as pc

    match = pc.equal(records["question_id"], question_id)
    if split is not None:
        match = pc.and_(match, pc.equal(records["split"], split))
    rows = records.filter(match).to_pylist()
    if not rows:
        raise PruneAuditError(
            f"question {question_id} is not in {run_dir}; pass one of its ids, e.g. "
            f"{_some_ids(records, split)} (--question-id, and --split)"
        )
    if len(rows) > 1:
        raise PruneAuditError(
            f"question id {question_id} appears in splits {', '.join(r['split'] for r in rows)}; pass --split"
        )
    return rows[0]


def _evidence_drawing(
    task: Task, manifest: dict[str, Any], row: dict[str, Any], image: Path, pixels: np.ndarray, run_dir: Path
) -> tuple[np.ndarray | None, FigureBoxes, str | None]:
    """What the figure draws of the recorded question's evidence, read by its task: the evidence region, (height,
    width) bool, from the run's pinned annotations (``Evidence.record_mask``: POPE's object, GQA's scene-graph boxes,
    a caption's annotated objects, TextVQA's OCR boxes, RefCOCO's referred object; None without one), the task's
    boxes (``Task.figure_boxes``), and the reason the figure has no evidence mask (None when it has one)."""
    annotations = manifest.get("annotations") or {}
    if not task.names_evidence:
        return None, task.figure_boxes(row, None), f"no evidence mask: {task.name} questions name no image region"
    if not annotations.get("path"):
        return None, task.figure_boxes(row, None), "no evidence mask: the run was made without --annotations"
    evidence = task.load_evidence(_pinned_input(Path(annotations["path"]), annotations.get("sha256"), run_dir), [])
    evidence.check_image_size(row["image"], (pixels.shape[1], pixels.shape[0]), image)
    mask = evidence.record_mask(row)
    missing = None if mask is not None else f"no evidence mask: this question names no region ({task.evidence_noun})"
    return mask, task.figure_boxes(row, evidence), missing


def _question_words(row: dict[str, Any], whole: str = "the image") -> tuple[str, str]:
    """What the question is about and its reference, from the core columns: POPE's queried object and label
    ("dog", "label yes"); another task's evidence objects and reference answers ("table, cup", "reference cup"),
    ``whole`` when it names no object."""
    if row["task"] == "pope":
        return row["object"], f"label {row['label']}"
    about = ", ".join(dict.fromkeys(row["evidence_objects"])) or whole
    return about, f"reference {' / '.join(dict.fromkeys(row['references']))}"  # each once: TextVQA lists 10 annotators'


def _run_image(manifest: dict[str, Any], name: str, run_dir: Path) -> Path:
    """The run's image ``name`` in its recorded folder, verified against the manifest's pin."""
    from prune_audit.records.manifest import images_folder

    folder = images_folder(manifest)
    files = manifest["images"].get("files") if isinstance(manifest["images"], dict) else None
    if not isinstance(files, dict) or name not in files:
        raise PruneAuditError(
            f"{run_dir}'s manifest pins no content for image {name}, so the drawing cannot be checked against the "
            f"pixels the run saw; re-run into a new --out with this version"
        )
    return _pinned_input(path_under(folder, name, f"{run_dir}'s records"), files[name], run_dir)


def _pinned_input(path: Path, sha256: str | None, run_dir: Path) -> Path:
    """A run's input file, verified against the manifest's sha256 pin: a replaced image of the same
    size (or edited annotations) would otherwise have the recorded tokens drawn over another picture."""
    from prune_audit.runner.safeguards import hash_cache_file
    from prune_audit.safety.fingerprint import check_pinned_file

    return check_pinned_file(
        path, sha256, f"{run_dir}'s manifest", "restore the run's file to redraw the question", hash_cache_file()
    )
