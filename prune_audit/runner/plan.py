"""``prune-audit run``, step 1: RunRequest -> RunPlan. Every input is validated, nothing is written.

Planning loads and checks every input (the task, its questions, images, annotations, selector
and its options, device, output directory, model) before anything is written, so a bad input
ends the command with one line and no run directory. The plan carries the manifest
draft that ``execute`` writes first.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune_audit.compute.budget import budget_share, resolve_budget
from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import MANIFEST_FILE, base_manifest, run_id_of
from prune_audit.records.store import RecordStore, check_run_layout
from prune_audit.runner.safeguards import check_resumable, check_run_options, pin_inputs
from prune_audit.runner.sharding import Shard, launcher_shard
from prune_audit.safety.inputs import check_input_file, path_under
from prune_audit.safety.ownership import check_output_dir
from prune_audit.threads import check_threads, configure_threads

if TYPE_CHECKING:
    from prune_audit.models import Prepared, VisionLanguageModel
    from prune_audit.pruners.base import Selector
    from prune_audit.records.interchange import KeptSets
    from prune_audit.runner.imported import ImportedAnswers
    from prune_audit.tasks import Evidence, Task, TaskQuestion


@dataclass
class RunRequest:
    """What the user asked for, as given on the command line."""

    model: str | None = None
    selector: str = "none"
    budget: int | str | None = None  # tokens, or "all"
    options: list[str] = field(default_factory=list)  # KEY=VALUE strings
    question_files: list[Path] = field(default_factory=list)  # the task's question files (--pope, or --questions)
    task: str = "pope"
    max_new_tokens: int | None = None  # generating tasks only; None: the task's default
    confidence: str | None = None  # generating tasks only (Task.confidences); None: the task's default
    split: str | None = None
    images: Path | None = None
    annotations: Path | None = None
    out: Path | None = None
    limit: int | None = None
    batch_size: int = 16
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    shard: Shard | None = None
    prompt_template: str | None = None
    clip_text: Path | None = None
    threads: int | None = None
    command: str = ""
    kept_sets: KeptSets | None = None  # ``import``: the answers' kept sets (questions restricted to the file's)
    reanswer: bool = False  # ``import --model``: the model answers under the imported kept sets


@dataclass
class RunPlan:
    """A validated run: questions, images, selector, model, output directory and manifest."""

    request: RunRequest
    task: Task
    questions: list[TaskQuestion]
    image_paths: dict[str, Path]
    image_ids: dict[str, int]
    selector: Selector | None
    budget: int | None
    vlm: VisionLanguageModel
    evidence: Evidence | None
    run_dir: Path
    manifest: dict[str, Any]
    shard: Shard | None
    launched: bool = False
    imported: ImportedAnswers | None = None
    embedded_images: dict[str, bytes] | None = None  # images of Parquet question files (runner.embedded), by name



# ----- planning ------------------------------------------------------------------------


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
    _resolve_demo_defaults(request)
    selector, budget = _make_selector(request)
    questions, embedded = _load_questions(task, request)
    if request.kept_sets is not None:
        from prune_audit.runner.imported import restrict_questions

        questions = restrict_questions(request.kept_sets, questions)
    run_dir = _run_dir(request, selector)
    if embedded is None:
        image_paths, image_sizes = _check_images(request, questions)
    else:
        from prune_audit.runner.embedded import EMBEDDED_IMAGES, check_embedded_images

        image_paths, image_sizes = check_embedded_images(request.images, embedded, questions, run_dir)
        request.images = run_dir / EMBEDDED_IMAGES
    evidence = task.load_evidence(Path(request.annotations), questions) if request.annotations is not None else None
    image_ids = _image_ids(task, questions, evidence)
    if evidence is not None:
        for name, path in image_paths.items():
            evidence.check_image_size(name, image_sizes[name], path)
    check_output_dir(run_dir, "run")
    check_run_layout(run_dir)
    check_writable(run_dir)
    check_device(request.device)
    threads = configure_threads(request.threads)
    if vlm is None:
        from prune_audit.models import load_vlm

        vlm = load_vlm(
            request.model,
            device=request.device,
            dtype=request.dtype,
            prompt_template=request.prompt_template,
            clip_text=request.clip_text,
            geometry_only=request.kept_sets is not None and not request.reanswer,
        )
    if selector is not None:
        vlm.check_selector(selector)
    for mode in dict.fromkeys(task.answer_mode(question) for question in questions):
        vlm.check_answer_mode(mode)
    for text in dict.fromkeys(question.text for question in questions):
        vlm.check_question(text)
    if request.kept_sets is None or request.reanswer:  # the model answers: every prompt must fit its positions
        _check_context(vlm, task, questions, image_paths, embedded, chosen_limit=request.max_new_tokens is not None)
    first = _prepare(vlm, task, questions[0], image_paths, embedded)
    budget = resolve_budget(budget, first.num_visual)
    manifest = _manifest(request, task, vlm, selector, budget, questions, first)
    imported = _imported(request, vlm, task, questions, image_paths, manifest, embedded)
    if budget_share(request.budget) is not None:  # each image gets its share; the schedule above is the first's
        manifest["budget"] = request.budget
    manifest["threads"] = threads
    pin_inputs(manifest, str(request.model), Path(request.images), image_paths, embedded)
    manifest["run_id"] = run_id_of(manifest)
    if request.kept_sets is not None:
        from prune_audit.runner.imported import check_imported_manifest

        check_imported_manifest(request.kept_sets, manifest)
    check_resumable(run_dir, manifest)
    check_recorded(run_dir, manifest, questions)
    shard = request.shard or launched
    return RunPlan(request, task, questions, image_paths, image_ids, selector, budget, vlm, evidence, run_dir,
                   manifest, shard, launched is not None, imported, embedded)


def _imported(request: RunRequest, vlm: VisionLanguageModel, task: Task, questions: Sequence[TaskQuestion],
              image_paths: dict[str, Path], manifest: dict[str, Any],
              embedded: dict[str, bytes] | None) -> ImportedAnswers | None:
    """``import``: the kept sets checked on each image's prompt, the import recorded in the manifest."""
    if request.kept_sets is None:
        return None
    from prune_audit.safety.fingerprint import file_sha256
    from prune_audit.runner.imported import (
        ImportedAnswers,
        check_answers,
        check_kept_sets,
        imported_selector,
    )

    first_question = {question.image: question for question in reversed(questions)}
    prepared = {image: _prepare(vlm, task, question, image_paths, embedded)
                for image, question in first_question.items()}
    check_kept_sets(request.kept_sets, vlm, prepared, request.reanswer)
    if not request.reanswer:
        check_answers(request.kept_sets, task, questions)
    sha256 = file_sha256(request.kept_sets.path)
    manifest["selector"] = imported_selector(request.kept_sets, sha256, request.reanswer)
    manifest["budget"] = request.kept_sets.header.get("budget")
    by_key = {(line.split, line.question_id): line for line in request.kept_sets.questions}
    return ImportedAnswers(by_key, request.reanswer)


def check_recorded(run_dir: Path, manifest: dict[str, Any], questions: Sequence[TaskQuestion]) -> None:
    """The records already in ``run_dir`` are this run's own (``RecordStore.read`` checks their run id, keys
    and positions) and answer only questions of the plan: refused before any question is answered."""
    if not (run_dir / MANIFEST_FILE).is_file():
        return  # nothing recorded: check_run_layout refused records without a manifest
    planned = {(q.split, q.question_id) for q in questions}
    recorded = RecordStore(run_dir, manifest).read()
    unknown = sorted(set(zip(recorded["split"].to_pylist(), recorded["question_id"].to_pylist())) - planned)
    if unknown:
        raise PruneAuditError(
            f"{run_dir} holds records of {len(unknown)} questions outside this run's question list (first "
            f"{unknown[0][0]}/{unknown[0][1]}); remove the folder, or re-run into a new --out"
        )


def _prepare(vlm: VisionLanguageModel, task: Task, question: TaskQuestion, image_paths: dict[str, Path],
             embedded: dict[str, bytes] | None) -> Prepared:
    """One question prepared as ``task`` asks it, its image read from the folder or from the question files'
    embedded bytes (the first question's token grid and geometry describe the run in the manifest)."""
    return prepare_question(vlm, image_paths[question.image], task.prompt_text(question, vlm.task_instructions),
                            (embedded or {}).get(question.image))


def _check_context(vlm: VisionLanguageModel, task: Task, questions: Sequence[TaskQuestion],
                   image_paths: dict[str, Path], embedded: dict[str, bytes] | None, *, chosen_limit: bool) -> None:
    """Every question's prompt, with ``--max-new-tokens`` where given (``chosen_limit``), fits the model's positions
    (``models.context``), checked before anything is written: each image is prepared once, with its question of
    most tokens (its other questions' prompts are no longer, to a token at the template's seams; ``answer``
    checks each batch exactly)."""
    from prune_audit.models.context import added_positions, check_context

    longest: dict[str, tuple[int, TaskQuestion]] = {}
    for question in questions:
        need = (len(vlm.tokenizer.encode(task.prompt_text(question, vlm.task_instructions), add_special_tokens=False))
                + added_positions(vlm, task.answer_mode(question), chosen_limit=chosen_limit))
        if question.image not in longest or need > longest[question.image][0]:
            longest[question.image] = (need, question)
    for _, question in longest.values():
        prepared = _prepare(vlm, task, question, image_paths, embedded)
        name = f"question {question.split}/{question.question_id}"
        check_context(vlm, [prepared], task.answer_mode(question), [name], chosen_limit=chosen_limit)


def prepare_question(vlm: VisionLanguageModel, image_path: Path, text: str, data: bytes | None = None) -> Prepared:
    """The model's ``Prepared`` prompt for one image file (as RGB) and question text; ``data``: the image's bytes
    when they are embedded in the question files and not yet written to ``image_path`` (``runner.embedded``)."""
    from prune_audit.data.images import decode_rgb, open_rgb

    return vlm.prepare(open_rgb(image_path) if data is None else decode_rgb(data, str(image_path)), text)


def _resolve_demo_defaults(request: RunRequest) -> None:
    from prune_audit.demo import default_demo
    from prune_audit.demo.assets import demo_assets, is_demo_name, is_demo_trained

    named_demo = is_demo_name(request.model)
    if request.model is not None and not named_demo and request.question_files:
        return
    geometry_only = request.kept_sets is not None and not request.reanswer  # import's --geometry is never run
    if request.model is not None and not named_demo and not geometry_only and not is_demo_trained(request.model):
        raise PruneAuditError("--model needs questions: pass --pope FILE... (another --task: --questions FILE...) with "
                              "--images DIR (and --annotations FILE for retention)")
    demo = demo_assets(name=request.model if named_demo else default_demo([request.task]))
    request.model = request.model if request.model is not None and not named_demo else str(demo.model_dir)
    if not request.question_files:
        questions, evidence = demo.questions(request.task)
        request.question_files = list(questions)
        request.images = request.images or demo.images_dir
        request.annotations = request.annotations or evidence


def _make_selector(request: RunRequest) -> tuple[Selector | None, int | str | None]:
    if request.selector == "none":
        if request.options:
            raise PruneAuditError("--option needs a selector; the unpruned run (--selector none) has no options")
        return None, None
    from prune_audit.pruners.registry import selector_from_strings

    depth = _model_depth(request.model) if request.options else None
    selector = selector_from_strings(request.selector, request.options, depth)  # every option against its domain
    return selector, request.budget  # its domain: check_run_options


def _model_depth(model: str | None) -> int | None:
    """The model's decoder layers from its config (no weights), for the words of a refused layer option; None when
    it cannot be read here (loading the model names the problem)."""
    from prune_audit.models.loading import checkpoint_family

    try:
        return checkpoint_family(model)[1] if model is not None else None
    except (PruneAuditError, OSError, ValueError):
        return None


def _load_questions(task: Task, request: RunRequest) -> tuple[list[TaskQuestion], dict[str, bytes] | None]:
    """The run's questions, and the images its Parquet question files embed (``Task.load_questions``)."""
    if request.split not in (None, "all", *task.splits):
        if not task.splits:
            raise PruneAuditError(f"task {task.name} has no splits; drop --split {request.split}")
        raise PruneAuditError(f"--split must be one of {', '.join(task.splits)} or all, got {request.split!r}")
    for path in request.question_files:
        check_input_file(path, "question file", f"pass an existing {task.name} question file")
    questions, embedded = task.load_questions([Path(path) for path in request.question_files])
    if request.split not in (None, "all"):
        questions = [q for q in questions if q.split == request.split]
    keys = [(q.split, q.question_id) for q in questions]
    if len(set(keys)) != len(keys):
        raise PruneAuditError("the question files repeat a (split, question_id); pass each split's file once")
    task.check_questions(questions)
    if request.limit is not None:
        if request.limit <= 0:
            raise PruneAuditError(f"--limit must be positive, got {request.limit}")
        questions = questions[: request.limit]
    if not questions:
        raise PruneAuditError("no questions to run; check the question files and --split")
    return questions, embedded


def _check_images(
    request: RunRequest, questions: Sequence[TaskQuestion]
) -> tuple[dict[str, Path], dict[str, tuple[int, int]]]:
    """Every image exists and decodes: its path and (width, height) by name (a corrupt, oversized
    or out-of-range file fails here, before any output)."""
    from prune_audit.data.images import open_rgb

    if request.images is None:
        raise PruneAuditError("pass --images DIR, the folder holding the question files' images")
    paths: dict[str, Path] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for name in dict.fromkeys(q.image for q in questions):
        path = path_under(request.images, name, "the question files")
        sizes[name] = open_rgb(path).size  # refuses a missing file, a folder, a FIFO or a device in one line
        paths[name] = path
    return paths, sizes


def _image_ids(task: Task, questions: Sequence[TaskQuestion], evidence: Evidence | None) -> dict[str, int]:
    ids: dict[str, int] = {}
    for question in questions:
        if question.image in ids:
            continue
        image_id = evidence.image_id(question.image) if evidence is not None else task.image_id(question)
        if image_id is None:
            raise PruneAuditError(f"cannot tell the image id of {question.image!r}; pass --annotations")
        ids[question.image] = int(image_id)
    return ids


def _run_dir(request: RunRequest, selector: Selector | None) -> Path:
    """--out, else runs/<model>[-<task>]-<selector>-<budget>[-<each option that differs from its default>][-limit<N>].

    The limit is part of the name so that a quick try (``--limit 200``) never lands in, or is refused
    by, the folder of the full run of the same settings; so is every task but POPE, so that one model's
    runs of several tasks each get their own folder.
    """
    if request.out is not None:
        return Path(request.out)
    model_name = file_safe(Path(str(request.model).rstrip("/")).name) or "model"
    prefix = [model_name] if request.task == "pope" else [model_name, request.task]
    parts = [*prefix, "dense"] if selector is None else [*prefix, request.selector, str(request.budget),
                                                         *_changed_options(selector)]
    if request.limit is not None:
        parts.append(f"limit{request.limit}")
    return Path("runs") / "-".join(parts)


def file_safe(text: str) -> str:
    """``text`` with every run of characters outside [A-Za-z0-9._-] turned into one "-" (a file-name part)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)


def _changed_options(selector: Selector) -> list[str]:
    """Name parts of the options that differ from the defaults: budget_rule=paper -> "paper", alpha=0.5 -> "alpha0.5"."""
    from prune_audit.pruners.base import option_defaults

    defaults = option_defaults(type(selector))
    changed = sorted((key, value) for key, value in selector.options().items() if defaults.get(key, value) != value)
    return [file_safe(str(value) if key == "budget_rule" else f"{key}{value}") for key, value in changed]


def check_writable(run_dir: Path) -> None:
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PruneAuditError(f"cannot write the run directory {run_dir} ({existing} is not writable); pass a writable --out")


def check_device(device: str) -> None:
    if device not in {"auto", "cpu", "cuda"} and not device.startswith("cuda:"):
        raise PruneAuditError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise PruneAuditError("--device cuda was requested but CUDA is not available; use --device cpu or auto")


def _manifest(
    request: RunRequest,
    task: Task,
    vlm: VisionLanguageModel,
    selector: Selector | None,
    budget: int | None,
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
    manifest["selector"] = _selector_description(selector, budget, vlm, first.num_visual)
    manifest["budget"] = budget
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


def _selector_description(
    selector: Selector | None, budget: int | None, vlm: VisionLanguageModel, num_visual: int
) -> dict[str, Any]:
    """Name, options, position mode and (in-LLM) schedule for the first question's token count."""
    if selector is None:
        return {"name": "none", "stage": None, "options": {}, "positions": None, "schedule": None}
    llm = selector.stage == "llm"
    schedule = vlm.schedule(selector, num_visual, budget) if llm else None
    return {
        "name": selector.name,
        "stage": selector.stage,
        "options": selector.options(),
        "positions": vlm.positions_for(selector),
        "schedule": [[stage.layer, stage.keep] for stage in schedule] if schedule is not None else None,
        "schedule_num_visual": num_visual,
    }
