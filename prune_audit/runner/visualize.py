"""``prune-audit visualize``: draw which tokens each selector keeps on an image (``visualize_record`` redraws a
run's recorded question)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prune_audit.analysis.overlay import Panel, draw_panels
from prune_audit.compute.budget import ResolvedBudget, budget_text, check_positive, resolve_budget
from prune_audit.data.geometry import TokenGeometry
from prune_audit.errors import PruneAuditError
from prune_audit.records.stages import budget_words
from prune_audit.runner.build import covered_stages, recorded_stages
from prune_audit.runner.run_dir import file_safe

if TYPE_CHECKING:
    from PIL.Image import Image

    from prune_audit.data.coco import CocoInstances
    from prune_audit.models import VisionLanguageModel
    from prune_audit.pruners.base import Selector
    from prune_audit.pruners.composed import RunSelector

FIGURES_DIR = Path("figures")
"""Default parent of ``visualize``'s output folder: figures/<image stem>/ (figures/<run name>/ with --run); the file is
tokens-<model>-<budget>.png (``live_stem``), or tokens-<split>-<question id>.png with --run."""

DEFAULT_SELECTORS = ("fastv", "sparsevlm", "visionzip", "divprune", "cdpruner", "random")
"""Drawn beside the unpruned model without --selector: one selector of each kind (in-LLM attention,
progressive, merging, diversity, text relevance, the random control), a grid that stays readable;
``--selector all`` draws every selector."""

ALL_SELECTORS = "all"


@dataclass
class VisualizeRequest:
    image: Path
    model: str | None = None
    selectors: Sequence[str] = ()
    options: Sequence[str] = ()
    budget: int | str | None = None
    question: str | None = None
    object_name: str | None = None
    annotations: Path | None = None
    out: Path | None = None
    clip_text: Path | None = None
    device: str = "auto"
    seed: int = 0


def output_path(out: Path | None, default_dir: Path, stem: str) -> Path:
    """``out`` itself when it names a .png/.svg file, else ``<out or default_dir>/<stem>.png``.

    The figure's folder may hold the user's files but not another command's outputs (a run,
    a calibration): figures go next to them, never into them. The default folder is prune-audit's
    own, so it is never written through a link (``check_owned_paths``).
    """
    from prune_audit.safety.ownership import check_output_dir, check_owned_paths

    path = out if out is not None and out.suffix.lower() in {".png", ".svg"} else (out or default_dir) / f"{stem}.png"
    check_output_dir(path.parent, "visualize", shared=True)
    if out is None:
        check_owned_paths(Path(), [path])
    return path


def load_rgb(path: Path) -> np.ndarray:
    """(H, W, 3) uint8 pixels of an image file; a missing, corrupt or oversized file is a one-line error."""
    from prune_audit.data.images import open_rgb

    return np.asarray(open_rgb(path))


def object_mask(
    coco: CocoInstances | None, image: Path, pixels: np.ndarray, object_name: str | None
) -> np.ndarray | None:
    """The queried object's mask (union of its instances) when the annotations name the image.

    The image file (``pixels``) must have the annotated size, else the mask would not line up.
    """
    if coco is None or object_name is None:
        return None
    image_id = coco.image_id(image.name)
    coco.check_image_size(image_id, (pixels.shape[1], pixels.shape[0]), image)
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


def most_visible_object(coco: CocoInstances, image_name: str, view: np.ndarray | None = None) -> str:
    """The annotated category covering the most pixels the model sees (ties: first annotated).

    ``view``: (H, W) bool, the pixels inside the model's token grid (None: the whole image). An
    object the preprocessing crops away cannot be the default; when every object is cropped away,
    the one covering the most of the whole image is.
    """
    image_id = coco.image_id(Path(image_name).name)
    names = coco.object_names(image_id)
    if not names:
        raise PruneAuditError(f"{image_name} has no annotated object; pass --object NAME")
    masks = {name: coco.category_mask(image_id, name) for name in names}
    seen = {name: int((mask & view).sum()) if view is not None else 0 for name, mask in masks.items()}
    if any(seen.values()):
        return max(names, key=seen.__getitem__)
    return max(names, key=lambda name: int(masks[name].sum()))


def _question_object(question: str) -> str | None:
    from prune_audit.data.pope import parse_object

    try:
        return parse_object(question)
    except PruneAuditError:
        return None


def _retention_text(mask: np.ndarray | None, geometry: TokenGeometry, covered: Sequence[int]) -> str:
    """Retention of ``covered`` (a stage's kept and merged cells, as the records' ``retention``), with the share of
    the object in the model's view when the preprocessing crops part of it away (retention cannot exceed it)."""
    if mask is None or not mask.any():
        return ""
    from prune_audit.data.retention import object_area, retention

    area = object_area(mask, geometry)
    retained, tokens, _ = retention(area.area_per_token, area.counted_area, covered)
    view = (
        ""
        if area.visible_fraction >= 1
        else (
            f"\nonly {area.visible_fraction:.0%} of the object in view"
            if area.visible_fraction > 0
            else "\nthe object is outside the model's view"
        )
    )
    return f"retention {retained:.2f} ({tokens} object token{'s' if tokens != 1 else ''}){view}"


def view_warning(mask: np.ndarray | None, geometry: TokenGeometry, object_name: str | None) -> str:
    """What to say when the queried object lies (partly) outside the model's view; empty when it is all inside."""
    if mask is None or not mask.any():
        return ""
    from prune_audit.data.retention import object_area

    visible = object_area(mask, geometry).visible_fraction
    if visible >= 1:
        return ""
    if visible == 0:
        return (
            f"the {object_name} lies outside the model's view (cropped away by its preprocessing): its retention "
            "is 0 whatever a selector keeps; ask about another object with --object NAME"
        )
    return (
        f"{1 - visible:.0%} of the {object_name} lies outside the model's view (cropped away by its "
        f"preprocessing): retention is at most {visible:.2f}"
    )


def stage_labels(
    level: str | None, kept_stages: list[list[int]], layers: list[int], merged_stages: list[list[list[int]]], total: int
) -> list[str]:
    """One label per stage: where it applies (``level`` "llm", and a composed selector's stages after its first:
    the decoder layer; else the input), how
    many of the ``total`` grid tokens it keeps, and how many merged tokens it feeds beside them."""
    from prune_audit.pruners.composed import COMPOSED_STAGE

    labels: list[str] = []
    for layer, kept, merged in zip(layers, kept_stages, merged_stages):
        where = f"layer {layer}" if level == "llm" or (level == COMPOSED_STAGE and labels) else "input"
        labels.append(f"{where}: kept {len(kept)} of {total}" + (f" + {len(merged)} merged" if merged else ""))
    return labels


def merged_cells(merged_stages: list[list[list[int]]]) -> list[list[int]]:
    """Per stage, the ascending grid cells its merged tokens carry."""
    return [sorted(set().union(*merged)) for merged in merged_stages]


@dataclass(frozen=True)
class LiveSetup:
    """What a live figure needs before the model runs: model, its display name, question, annotations.

    ``question`` is None when it asks about the annotated object the model sees most, which needs
    the model's view (``live_question``); ``warnings`` are said on stderr and under the figure.
    """

    model_path: str
    model_name: str
    question: str | None
    coco: CocoInstances | None
    warnings: tuple[str, ...] = ()


def demo_image_warning(name: str, image: Path) -> str:
    return (
        f"{image.name} is not one of the {name} model's scenes: it only knows its synthetic scenes of coloured "
        "shapes, so its answers and kept tokens on this image say nothing about a real model; pass --model "
        "MODEL for a real one"
    )


def live_setup(request: VisualizeRequest) -> LiveSetup:
    """Resolve the model, the annotations and the question.

    The question is --question, else the POPE question about --object, else (None) about the
    annotated object the model sees most. A bundled demo (no --model, or demo / demo-qwen) or a model
    ``demo train`` wrote reads the demo scene annotations when the image is one of its scenes; on any other image it warns that its
    figure means nothing and, without annotations, asks about its first shape class.
    """
    from prune_audit.data.pope_build import question_text
    from prune_audit.demo.assets import demo_assets, is_demo_name, is_demo_trained

    model_path, model_name, annotations = request.model, None, request.annotations
    fallback, warnings = None, []
    if model_path is None or is_demo_name(model_path) or is_demo_trained(model_path):
        from prune_audit.data.scenes import CATEGORIES

        trained = model_path is not None and not is_demo_name(model_path)  # a folder `demo train` wrote
        name = "demo" if trained else model_path or "demo"
        assets = demo_assets(name=name)
        model_path, model_name, fallback = (
            model_path if trained else str(assets.model_dir),
            None if trained else f"{name} model",
            CATEGORIES[0],
        )
        if _names_image(load_annotations(assets.annotations), request.image):
            annotations = annotations or assets.annotations
        else:
            warnings.append(demo_image_warning(name, request.image))
    coco = load_annotations(annotations)
    if request.question is not None:
        question = request.question
    elif request.object_name is not None:
        question = question_text(request.object_name)
    elif coco is not None:
        question = None
    elif fallback is not None:
        question = question_text(fallback)
    else:
        raise PruneAuditError(
            "which object to ask about? pass --object NAME, --question TEXT, or --annotations "
            "COCO_FILE (asks about the annotated object the model sees most)"
        )
    return LiveSetup(model_path, model_name or Path(model_path.rstrip("/")).name, question, coco, tuple(warnings))


PROBE_QUESTION = "Is there an object in the image?"
"""Any question: the model's view of an image (its token geometry) does not depend on the question."""


def live_question(vlm: VisionLanguageModel, picture: Image, setup: LiveSetup, image_name: str) -> str:
    """``setup``'s question, or the POPE question about the annotated object with the most pixels in the
    model's view."""
    if setup.question is not None:
        return setup.question
    from prune_audit.analysis.overlay import outside_view
    from prune_audit.data.pope_build import question_text

    assert setup.coco is not None  # live_setup leaves the question open only with annotations
    view = ~outside_view(vlm.prepare(picture, PROBE_QUESTION).geometry)
    return question_text(most_visible_object(setup.coco, image_name, view))


def selector_options(names: Sequence[str], pairs: Sequence[str]) -> dict[str, Selector]:
    """``{name: selector built with the KEY=VALUE pairs}`` for the one selector besides none (empty
    without pairs); options with no or several such selectors are a one-line error."""
    if not pairs:
        return {}
    from prune_audit.pruners.composed import parse_selector

    pruned = [name for name in names if name != "none"]
    if len(pruned) != 1:
        raise PruneAuditError(
            f"--option applies to one selector: pass exactly one --selector besides none, got {len(pruned)}"
        )
    return {pruned[0]: parse_selector(pruned[0], pairs)}


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


@dataclass(frozen=True)
class PanelAnswer:
    """The model's answer in one panel, named by the panel's title (selector and budget)."""

    panel: str
    answer: str
    confidence: float


@dataclass(frozen=True)
class DrawnFigure:
    """The figure ``visualize`` wrote and what the user is told about it on the terminal.

    ``question``: the question asked; ``answers``: one per panel; ``notes``: the selectors not
    drawn and those available (also under the figure); ``warnings``: said on stderr and under
    the figure.
    """

    path: Path
    question: str = ""
    answers: tuple[PanelAnswer, ...] = ()
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def drawn_selectors(vlm: VisionLanguageModel, requested: Sequence[str]) -> tuple[list[str], str]:
    """(the selectors to draw, the note on those not drawn): ``requested`` as given; nothing or ``all``:
    none plus every selector the model can run, of ``DEFAULT_SELECTORS`` or of all of them; the
    others are listed with the reason (or as available with --selector)."""
    from prune_audit.pruners import list_selectors

    if requested and ALL_SELECTORS not in requested:
        return list(requested), ""
    candidates = list_selectors() if requested else [name for name in DEFAULT_SELECTORS if name in list_selectors()]
    reasons = {name: _skip_reason(vlm, name) for name in candidates}
    names = ["none", *(name for name, reason in reasons.items() if reason is None)]
    notes = []
    skipped = [f"{name} ({reason})" for name, reason in reasons.items() if reason is not None]
    if skipped:
        notes.append("not drawn: " + "; ".join(skipped))
    others = [name for name in list_selectors() if name not in candidates]
    if others:
        notes.append(f"also available: {', '.join(others)} (--selector NAME, or --selector all for every selector)")
    return names, "\n".join(notes)


def live_stem(model_name: str, budget: ResolvedBudget) -> str:
    """The live figure's file stem, tokens-<model>-<budget> (a composed budget's parts joined by ``_``): another
    model or budget on the same image never overwrites it."""
    return f"tokens-{file_safe(model_name)}-{budget_text(budget).replace(',', '_')}"


def _panel_title(
    name: str, selector: RunSelector | None, options: Sequence[str], budget: ResolvedBudget, layers: list[int]
) -> str:
    """``fastv, budget 64 (layer average)``, with the ``--option`` pairs after a selector that took them."""
    if selector is None:
        return "none (unpruned)"
    shown = f"{name} ({', '.join(options)})" if options else name
    return f"{shown}, {budget_words(budget, layers, selector.averages_budget)}"


def drawn_with_budget(
    names: Sequence[str], options: dict[str, RunSelector], budget: ResolvedBudget
) -> dict[str, RunSelector | None]:
    """``{name: selector}`` to draw (None: the unpruned model), a composed one too (``visionzip+fastv``), each
    taking ``budget``: one budget per part, else refused in one line before the model runs."""
    from prune_audit.compute.budget import check_budget_parts
    from prune_audit.pruners.composed import parse_selector, part_count

    selectors: dict[str, RunSelector | None] = {}
    for name in names:
        selector = None if name == "none" else options.get(name) or parse_selector(name, [])
        if selector is not None:
            check_budget_parts(budget, part_count(selector), name)
        selectors[name] = selector
    return selectors


def visualize_live(request: VisualizeRequest) -> DrawnFigure:
    """Run the model under each selector on one image and draw one panel (grid cell) per selector.

    Without --selector the unpruned model and the ``DEFAULT_SELECTORS`` the model can run are
    drawn (--selector all: every selector); the others are listed, with the reason, under the grid.
    """
    import torch

    from prune_audit.models import load_vlm

    check_positive(request.budget)  # a share (11%) or all is checked by resolve_budget
    options = selector_options(request.selectors, request.options)
    pixels = load_rgb(request.image)
    setup = live_setup(request)
    vlm = load_vlm(setup.model_path, device=request.device, clip_text=request.clip_text)
    from PIL import Image

    picture = Image.fromarray(pixels)
    question = live_question(vlm, picture, setup, request.image.name)
    object_name = _question_object(question)
    mask = object_mask(setup.coco, request.image, pixels, object_name)
    vlm.check_question(question)
    prepared = vlm.prepare(picture, question)
    warnings = [*setup.warnings, *filter(None, [view_warning(mask, prepared.geometry, object_name)])]
    names, note = drawn_selectors(vlm, request.selectors)
    budget = resolve_budget(request.budget, prepared.num_visual) or max(1, prepared.num_visual // 4)
    selectors = drawn_with_budget(names, options, budget)
    panels, answers = [], []
    for name, selector in selectors.items():
        if selector is not None:
            vlm.check_selector(selector)
        generator = torch.Generator().manual_seed(request.seed)
        item = prepared if selector is None else vlm.prepare_for(picture, question, selector, budget)  # may resize it
        answer = vlm.answer([item], selector, None if selector is None else budget, generator=[generator])[0]
        stages, layers, merged = recorded_stages(answer, item.num_visual)
        title = _panel_title(name, selector, request.options if name in options else [], budget, layers)
        retention = _retention_text(mask, item.geometry, covered_stages(stages, merged)[0])
        caption = f"answer {answer.answer} (confidence {answer.confidence:.3f})"
        answers.append(PanelAnswer(title, answer.answer, answer.confidence))
        level = None if selector is None else selector.stage
        labels = stage_labels(level, stages, layers, merged, item.num_visual)
        panels.append(
            Panel(
                title,
                item.geometry,
                stages,
                labels,
                caption,
                mask,
                merged_cells(merged),
                stage_notes={0: retention} if retention else {},
            )
        )
    notes = tuple(note.splitlines())
    note = "\n".join(["\n".join(f"Warning: {text}." for text in warnings), note]).strip()
    out = output_path(request.out, FIGURES_DIR / request.image.stem, live_stem(setup.model_name, budget))
    path = draw_panels(pixels, panels, out, suptitle=f"{setup.model_name} | {question}", note=note)
    return DrawnFigure(path, question, tuple(answers), notes, tuple(warnings))
