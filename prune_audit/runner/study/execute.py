"""Run every cell of a study grid in this process, through the same ``plan_run`` + ``execute`` as ``run``.

Resumable for free: each cell is a ``run`` directory, so a finished run is reused (nothing
is answered again), an interrupted one continues, and one holding another configuration is
refused when the grid is planned, before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prune_audit.errors import PruneAuditError
from prune_audit.runner.execute import execute
from prune_audit.runner.plan import RunPlan, plan_run
from prune_audit.runner.study.grid import RUNS_FOLDER, StudyCell, StudyGrid

if TYPE_CHECKING:
    from prune_audit.models import VisionLanguageModel


@dataclass(frozen=True)
class CellOutcome:
    """A finished cell: where its run is and how many questions this call answered (0: reused)."""

    cell: StudyCell
    run_dir: Path
    answered: int


def plan_grid(grid: StudyGrid, vlm: VisionLanguageModel | None = None) -> list[RunPlan]:
    """Plan every cell (reference first) on one loaded model (``vlm``, else loaded by the first cell): every
    input, selector, budget and existing run folder is checked before the first run writes anything."""
    plans: list[RunPlan] = []
    for cell in grid.cells:
        plans.append(plan_run(grid.request(cell), plans[0].vlm if plans else vlm))
    _check_distinct_budgets(grid, plans)
    return plans


def _check_distinct_budgets(grid: StudyGrid, plans: list[RunPlan]) -> None:
    """Two budgets of the grid that keep the same number of tokens (``all`` and the model's token count)
    would run one configuration twice under two names; shares (``11%``) resolve per image and stay apart."""
    seen: dict[tuple[str, int], str] = {}
    for cell, plan in zip(grid.cells, plans):
        if cell.budget is None or cell.budget.endswith("%"):
            continue
        key = (cell.selector, plan.budget)
        if key in seen:
            raise PruneAuditError(
                f"--budgets {seen[key]} and {cell.budget} both keep {plan.budget} visual tokens of this model; "
                f"list that budget once"
            )
        seen[key] = cell.budget


def run_grid(
    grid: StudyGrid,
    plans: list[RunPlan],
    advance: Callable[[int], None] | None = None,
    on_cell: Callable[[int, StudyCell], None] | None = None,
) -> list[CellOutcome]:
    """Execute the planned cells (``plan_grid``) in order.

    ``advance(count)`` is told every answered (or, for a resumed run, already recorded) question
    of the grid, ``on_cell(index, cell)`` when a cell starts.
    """
    outcomes = []
    for index, (cell, plan) in enumerate(zip(grid.cells, plans)):
        if on_cell:
            on_cell(index, cell)
        answered = 0

        def on_start(done: int, total: int) -> None:
            if advance:
                advance(done)

        def on_progress(count: int) -> None:
            nonlocal answered
            answered += count
            if advance:
                advance(count)

        result = execute(plan, on_start=on_start, on_progress=on_progress)
        outcomes.append(CellOutcome(cell, result.run_dir, answered))
    return outcomes


def check_study_folder(out: Path) -> None:
    """``--report`` reads only folders that a study (or its planned commands) wrote into."""
    if not (Path(out) / RUNS_FOLDER).is_dir():
        raise PruneAuditError(
            f"{out} has no {RUNS_FOLDER}/ folder; run the study (or its --plan commands) with --out {out} first"
        )
