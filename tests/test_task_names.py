"""No module knows a task by name: outside ``prune_audit/tasks/`` and each task's own data reader, no code spells a
registered task's name as a string literal (docstrings aside), but for the named exceptions below.

Read from the source (``ast``): a literal equal to a task name, in code, is a place that decides by task name
what the task itself should declare.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from prune_audit.tasks import list_tasks

PACKAGE = Path(__file__).resolve().parents[1] / "prune_audit"

OWN_READERS = {
    "data/pope.py",
    "data/pope_build.py",
    "data/pope_score.py",
    "data/gqa.py",
    "data/scienceqa.py",
    "data/captions.py",
    "data/chair.py",
    "data/lmms_parquet.py",
}
"""Each task's own data readers (its question files, answers and scores), which may name their task."""

EXCEPTIONS: dict[tuple[str, str], tuple[int, str]] = {
    ("data/__init__.py", "pope"): (6, "lazy-export map: the module data/pope.py, not the task"),
    ("data/__init__.py", "gqa"): (6, "lazy-export map: the module data/gqa.py, not the task"),
    ("data/__init__.py", "scienceqa"): (4, "lazy-export map: the module data/scienceqa.py, not the task"),
    ("cli/main.py", "pope"): (1, "the `prune-audit pope` command group (POPE's own file tools)"),
    ("cli/pope.py", "pope"): (1, "the `prune-audit pope` command group's name"),
    ("cli/run.py", "pope"): (
        3,
        "CLI default `--task pope`; `--pope` names POPE files only; POPE's title "
        "predates tasks (its printed header stays byte-equal)",
    ),
    ("cli/score.py", "pope"): (1, "CLI default `--task pope`"),
    ("cli/fitprune.py", "pope"): (1, "CLI default `--task pope`"),
    ("cli/study.py", "pope"): (2, "CLI default `--task pope`; `--pope` names POPE files only"),
    ("cli/reproduce.py", "pope"): (2, "`reproduce` re-measures the published POPE numbers: POPE by definition"),
    ("runner/study/grid.py", "pope"): (1, "`--task` left at its CLI default means `--tasks` may be given"),
    ("runner/visualize_record.py", "pope"): (
        1,
        "figure words for POPE's object and label: to move onto the task (runner/ is being split by another change)",
    ),
    ("analysis/report_html.py", "pope"): (
        2,
        "report wording of POPE's evidence (the queried object); a manifest without a task is POPE's",
    ),
    ("models/task_instructions.py", "pope"): (
        1,
        "the bundled demo checkpoint's declared instructions, keyed by task name as task_instructions.json is",
    ),
    ("demo/__init__.py", "pope"): (1, "the bundled demo that answers POPE (the others' is demo-tasks)"),
    ("demo/assets.py", "pope"): (2, "the bundled demo's question files per built-in task (user-facing defaults)"),
    ("demo/assets.py", "gqa"): (1, "the bundled demo's question files per built-in task"),
    ("demo/assets.py", "scienceqa"): (1, "the bundled demo's question files per built-in task"),
    ("demo/assets.py", "caption"): (1, "the bundled demo's question files per built-in task"),
    ("demo/assets.py", "textvqa"): (1, "the bundled demo's question files per built-in task"),
    ("demo/assets.py", "refcoco"): (1, "the bundled demo's question files per built-in task"),
    ("demo/assets.py", "video_presence"): (1, "the bundled demo's clip question files per built-in clip task"),
    ("demo/assets.py", "video_mc"): (1, "the bundled demo's clip question files per built-in clip task"),
    ("demo/clip_files.py", "video_presence"): (2, "the demo clip files: each clip task's question and track files"),
    ("demo/task_files.py", "gqa"): (2, "the bundled demo writes each built-in task's question files"),
    ("demo/task_files.py", "scienceqa"): (2, "the bundled demo writes each built-in task's question files"),
    ("demo/task_files.py", "caption"): (2, "the bundled demo writes each built-in task's question files"),
    ("demo/task_files.py", "textvqa"): (
        4,
        "the bundled demo writes each built-in task's question files (and TextVQA's files name their dataset)",
    ),
    ("demo/task_files.py", "refcoco"): (3, "the bundled demo writes each built-in task's question files"),
    ("demo/scene_questions.py", "caption"): (3, "the demo scenes' question kinds, one per built-in task"),
    ("demo/answer_targets.py", "caption"): (1, "the demo model's training targets per question kind"),
    ("demo/lmms_tasks.py", "caption"): (1, "the demo's lmms-eval task files per built-in task"),
}
"""(module, task name) -> (how many literals, why it may spell it)."""


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of every string constant standing alone as a statement (docstrings and attribute docs)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def task_name_literals() -> Counter[tuple[str, str]]:
    names = set(list_tasks())
    found: Counter[tuple[str, str]] = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module.startswith("tasks/") or module in OWN_READERS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        found.update(
            (module, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs
        )
    return found


def test_no_module_outside_tasks_spells_a_task_name_but_the_named_exceptions():
    found = task_name_literals()
    unlisted = {key: count for key, count in found.items() if key not in EXCEPTIONS}
    assert not unlisted, f"modules deciding by task name (declare it on the task, or list it here): {unlisted}"
    changed = {key: (found[key], count) for key, (count, _) in EXCEPTIONS.items() if found[key] != count}
    assert not changed, f"exceptions whose count changed (found, listed): drop or update them: {changed}"


def test_the_scan_sees_a_task_name_in_code_and_not_in_a_docstring():
    tree = ast.parse('"""About pope."""\nif task == "pope":\n    pass\n')
    seen = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in _docstrings(tree)]
    assert seen == ["pope"]
