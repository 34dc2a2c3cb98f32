"""``prune-audit visualize``: draw which tokens each selector keeps, live or from a run's records."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prune_audit.analysis.overlay import Panel, draw_panels
from prune_audit.data.geometry import TokenGeometry
from prune_audit.errors import PruneAuditError
from prune_audit.runner.safeguards import resolve_budget
from prune_audit.runner.build import last_visible_kept

if TYPE_CHECKING:
    from prune_audit.models import Answer

# COCO's most frequent POPE object; the demo model asks about its own first shape class instead
DEFAULT_QUESTION = "Is there a person in the image?"


@dataclass
class VisualizeRequest:
    image: Path
    model: str | None = None
    selectors: Sequence[str] = ()
    budget: int | None = None
    question: str | None = None
    annotations: Path | None = None
    out: Path | None = None
    device: str = "auto"
    seed: int = 0


def load_rgb(path: Path) -> np.ndarray:
    """(H, W, 3) uint8 pixels of an image file; a missing, corrupt or oversized file is a one-line error."""
    from prune_audit.data.images import open_rgb

    if not Path(path).is_file():
        raise PruneAuditError(f"image not found: {path}")
    return np.asarray(open_rgb(path))


def object_mask(annotations: Path | None, image_name: str, object_name: str | None) -> np.ndarray | None:
    """The queried object's mask (union of its instances) when annotations name the image."""
    if annotations is None or object_name is None:
        return None
    from prune_audit.data.coco import CocoInstances

    coco = CocoInstances.load(annotations)
    image_id = coco.image_id(Path(image_name).name)
    coco.category_id(object_name)
    return coco.category_mask(image_id, object_name)


def _question_object(question: str) -> str | None:
    from prune_audit.data.pope import parse_object

    try:
        return parse_object(question)
    except PruneAuditError:
        return None


def _retention_text(mask: np.ndarray | None, geometry: TokenGeometry, kept: Sequence[int]) -> str:
    if mask is None or not mask.any():
        return ""
    from prune_audit.data.retention import object_area, retention

    area = object_area(mask, geometry)
    retained, tokens, _ = retention(area.area_per_token, area.total_area, kept)
    return f" | retention {retained:.2f} ({tokens} object tokens)"


def _stage_labels(answer: Answer, num_visual: int) -> list[str]:
    if not answer.stage_layers:
        return [f"input: {len(answer.kept_stages[0]) if answer.kept_stages else num_visual} tokens"]
    return [f"layer {layer}: {len(kept)} tokens" for layer, kept in zip(answer.stage_layers, answer.kept_stages)]


def visualize_live(request: VisualizeRequest) -> Path:
    """Run the model under each selector on one image and draw one panel per selector."""
    import torch

    from prune_audit.models import load_vlm
    from prune_audit.pruners import get_selector

    if request.budget is not None and request.budget <= 0:
        raise PruneAuditError(f"--budget must be a positive number of visual tokens, got {request.budget}")
    pixels = load_rgb(request.image)
    model_path, question = request.model, request.question or DEFAULT_QUESTION
    if model_path is None:
        from prune_audit.data.pope_build import question_text
        from prune_audit.data.scenes import CATEGORIES
        from prune_audit.demo.assets import demo_assets

        model_path = str(demo_assets().model_dir)
        question = request.question or question_text(CATEGORIES[0])
    object_name = _question_object(question)
    mask = object_mask(request.annotations, request.image.name, object_name)
    vlm = load_vlm(model_path, device=request.device)
    from PIL import Image

    prepared = vlm.prepare(Image.fromarray(pixels), question)
    names = list(request.selectors) or ["none", *vlm.supported_selectors()]
    budget = resolve_budget(request.budget, prepared.num_visual) or max(1, prepared.num_visual // 4)
    panels = []
    for name in names:
        selector = None if name == "none" else get_selector(name)
        if selector is not None:
            vlm.check_selector(selector)
        generator = torch.Generator().manual_seed(request.seed)
        answer = vlm.answer([prepared], selector, None if selector is None else budget, generator=[generator])[0]
        stages = [list(k) for k in answer.kept_stages] or [list(range(prepared.num_visual))]
        title = f"{name}" + ("" if selector is None else f" @ {budget}")
        title += _retention_text(mask, prepared.geometry, last_visible_kept(answer.kept_stages, prepared.num_visual))
        caption = f"answer {answer.answer} (confidence {answer.confidence:.2f})"
        panels.append(Panel(title, prepared.geometry, stages, _stage_labels(answer, prepared.num_visual), caption, mask))
    out = request.out or Path(f"{request.image.stem}-tokens.png")
    suptitle = f"{Path(model_path).name} | {question}"
    return draw_panels(pixels, panels, out, suptitle=suptitle)


def visualize_record(run_dir: Path, question_id: int, split: str | None, out: Path | None) -> Path:
    """Redraw exactly the recorded kept sets of one question of a run (no model needed)."""
    import pyarrow.compute as pc

    from prune_audit.records.manifest import read_manifest
    from prune_audit.records.store import RecordStore

    manifest = read_manifest(run_dir)
    records = RecordStore(run_dir).read()
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
    pixels = load_rgb(Path(manifest["images"]) / row["image"])
    annotations = manifest.get("annotations") or {}
    mask = None
    if annotations.get("path") and row["label"] == "yes":
        mask = object_mask(Path(annotations["path"]), row["image"], row["object"])
    stages = [list(k) for k in row["kept_stages"]]
    schedule = (manifest.get("selector") or {}).get("schedule") or []
    labels = [f"layer {layer}: {len(kept)} tokens" for (layer, _), kept in zip(schedule, stages)] or [
        f"input: {len(stages[0])} tokens"
    ]
    selector = manifest["selector"]["name"]
    retention = row["retention"]
    title = f"{selector} @ {manifest.get('budget')}" + (
        "" if retention is None or math.isnan(retention) else f" | retention {retention:.2f}"
    )
    caption = f"answer {row['answer']} (confidence {row['confidence']:.2f}), label {row['label']}"
    panel = Panel(title, geometry, stages, labels, caption, mask)
    out = out or Path(run_dir) / f"tokens-{row['split']}-{question_id}.png"
    suptitle = f"{Path(manifest['model']['id']).name} | {row['object']} ({row['split']} #{question_id})"
    return draw_panels(pixels, [panel], out, suptitle=suptitle)
