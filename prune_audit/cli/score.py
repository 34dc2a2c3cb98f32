"""``prune-audit score``: score a released answers file (LLaVA's format) against a task's questions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from prune_audit.cli.common import QuestionsOption, TaskOption, fail, handle_errors


def summary_rows(report: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """(field, value) of every number and word in ``report`` (nested objects as ``a.b``), the answers file's
    pin and the per-question rows left out (``--json`` prints everything)."""
    rows = []
    for key, value in report.items():
        if key in ("per_question", "answers"):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += summary_rows(value, f"{name}.")
        elif isinstance(value, float):
            rows.append((name, "nan" if value != value else f"{value:.4f}"))
        elif isinstance(value, (int, str)):
            rows.append((name, str(value)))
    return rows


@handle_errors
def score(
    answers: Annotated[Path, typer.Argument(help="Answers file (JSON Lines; LLaVA's question_id + text lines).")],
    task: TaskOption = "pope",
    questions: QuestionsOption = None,
    subset: Annotated[
        Optional[str],
        typer.Option(
            "--subset",
            help="Score only this subset of the questions: img "
            "(scienceqa: those with an image, the ones `run` answers).",
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print JSON (with every question) instead of a table.")
    ] = False,
) -> None:
    """Score released answers as the task's official evaluation does (docs/tasks.md): POPE's evaluate.py, GQA's
    exact match, LLaVA's ScienceQA letter rule, CHAIR for captions, lmms-eval's letter rules for MVBench and
    Video-MME."""
    from prune_audit.analysis.outputs import to_json
    from prune_audit.data.answers import ANSWERS_FILE, ANSWERS_FIX
    from prune_audit.safety.inputs import check_input_file
    from prune_audit.tasks import get_task

    scoring = get_task(task)
    check_subset(subset, scoring.answer_subsets, task)
    if not questions:
        raise fail(f"pass the {task} question files with --questions")
    check_input_file(answers, ANSWERS_FILE, ANSWERS_FIX)
    for path in questions:
        check_input_file(path, "question file", f"pass the {task} question files with --questions")
    report = scoring.score_answers(answers, list(questions), subset)
    if json_output:
        print(to_json(report), end="")
        return
    from rich.console import Console
    from rich.table import Table

    print(f"{task} scores of {answers}")  # on its own line: a table title would break the file name to its width
    table = Table()
    table.add_column("field")
    table.add_column("value", justify="right")
    for name, value in summary_rows(report):
        table.add_row(name, value)
    Console().print(table)


def check_subset(subset: str | None, subsets: dict[str, str], task: str) -> None:
    """Refuse a ``--subset`` the task does not offer, naming those it does."""
    if subset is None or subset in subsets:
        return
    if not subsets:
        raise fail(f"{task} has no question subsets to score alone; drop --subset {subset}")
    offered = "; ".join(f"{name}: {what}" for name, what in subsets.items())
    raise fail(f"--subset {subset} is not a subset of {task}; choose one of {offered}")
