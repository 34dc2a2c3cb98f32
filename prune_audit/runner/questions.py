"""``prune-audit run``'s questions: read from the task's files, their images and evidence checked, each one's prompt
prepared for the model and checked to fit its positions (planning writes nothing)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prune_audit.errors import PruneAuditError
from prune_audit.safety.inputs import check_input_file, path_under

if TYPE_CHECKING:
    from prune_audit.compute.budget import Budget
    from prune_audit.models import Prepared, VisionLanguageModel
    from prune_audit.pruners.composed import RunSelector
    from prune_audit.runner.request import RunRequest
    from prune_audit.tasks import Evidence, Task, TaskQuestion


def load_questions(task: Task, request: RunRequest) -> tuple[list[TaskQuestion], dict[str, bytes] | None]:
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


def check_images(
    request: RunRequest,
    questions: Sequence[TaskQuestion],
    embedded: dict[str, bytes] | None,
    run_dir: Path,
    task: Task | None = None,
) -> tuple[dict[str, Path], dict[str, tuple[int, int]]]:
    """Every image exists and decodes: its path and (width, height) by name, from ``--images`` or, for Parquet
    question files, from their embedded bytes (then written to ``run_dir``'s image folder, which becomes
    ``request.images``); a clip task's (``task.reads_clips``): each clip's frame folder and frame size
    (``runner.clips``)."""
    if task is not None and task.reads_clips:
        from prune_audit.runner.clips import check_clip_folders

        return check_clip_folders(request, task, questions)  # type: ignore[arg-type]  # reads_clips: a ClipTask
    if embedded is None:
        return _check_image_folder(request, questions)
    from prune_audit.runner.embedded import EMBEDDED_IMAGES, check_embedded_images

    checked = check_embedded_images(request.images, embedded, questions, run_dir)
    request.images = run_dir / EMBEDDED_IMAGES
    return checked


def _check_image_folder(
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


def load_evidence(
    task: Task,
    annotations: Path | None,
    questions: Sequence[TaskQuestion],
    image_paths: dict[str, Path],
    image_sizes: dict[str, tuple[int, int]],
) -> tuple[Evidence | None, dict[str, int]]:
    """The task's evidence from ``--annotations`` (without: what the questions carry themselves, if anything),
    checked against each image's size, and each image's id (from the evidence, else the task)."""
    if annotations is not None:
        evidence: Evidence | None = task.load_evidence(Path(annotations), questions)
    else:
        evidence = task.question_evidence(questions)
    image_ids = _image_ids(task, questions, evidence)
    if evidence is not None:
        for name, path in image_paths.items():
            evidence.check_image_size(name, image_sizes[name], path)
    return evidence, image_ids


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


def prepare_question(
    vlm: VisionLanguageModel,
    image_path: Path,
    text: str,
    data: bytes | None = None,
    selector: RunSelector | None = None,
    budget: Budget = None,
) -> Prepared:
    """The model's ``Prepared`` prompt for one image file (as RGB) and question text; ``data``: the image's bytes
    when they are embedded in the question files and not yet written to ``image_path`` (``runner.embedded``);
    ``selector`` and ``budget``: the run's, for a selector that acts on the image (``vlm.prepare_for``)."""
    from prune_audit.data.images import decode_rgb, open_rgb

    image = open_rgb(image_path) if data is None else decode_rgb(data, str(image_path))
    return vlm.prepare_for(image, text, selector, budget)


def prepare_task_question(
    vlm: VisionLanguageModel,
    task: Task,
    question: TaskQuestion,
    image_paths: dict[str, Path],
    embedded: dict[str, bytes] | None,
    selector: RunSelector | None = None,
    budget: Budget = None,
) -> Prepared:
    """One question prepared as ``task`` asks it, its image read from the folder or from the question files'
    embedded bytes, a clip task's clip from its frame folder (``runner.clips``; the first question's token grid and
    geometry describe the run in the manifest); ``selector`` and ``budget`` as :func:`prepare_question`."""
    if task.reads_clips:
        from prune_audit.runner.clips import prepare_clip

        text = task.prompt_text(question, vlm.task_instructions)
        return prepare_clip(vlm, task, question, image_paths[question.image], text)  # type: ignore[arg-type]
    return prepare_question(
        vlm,
        image_paths[question.image],
        task.prompt_text(question, vlm.task_instructions),
        (embedded or {}).get(question.image),
        selector,
        budget,
    )


def check_prompts_fit(
    vlm: VisionLanguageModel,
    task: Task,
    questions: Sequence[TaskQuestion],
    image_paths: dict[str, Path],
    embedded: dict[str, bytes] | None,
    *,
    chosen_limit: bool,
) -> None:
    """Every question's prompt, with ``--max-new-tokens`` where given (``chosen_limit``), fits the model's positions
    (``models.context``), checked before anything is written: each image is prepared once, with its question of
    most tokens (its other questions' prompts are no longer, to a token at the template's seams; ``answer``
    checks each batch exactly)."""
    from prune_audit.models.context import added_positions, check_context

    longest: dict[str, tuple[int, TaskQuestion]] = {}
    for question in questions:
        need = len(
            vlm.tokenizer.encode(task.prompt_text(question, vlm.task_instructions), add_special_tokens=False)
        ) + added_positions(vlm, task.answer_mode(question), chosen_limit=chosen_limit)
        if question.image not in longest or need > longest[question.image][0]:
            longest[question.image] = (need, question)
    for _, question in longest.values():
        prepared = prepare_task_question(vlm, task, question, image_paths, embedded)
        name = f"question {question.split}/{question.question_id}"
        check_context(vlm, [prepared], task.answer_mode(question), [name], chosen_limit=chosen_limit)
