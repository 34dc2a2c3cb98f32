"""``prune-audit run``, step 1: RunRequest -> RunPlan. Every input is validated, nothing is written.

Planning loads and checks every input (the task, its questions, images, annotations, selector
and its options, device, output directory, model) before anything is written, so a bad input
ends the command with one line and no run directory. The plan carries the manifest
draft that ``execute`` writes first. Each thing planned has its module: the request
(``runner.request``), the questions (``runner.questions``), the model and selector (``runner.model``),
the output folder (``runner.run_dir``) and imported kept sets (``runner.imported``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune_audit.compute.budget import Budget, ResolvedBudget, has_share, resolve_budget
from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import base_manifest, run_id_of
from prune_audit.runner.imported import check_imported_manifest, plan_import, restrict_questions
from prune_audit.runner.model import (
    check_device,
    check_model_accepts,
    load_model,
    make_selector,
    resolve_demo_defaults,
)
from prune_audit.runner.questions import (
    check_images,
    check_prompts_fit,
    load_evidence,
    load_questions,
    prepare_task_question,
)
from prune_audit.runner.request import RunRequest
from prune_audit.runner.run_dir import check_recorded, check_run_dir, run_dir_of
from prune_audit.runner.safeguards import check_resumable, check_run_options, pin_inputs
from prune_audit.runner.sharding import Shard, launcher_shard
from prune_audit.threads import check_threads, configure_threads

if TYPE_CHECKING:
    from prune_audit.models import Prepared, VisionLanguageModel
    from prune_audit.pruners.base import Selector
    from prune_audit.pruners.composed import RunSelector
    from prune_audit.runner.imported import ImportedAnswers
    from prune_audit.tasks import Evidence, Task, TaskQuestion


@dataclass
class RunPlan:
    """A validated run: questions, images, selector, model, output directory and manifest."""

    request: RunRequest
    task: Task
    questions: list[TaskQuestion]
    image_paths: dict[str, Path]
    image_ids: dict[str, int]
    selector: RunSelector | None
    budget: ResolvedBudget  # resolved on the first question (a composed selector: one per part)
    vlm: VisionLanguageModel
    evidence: Evidence | None
    run_dir: Path
    manifest: dict[str, Any]
    shard: Shard | None
    launched: bool = False
    imported: ImportedAnswers | None = None
    embedded_images: dict[str, bytes] | None = None  # images of Parquet question files (runner.embedded), by name


def plan_run(request: RunRequest, vlm: VisionLanguageModel | None = None) -> RunPlan:
    """Validate every input of the run; nothing is written.

    ``vlm``: a model already loaded with the request's model, device, dtype, prompt template and
    CLIP text tower (``study`` plans every run of its grid on one loaded model).
    """
    check_run_options(request.selector, request.budget, request.batch_size)
    check_threads(request.threads)
    launched = launcher_shard()
    if launched is not None and request.shard is not None:
        raise PruneAuditError("--shard cannot be combined with torchrun/accelerate launch; use one or the other")
    from prune_audit.tasks import get_task

    task = get_task(request.task, request.max_new_tokens, request.confidence)
    resolve_demo_defaults(request)
    selector = make_selector(request)
    budget = request.budget if selector is not None else None
    questions, embedded = load_questions(task, request)
    if request.kept_sets is not None:
        questions = restrict_questions(request.kept_sets, questions)
    run_dir = run_dir_of(request, selector)
    image_paths, image_sizes = check_images(request, questions, embedded, run_dir, task)
    evidence, image_ids = load_evidence(task, request.annotations, questions, image_paths, image_sizes)
    check_run_dir(run_dir)
    check_device(request.device)
    threads = configure_threads(request.threads)
    vlm = load_model(request) if vlm is None else vlm
    check_model_accepts(vlm, selector, task, questions)
    if request.kept_sets is None or request.reanswer:  # the model answers: every prompt must fit its positions
        check_prompts_fit(vlm, task, questions, image_paths, embedded, chosen_limit=request.max_new_tokens is not None)
    # as the run prepares it: a selector acting on the image refuses a budget no resized image meets here
    first = prepare_task_question(vlm, task, questions[0], image_paths, embedded, selector, budget)
    if task.reads_clips and selector is not None:  # the selector's signals on a clip (its temporal grid among them)
        vlm.check_selector(selector, [first])
    budget = resolve_budget(budget, first.budget_tokens)
    manifest = _manifest(request, task, vlm, selector, budget, questions, first)
    imported = plan_import(request, vlm, task, questions, image_paths, manifest, embedded)
    if has_share(request.budget):  # each image gets its share; the schedule above is the first's
        manifest["budget"] = _json_budget(request.budget)
    manifest["threads"] = threads
    pin_inputs(manifest, str(request.model), Path(request.images), _pinned(task, image_paths), embedded)
    manifest["run_id"] = run_id_of(manifest)
    if request.kept_sets is not None:
        check_imported_manifest(request.kept_sets, manifest)
    check_resumable(run_dir, manifest)
    check_recorded(run_dir, manifest, questions)
    shard = request.shard or launched
    return RunPlan(
        request,
        task,
        questions,
        image_paths,
        image_ids,
        selector,
        budget,
        vlm,
        evidence,
        run_dir,
        manifest,
        shard,
        launched is not None,
        imported,
        embedded,
    )


def _pinned(task: Task, image_paths: dict[str, Path]) -> dict[str, Path]:
    """The files the manifest pins by content: the images, or each clip's frames (``runner.clips.frame_pins``)."""
    if not task.reads_clips:
        return image_paths
    from prune_audit.runner.clips import frame_pins

    return frame_pins(image_paths)


def _manifest(
    request: RunRequest,
    task: Task,
    vlm: VisionLanguageModel,
    selector: RunSelector | None,
    budget: ResolvedBudget,
    questions: Sequence[TaskQuestion],
    first: Prepared,
) -> dict[str, Any]:
    from prune_audit.safety.fingerprint import file_sha256

    description = vlm.describe()
    manifest = base_manifest()
    manifest["task"] = task.name
    manifest["max_new_tokens"] = task.max_new_tokens
    manifest["confidence"] = task.confidence
    manifest.update(description)
    first_prompt = vlm.prompt(task.prompt_text(questions[0], vlm.task_instructions))
    manifest["prompt"] = {**manifest["prompt"], "first": first_prompt}
    manifest["processor"] = {**manifest.get("processor", {}), "first_image": first.geometry.to_dict()}
    manifest["selector"] = _selector_description(selector, budget, vlm, first.num_visual, first.video_grid)
    manifest["budget"] = _json_budget(budget)
    manifest["question_files"] = [{"path": str(p), "sha256": file_sha256(p)} for p in request.question_files]
    manifest["annotations"] = (
        {"path": str(request.annotations), "sha256": file_sha256(request.annotations)} if request.annotations else None
    )
    manifest["split"] = request.split or "all"
    manifest["limit"] = request.limit
    manifest["num_questions"] = len(questions)
    manifest["seed"] = request.seed
    manifest["command"] = request.command
    return manifest


def _json_budget(budget: Budget) -> int | str | list[int | str] | None:
    """A budget as the manifest holds it: a composed one as a JSON list, one per part."""
    return list(budget) if isinstance(budget, tuple) else budget


def _selector_description(
    selector: RunSelector | None,
    budget: ResolvedBudget,
    vlm: VisionLanguageModel,
    num_visual: int,
    video_grid: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """Name, options, position mode and (in-LLM) schedule for the first question's token count; a composed
    selector also names each part (``parts``: its own description and budget), its schedule solved on the
    tokens the input-level part feeds. On a clip (``video_grid``: the first's (T, h, w)) an input part run per
    temporal step says so (``per_frame``)."""
    from prune_audit.pruners.composed import ComposedSelector, budget_parts

    if selector is None:
        return {"name": "none", "stage": None, "options": {}, "positions": None, "schedule": None}
    if isinstance(selector, ComposedSelector):
        budgets = budget_parts(selector, budget)
        parts = [_part_description(selector.input, budgets[0], vlm, num_visual, video_grid)]
        parts.append(_part_description(selector.llm, budgets[1], vlm, min(budgets[0], num_visual)))
        for part, part_budget in zip(parts, budgets):
            part["budget"] = part_budget
        described = _part_description(selector.llm, budgets[1], vlm, parts[1]["schedule_num_visual"])
        return {**described, "name": selector.name, "stage": selector.stage, "options": selector.options(),
                "parts": parts}  # fmt: skip
    return _part_description(selector, budget, vlm, num_visual, video_grid)


def _part_description(
    selector: Selector,
    budget: int,
    vlm: VisionLanguageModel,
    num_visual: int,
    video_grid: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    from prune_audit.pruners.frame_scope import runs_per_frame

    # an image selector on a clip runs on each temporal step alone (pruners.frame_scope): a project convention
    frames = {"per_frame": True} if runs_per_frame(selector, video_grid) else {}
    planned = selector.stage == "llm" and not getattr(selector, "schedule_follows_tower", False)
    schedule = vlm.schedule(selector, num_visual, budget) if planned else None  # type: ignore[arg-type]  # in-LLM
    return {
        "name": selector.name,
        "stage": selector.stage,
        "options": selector.options(),
        "positions": vlm.positions_for(selector),
        "schedule": [[stage.layer, stage.keep] for stage in schedule] if schedule is not None else None,
        "schedule_num_visual": num_visual if planned else None,
        **frames,
    }
