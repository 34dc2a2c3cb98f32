"""``prune-audit fitprune fit``: attention statistics of calibration questions, a FitPrune schedule fitted on them
per budget, written to a new schedule file with its provenance (``pruners.fitprune``).

Everything is checked before the model runs and the file is written once, atomically, at the end; an existing
file is never replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune_audit.errors import PruneAuditError

if TYPE_CHECKING:
    from collections.abc import Callable

    from prune_audit.pruners.fitprune import FitResult, FittedSchedules
    from prune_audit.runner.request import RunRequest
    from prune_audit.tasks import TaskQuestion


def check_schedule_out(out: Path) -> Path:
    """``out`` as a new file in an existing folder (one-line refusal otherwise; nothing is written)."""
    if out.exists() or out.is_symlink():
        raise PruneAuditError(f"--out {out} exists; pass a new file name (a schedule file is never replaced)")
    if not out.parent.is_dir():
        raise PruneAuditError(f"--out {out}: its folder {out.parent} does not exist; create it or pick another")
    if out.suffix != ".json":
        raise PruneAuditError(f"--out {out} must end in .json (a FitPrune schedule file is JSON)")
    return out


def fit_schedule_file(request: RunRequest, budgets: list[int], out: Path) -> FittedSchedules:
    """Fit one schedule per budget on ``request``'s questions and model; write them to ``out`` (new)."""
    import torch

    from prune_audit.models.attention_statistics import attention_statistics
    from prune_audit.pruners.fitprune import (
        FittedSchedule,
        FittedSchedules,
        budget_for_fit,
        fit_schedule,
        schedules_json,
    )
    from prune_audit.runner.model import load_model, resolve_demo_defaults
    from prune_audit.runner.questions import check_images, load_questions, prepare_task_question
    from prune_audit.safety.atomic import write_text_atomic
    from prune_audit.tasks import get_task

    check_schedule_out(out)
    if not budgets or len(set(budgets)) != len(budgets):
        raise PruneAuditError("--budget must be given at least once, each budget once")
    resolve_demo_defaults(request)
    task = get_task(request.task)
    questions, embedded = load_questions(task, request)
    if embedded is not None:
        raise PruneAuditError("fitprune fit reads question files with an --images folder, not Parquet files")
    images, _ = check_images(request, questions, embedded, out.parent, task)
    vlm = load_model(request)
    prepared = [prepare_task_question(vlm, task, q, images, embedded) for q in questions]
    shapes = {(item.num_visual, tuple(item.grid)) for item in prepared}
    if len(shapes) != 1:
        raise PruneAuditError("the questions' images give different token grids; fit on images of one size")
    num_visual = prepared[0].num_visual
    checked = [_checked(budget, num_visual, budget_for_fit) for budget in budgets]
    with torch.inference_mode():
        statistics = [attention_statistics(vlm, item) for item in prepared]
    fits = [(budget, fit_schedule(statistics, budget)) for budget in checked]
    fitted = FittedSchedules(
        statistics[0].cross.shape[0] + 1,
        num_visual,
        tuple(FittedSchedule(f"budget {b}", fit.removed, round(fit.alpha, 6)) for b, fit in fits),
        _provenance(request, questions, fits),
    )
    write_text_atomic(schedules_json(fitted), out)
    return fitted


def _checked(budget: int, num_visual: int, check: Callable[[int, int], int]) -> int:
    try:
        return int(check(budget, num_visual))
    except ValueError as error:
        raise PruneAuditError(f"--budget: {error}") from None


def _provenance(
    request: RunRequest, questions: list[TaskQuestion], fits: list[tuple[int, FitResult]]
) -> dict[str, Any]:
    """Where the schedules come from: model, questions, budgets and the search's outcome."""
    from prune_audit import __version__
    from prune_audit.safety.fingerprint import file_sha256

    return {
        "fitted_by": f"prune-audit {__version__} fitprune fit",
        "method": "FitPrune's binary search on alpha (ywh187/FitPrune statistical_analysis.py, commit 2b70a5d8), "
        "statistics from one unpruned prefill per question, budget = layer-average visual tokens",
        "model": str(request.model),
        "task": request.task,
        "question_files": {str(Path(p).resolve()): file_sha256(p) for p in request.question_files},
        "questions": len(questions),
        "budgets": {str(b): {"alpha": round(fit.alpha, 6), "reached": fit.reached} for b, fit in fits},
    }
