"""``prune-audit visualize``: draw which tokens each selector keeps, live or from a run's records."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prune_audit.analysis.overlay import Panel, draw_panels
from prune_audit.data.geometry import TokenGeometry
from prune_audit.errors import PruneAuditError
from prune_audit.records.stages import FIRST, StageChoice, record_stage
from prune_audit.runner.build import covered_stages, recorded_stages
from prune_audit.runner.safeguards import resolve_budget

if TYPE_CHECKING:
    from prune_audit.data.coco import CocoInstances
    from prune_audit.models import VisionLanguageModel
    from prune_audit.pruners.base import Selector

FIGURES_DIR = Path("figures")
"""Default parent of ``visualize``'s output folder: figures/<image stem>/ (figures/<run name>/ with --run)."""


@dataclass
class VisualizeRequest:
    image: Path
    model: str | None = None
    selectors: Sequence[str] = ()
    options: Sequence[str] = ()
    budget: int | None = None
    question: str | None = None
    object_name: str | None = None
    annotations: Path | None = None
    out: Path | None = None
    clip_text: Path | None = None
    device: str = "auto"
    seed: int = 0


def output_path(out: Path | None, default_dir: Path, stem: str) -> Path:
    """``out`` itself when it names a .png/.svg file, else ``<out or default_dir>/<stem>.png``.

    The figure's folder may not hold another command's outputs (a run, a calibration):
    figures go next to them, never into them.
    """
    from prune_audit.safety.ownership import check_output_dir

    path = out if out is not None and out.suffix.lower() in {".png", ".svg"} else (out or default_dir) / f"{stem}.png"
    check_output_dir(path.parent, "visualize")
    return path


def load_rgb(path: Path) -> np.ndarray:
    """(H, W, 3) uint8 pixels of an image file; a missing, corrupt or oversized file is a one-line error."""
    from prune_audit.data.images import open_rgb

    if not Path(path).is_file():
        raise PruneAuditError(f"image not found: {path}")
    return np.asarray(open_rgb(path))


def object_mask(coco: CocoInstances | None, image_name: str, object_name: str | None) -> np.ndarray | None:
    """The queried object's mask (union of its instances) when the annotations name the image."""
    if coco is None or object_name is None:
        return None
    image_id = coco.image_id(Path(image_name).name)
    coco.category_id(object_name)
    return coco.category_mask(image_id, object_name)


def load_annotations(path: Path | None) -> CocoInstances | None:
    """CocoInstances of ``path`` (None stays None)."""
    if path is None:
        return None
    from prune_audit.data.coco import CocoInstances

    return CocoInstances.load(path)


def _names_image(coco: CocoInstances, image: Path) -> bool:
    try:
        coco.image_id(image.name)
    except PruneAuditError:
        return False
    return True


def most_visible_object(coco: CocoInstances, image_name: str) -> str:
    """The annotated category covering the most pixels of the image (ties: first annotated)."""
    image_id = coco.image_id(Path(image_name).name)
    names = coco.object_names(image_id)
    if not names:
        raise PruneAuditError(f"{image_name} has no annotated object; pass --object NAME")
    return max(names, key=lambda name: int(coco.category_mask(image_id, name).sum()))


def _question_object(question: str) -> str | None:
    from prune_audit.data.pope import parse_object

    try:
        return parse_object(question)
    except PruneAuditError:
        return None


def _retention_text(mask: np.ndarray | None, geometry: TokenGeometry, covered: Sequence[int]) -> str:
    """Retention of ``covered`` (the first stage's kept and merged cells, as the records' ``retention``)."""
    if mask is None or not mask.any():
        return ""
    from prune_audit.data.retention import object_area, retention

    area = object_area(mask, geometry)
    retained, tokens, _ = retention(area.area_per_token, area.total_area, covered)
    return f"first-stage retention {retained:.2f} ({tokens} object token{'s' if tokens != 1 else ''})\n"


def stage_labels(
    level: str | None, kept_stages: list[list[int]], layers: list[int], merged_stages: list[list[list[int]]], total: int
) -> list[str]:
    """One label per stage: where it applies (``level`` "llm": its decoder layer; else the input), how
    many of the ``total`` grid tokens it keeps, and how many merged tokens it feeds beside them."""
    labels = []
    for layer, kept, merged in zip(layers, kept_stages, merged_stages):
        where = f"layer {layer}" if level == "llm" else "input"
        labels.append(f"{where}: kept {len(kept)} of {total}" + (f" + {len(merged)} merged" if merged else ""))
    return labels


def merged_cells(merged_stages: list[list[list[int]]]) -> list[list[int]]:
    """Per stage, the ascending grid cells its merged tokens carry."""
    return [sorted(set().union(*merged)) for merged in merged_stages]


@dataclass(frozen=True)
class LiveSetup:
    """What a live figure needs before the model runs: model, its display name, question, annotations."""

    model_path: str
    model_name: str
    question: str
    coco: CocoInstances | None


def live_setup(request: VisualizeRequest) -> LiveSetup:
    """Resolve the model, the annotations and the question.

    The question is --question, else the POPE question about --object, else about the most
    visible annotated object. A bundled demo (no --model, or demo / demo-qwen) reads its own scene
    annotations when the image is one of its scenes, and otherwise asks about its first shape class.
    """
    from prune_audit.data.pope_build import question_text
    from prune_audit.demo.assets import demo_assets, is_demo_name

    model_path, model_name, annotations = request.model, None, request.annotations
    fallback = None
    if model_path is None or is_demo_name(model_path):
        from prune_audit.data.scenes import CATEGORIES

        name = model_path or "demo"
        assets = demo_assets(name=name)
        model_path, model_name, fallback = str(assets.model_dir), f"{name} model", CATEGORIES[0]
        if annotations is None:
            annotations = assets.annotations if _names_image(load_annotations(assets.annotations), request.image) else None
    coco = load_annotations(annotations)
    if request.question is not None:
        question = request.question
    elif request.object_name is not None:
        question = question_text(request.object_name)
    elif coco is not None:
        question = question_text(most_visible_object(coco, request.image.name))
    elif fallback is not None:
        question = question_text(fallback)
    else:
        raise PruneAuditError("which object to ask about? pass --object NAME, --question TEXT, or --annotations "
                              "COCO_FILE (asks about the most visible annotated object)")
    return LiveSetup(model_path, model_name or Path(model_path.rstrip("/")).name, question, coco)


def selector_options(names: Sequence[str], pairs: Sequence[str]) -> dict[str, Selector]:
    """``{name: selector built with the KEY=VALUE pairs}`` for the one selector besides none (empty
    without pairs); options with no or several such selectors are a one-line error."""
    if not pairs:
        return {}
    from prune_audit.pruners.registry import selector_from_strings

    pruned = [name for name in names if name != "none"]
    if len(pruned) != 1:
        raise PruneAuditError(
            f"--option applies to one selector: pass exactly one --selector besides none, got {len(pruned)}"
        )
    return {pruned[0]: selector_from_strings(pruned[0], pairs)}


def _skip_reason(vlm: VisionLanguageModel, name: str) -> str | None:
    """Why the model cannot run selector ``name`` (short, for a caption), or None when it can."""
    from prune_audit.pruners import get_selector

    try:
        vlm.check_selector(get_selector(name))
    except PruneAuditError as error:
        message = str(error)
        if "--clip-text" in message:
            return "needs --clip-text PATH"
        found = re.search(r"needs ([^,;(]+)", message)
        return f"needs {found.group(1).strip()}" if found else message
    return None


def visualize_live(request: VisualizeRequest) -> Path:
    """Run the model under each selector on one image and draw one panel (grid cell) per selector.

    Without --selector every selector the model can run is drawn and the others are listed,
    with the reason, under the grid.
    """
    import torch

    from prune_audit.models import load_vlm
    from prune_audit.pruners import get_selector, list_selectors

    if request.budget is not None and request.budget <= 0:
        raise PruneAuditError(f"--budget must be a positive number of visual tokens, got {request.budget}")
    options = selector_options(request.selectors, request.options)
    pixels = load_rgb(request.image)
    setup = live_setup(request)
    mask = object_mask(setup.coco, request.image.name, _question_object(setup.question))
    vlm = load_vlm(setup.model_path, device=request.device, clip_text=request.clip_text)
    from PIL import Image

    prepared = vlm.prepare(Image.fromarray(pixels), setup.question)
    if request.selectors:
        names, skipped = list(request.selectors), {}
    else:
        reasons = {name: _skip_reason(vlm, name) for name in list_selectors()}
        names = ["none", *(name for name, reason in reasons.items() if reason is None)]
        skipped = {name: reason for name, reason in reasons.items() if reason is not None}
    budget = resolve_budget(request.budget, prepared.num_visual) or max(1, prepared.num_visual // 4)
    panels = []
    for name in names:
        selector = None if name == "none" else options.get(name) or get_selector(name)
        if selector is not None:
            vlm.check_selector(selector)
        generator = torch.Generator().manual_seed(request.seed)
        answer = vlm.answer([prepared], selector, None if selector is None else budget, generator=[generator])[0]
        stages, layers, merged = recorded_stages(answer, prepared.num_visual)
        title = "none (unpruned)" if selector is None else f"{name}, budget {budget}"
        if name in options:
            title = f"{name} ({', '.join(request.options)}), budget {budget}"
        caption = _retention_text(mask, prepared.geometry, covered_stages(stages, merged)[0])
        caption += f"answer {answer.answer} (confidence {answer.confidence:.2f})"
        level = None if selector is None else selector.stage
        labels = stage_labels(level, stages, layers, merged, prepared.num_visual)
        panels.append(Panel(title, prepared.geometry, stages, labels, caption, mask, merged_cells(merged)))
    note = "not drawn: " + "; ".join(f"{name} ({reason})" for name, reason in skipped.items()) if skipped else ""
    out = output_path(request.out, FIGURES_DIR / request.image.stem, "tokens")
    return draw_panels(pixels, panels, out, suptitle=f"{setup.model_name} | {setup.question}", note=note)


def visualize_record(
    run_dir: Path, question_id: int, split: str | None, out: Path | None, stage: StageChoice = FIRST
) -> Path:
    """Redraw exactly the recorded kept sets of one question of a run (no model needed).

    Every stage is drawn at its recorded decoder layer; the title gives the retention of ``stage``.
    """
    import pyarrow.compute as pc

    from prune_audit.records.manifest import images_folder
    from prune_audit.records.store import read_run

    manifest, records = read_run(run_dir)
    match = pc.equal(records["question_id"], question_id)
    if split is not None:
        match = pc.and_(match, pc.equal(records["split"], split))
    rows = records.filter(match).to_pylist()
    if not rows:
        raise PruneAuditError(f"question {question_id} is not in {run_dir}; check --question-id (and --split)")
    if len(rows) > 1:
        raise PruneAuditError(f"question id {question_id} appears in splits {', '.join(r['split'] for r in rows)}; pass --split")
    row = rows[0]
    geometry = TokenGeometry(**json.loads(row["geometry"]))
    pixels = load_rgb(images_folder(manifest) / row["image"])
    annotations = manifest.get("annotations") or {}
    mask = None
    if annotations.get("path") and row["label"] == "yes":
        mask = object_mask(load_annotations(Path(annotations["path"])), row["image"], row["object"])
    stages = [list(k) for k in row["kept_stages"]]
    merged = row["merged_stages"]
    level = manifest["selector"]["stage"]
    labels = stage_labels(level, stages, row["stage_layers"], merged, geometry.num_tokens)
    selector, budget = manifest["selector"]["name"], manifest.get("budget")
    chosen = record_stage(stages, stage, str(run_dir), merged)
    retention = row["retention_stages"][chosen]
    title = f"{selector}, budget {budget}" if budget is not None else f"{selector} (unpruned)"
    caption = "" if retention is None or math.isnan(retention) else (
        f"retention {retention:.2f} at stage {stage.name} (layer {row['stage_layers'][chosen]})\n"
    )
    caption += f"answer {row['answer']} (confidence {row['confidence']:.2f}), label {row['label']}"
    panel = Panel(title, geometry, stages, labels, caption, mask, merged_cells(merged))
    out = output_path(out, FIGURES_DIR / Path(run_dir).resolve().name, f"tokens-{row['split']}-{question_id}")
    suptitle = f"{Path(manifest['model']['id']).name} | {row['object']} ({row['split']} #{question_id})"
    return draw_panels(pixels, [panel], out, suptitle=suptitle)
