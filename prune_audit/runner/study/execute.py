"""Run every cell of a study grid in this process, through the same ``plan_run`` + ``execute`` as ``run``.

Resumable for free: each cell is a ``run`` directory, so a finished run is reused (nothing
is answered again), an interrupted one continues, and one holding another configuration is
refused by ``execute``'s manifest check before anything is written into it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prune_audit.errors import PruneAuditError
from prune_audit.records.store import write_text_atomic
from prune_audit.runner.execute import execute
from prune_audit.runner.plan import RunPlan, check_writable, plan_run
from prune_audit.runner.study.grid import RUNS_FOLDER, StudyCell, StudyGrid

STUDY_MARKER = "study.json"
"""Written into ``--out`` first: marks the folder as a study's, which later studies may resume."""


class GridProgress(Protocol):
    """What the one progress display of the grid is told."""

    def cell(self, cell: StudyCell, index: int, cells: int, questions: int) -> None: ...

    def advance(self, count: int) -> None: ...


@dataclass(frozen=True)
class CellOutcome:
    """A finished cell: where its run is and how many questions this call answered (0: reused)."""

    cell: StudyCell
    run_dir: Path
    answered: int


def claim_output(out: Path, grid_description: dict) -> None:
    """Refuse an ``--out`` that holds anything but a study; mark it as a study's otherwise."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PruneAuditError(f"--out {out} is a file; pass a folder for the study")
    if out.is_dir() and any(out.iterdir()) and not (out / STUDY_MARKER).is_file():
        raise PruneAuditError(f"--out {out} holds files that no study wrote; pass an empty or new folder")
    check_writable(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(json.dumps(grid_description, indent=2, default=str) + "\n", out / STUDY_MARKER)


def check_study_folder(out: Path) -> None:
    """``--report`` reads only folders that a study (or its planned commands) wrote into."""
    if not (Path(out) / RUNS_FOLDER).is_dir():
        raise PruneAuditError(
            f"{out} has no {RUNS_FOLDER}/ folder; run the study (or its --plan commands) with --out {out} first"
        )


def plan_grid(grid: StudyGrid) -> list[RunPlan]:
    """Plan every cell (reference first) on one loaded model: every input, selector and budget is
    validated before the first run writes anything."""
    plans: list[RunPlan] = []
    for cell in grid.cells:
        plans.append(plan_run(grid.request(cell), plans[0].vlm if plans else None))
    return plans


def run_grid(grid: StudyGrid, plans: list[RunPlan], progress: GridProgress | None = None) -> list[CellOutcome]:
    """Execute the planned cells (``plan_grid``) in order; returns what each cell did."""
    outcomes = []
    for index, (cell, plan) in enumerate(zip(grid.cells, plans)):
        answered = 0

        def on_start(done: int, total: int, cell: StudyCell = cell, index: int = index) -> None:
            if progress:
                progress.cell(cell, index, len(plans), total)
                progress.advance(done)

        def on_progress(count: int) -> None:
            nonlocal answered
            answered += count
            if progress:
                progress.advance(count)

        result = execute(plan, on_start=on_start, on_progress=on_progress)
        outcomes.append(CellOutcome(cell, result.run_dir, answered))
    return outcomes


def grid_description(grid: StudyGrid) -> dict:
    """The study.json content: the grid and each cell's ``run`` command."""
    return {
        "selectors": list(grid.selectors),
        "budgets": list(grid.budgets),
        "runs": {cell.name: grid.command(cell) for cell in grid.cells},
    }


