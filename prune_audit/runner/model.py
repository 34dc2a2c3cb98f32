"""``prune-audit run``'s model and selector: the bundled demo's defaults, the selector and its options, the device,
the loaded model and what it must accept (the selector, the task's answer modes, the question texts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prune_audit.errors import PruneAuditError

if TYPE_CHECKING:
    from prune_audit.models import VisionLanguageModel
    from prune_audit.pruners.composed import RunSelector
    from prune_audit.runner.request import RunRequest
    from prune_audit.tasks import Task, TaskQuestion


def resolve_demo_defaults(request: RunRequest) -> None:
    """A bundled demo named by ``--model`` (or none given) becomes its folder, and its question files, images
    and annotations fill what the request leaves out; a model of one's own needs its questions."""
    from prune_audit.demo import default_demo
    from prune_audit.demo.assets import demo_assets, is_demo_name, is_demo_trained

    named_demo = is_demo_name(request.model)
    if request.model is not None and not named_demo and request.question_files:
        return
    geometry_only = request.kept_sets is not None and not request.reanswer  # import's --geometry is never run
    if request.model is not None and not named_demo and not geometry_only and not is_demo_trained(request.model):
        raise PruneAuditError(
            "--model needs questions: pass --pope FILE... (another --task: --questions FILE...) with "
            "--images DIR (and --annotations FILE for retention)"
        )
    demo = demo_assets(name=request.model if named_demo else default_demo([request.task]))
    request.model = request.model if request.model is not None and not named_demo else str(demo.model_dir)
    if not request.question_files:
        questions, images, evidence = demo.questions(request.task)
        request.question_files = list(questions)
        request.images = request.images or images
        request.annotations = request.annotations or evidence


def make_selector(request: RunRequest) -> RunSelector | None:
    """The request's selector with its options, each checked against its domain, and one budget per part of a
    composed selector (None: the unpruned run)."""
    if request.selector == "none":
        if request.options:
            raise PruneAuditError("--option needs a selector; the unpruned run (--selector none) has no options")
        return None
    from prune_audit.compute.budget import check_budget_parts
    from prune_audit.pruners.composed import parse_selector, part_count

    depth = _model_depth(request.model) if request.options else None
    selector = parse_selector(request.selector, request.options, depth)  # every option against its domain
    check_budget_parts(request.budget, part_count(selector), request.selector)
    return selector


def _model_depth(model: str | None) -> int | None:
    """The model's decoder layers from its config (no weights), for the words of a refused layer option; None when
    it cannot be read here (loading the model names the problem)."""
    from prune_audit.models.loading import checkpoint_family

    try:
        return checkpoint_family(model)[1] if model is not None else None
    except (PruneAuditError, OSError, ValueError):
        return None


def check_device(device: str) -> None:
    if device not in {"auto", "cpu", "cuda"} and not device.startswith("cuda:"):
        raise PruneAuditError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise PruneAuditError("--device cuda was requested but CUDA is not available; use --device cpu or auto")


def load_model(request: RunRequest) -> VisionLanguageModel:
    """The request's model on its device, dtype, prompt template and CLIP text tower (an import without ``--model``
    needs only its token geometry)."""
    from prune_audit.models import load_vlm

    return load_vlm(
        request.model,
        device=request.device,
        dtype=request.dtype,
        prompt_template=request.prompt_template,
        clip_text=request.clip_text,
        geometry_only=request.kept_sets is not None and not request.reanswer,
    )


def check_model_accepts(
    vlm: VisionLanguageModel, selector: RunSelector | None, task: Task, questions: Sequence[TaskQuestion]
) -> None:
    """The task takes the model's family conventions (``Task.use_model``); the model runs the selector (a clip task:
    reads clips, and the selector acts on them), answers in each of the task's answer modes and takes every
    question's text."""
    task.use_model(vlm)
    if task.reads_clips:  # the selector's clip signals are checked on the first prepared clip (``plan_run``)
        from prune_audit.runner.clips import check_clip_model

        check_clip_model(vlm, selector, task)
    elif selector is not None:
        vlm.check_selector(selector)
    for mode in dict.fromkeys(task.answer_mode(question) for question in questions):
        vlm.check_answer_mode(mode)
    for text in dict.fromkeys(question.text for question in questions):
        vlm.check_question(text)
