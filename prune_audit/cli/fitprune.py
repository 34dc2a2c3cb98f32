"""``prune-audit fitprune``: fit FitPrune's per-layer pruning schedule on calibration questions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prune_audit.cli.common import (
    DeviceOption,
    DtypeOption,
    ImagesOption,
    LimitOption,
    ModelOption,
    QuestionsOption,
    TaskOption,
    ThreadsOption,
    handle_errors,
)

app = typer.Typer(
    help="FitPrune's schedule: fit it on calibration questions (run it with --option schedule_file=FILE).",
    no_args_is_help=True,
)


@app.command("fit")
@handle_errors
def fit(
    out: Annotated[Path, typer.Option("--out", help="New schedule file (.json); an existing file is refused.")],
    budget: Annotated[list[int], typer.Option("--budget", help="Layer-average visual tokens to fit for; repeatable.")],
    model: ModelOption = None,
    task: TaskOption = "pope",
    questions: QuestionsOption = None,
    images: ImagesOption = None,
    limit: LimitOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
) -> None:
    """Collect each question's attention statistics (one unpruned prefill), fit one schedule per budget with
    FitPrune's binary search, and write them with their provenance.

    Run the file with `prune-audit run` and the selector's options schedule_file=OUT and budget_rule=paper at a
    budget equal to a schedule's realised average (printed here), or budget_rule=average at any budget."""
    from prune_audit.runner.model import check_device
    from prune_audit.runner.request import RunRequest
    from prune_audit.runner.schedule_fit import fit_schedule_file
    from prune_audit.threads import configure_threads

    check_device(device)
    configure_threads(threads)
    request = RunRequest(
        model=model, task=task, question_files=list(questions or []), images=images, limit=limit, device=device,
        dtype=dtype,
    )  # fmt: skip
    fitted = fit_schedule_file(request, budget, out)
    for budget_value, schedule in zip(budget, fitted.schedules):
        average = schedule.average(fitted.num_visual)
        print(
            f"budget {budget_value}: alpha {schedule.alpha}, realised average {average:.2f} (paper budget {round(average)})"
        )
    print(f"wrote {out}")
