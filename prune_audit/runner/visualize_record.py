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
from prune_audit.data.multigrid import geometry_from_dict
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
    """Redraw exactly the recorded kept sets of one question of a run (no model needed).

    Every stage is drawn at its recorded decoder layer; the title gives the retention of ``stage``.
    """
    from prune_audit.records.store import read_run

    manifest, records = read_run(run_dir)
    task = _still_image_task(manifest, run_dir)
    row = _record_row(records, question_id, split, run_dir)
    geometry = geometry_from_dict(loads_json(row["geometry"], f"{run_dir}: question {question_id}'s geometry"))
    image = _run_image(manifest, row["image"], run_dir)
    pixels = load_rgb(image)
    mask, boxes, missing = _evidence_drawing(task, manifest, row, image, pixels, run_dir)
    stages = [list(k) for k in row["kept_stages"]]
    merged = row["merged_stages"]
    level = manifest["selector"]["stage"]
    labels = stage_labels(level, stages, row["stage_layers"], merged, geometry.num_tokens)
    selector, budget = manifest["selector"]["name"], manifest.get("budget")
    chosen = record_stage(stages, stage, str(run_dir), merged)
    retention = row["retention_stages"][chosen]
    averaged = averages_budget(manifest["selector"])
    title = (
        f"{selector}, {budget_words(budget, row['stage_layers'], averaged)}"
        if budget is not None
        else f"{selector} (unpruned)"
    )
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


def _still_image_task(manifest: dict[str, Any], run_dir: Path) -> Task:
    """The run's task; a clip task's run is refused in one line (its frames are not drawn here)."""
    from prune_audit.tasks import manifest_task

    task = manifest_task(manifest)
    if task.reads_clips:
        raise PruneAuditError(
            f"{run_dir} is a run of video clips ({task.name}), and visualize --run draws still images; read a clip's "
            "per-frame evidence in its records (frame_retention, window_retention, lost_in_window)"
        )
    return task


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


def _question_words(row: dict[str, Any]) -> tuple[str, str]:
    """What the question is about and its reference, from the core columns: POPE's queried object and label
    ("dog", "label yes"); another task's evidence objects and reference answers ("table, cup", "reference cup")."""
    if row["task"] == "pope":
        return row["object"], f"label {row['label']}"
    about = ", ".join(dict.fromkeys(row["evidence_objects"])) or "the image"
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
