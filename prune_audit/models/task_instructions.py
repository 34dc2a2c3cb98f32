"""The instructions a checkpoint's own evaluation asks after a task's questions, where they differ from the task's.

A task owns the instruction its official evaluation puts after the question (``Task.instruction``: POPE's is
LLaVA's and lmms-eval's "Answer the question using a single word or phrase."). A released checkpoint is asked
exactly that. A checkpoint trained and evaluated by another convention declares it beside its weights in
``task_instructions.json``, ``{task name: instruction}`` ("" for none): the bundled demos were trained on POPE
questions with and without instructions and their cards' figures ask them bare, so they declare
``{"pope": ""}`` and ``prune-audit demo train`` writes the same file. The manifest's ``prompt.first`` shows the
prompt a run used either way.
"""

from __future__ import annotations

import json
from pathlib import Path

from prune_audit.errors import PruneAuditError
from prune_audit.models.declared import declared_json

TASK_INSTRUCTIONS_FILE = "task_instructions.json"
DEMO_TASK_INSTRUCTIONS: dict[str, str] = {"pope": ""}
"""What the demos' trainer evaluates with (``demo/evaluate.py``'s default: the POPE question alone)."""


def checkpoint_task_instructions(source: str | Path) -> dict[str, str]:
    """The ``{task name: instruction}`` a checkpoint folder declares in ``task_instructions.json`` (empty for a
    hub id or a folder without the file: every task's own instruction applies)."""
    fix = 'write it as {"task name": "instruction"} or remove it'
    declared = declared_json(source, TASK_INSTRUCTIONS_FILE, "task instructions", fix)
    if declared is None:
        return {}
    where = str(Path(source) / TASK_INSTRUCTIONS_FILE)
    if not isinstance(declared, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in declared.items()
    ):
        raise PruneAuditError(f"{where} must map task names to instruction texts; {fix}")
    return declared


def write_task_instructions(folder: Path, instructions: dict[str, str]) -> None:
    """Declare ``instructions`` in ``folder`` (a checkpoint being saved)."""
    (folder / TASK_INSTRUCTIONS_FILE).write_text(json.dumps(instructions, indent=2) + "\n")


__all__ = [
    "DEMO_TASK_INSTRUCTIONS",
    "TASK_INSTRUCTIONS_FILE",
    "checkpoint_task_instructions",
    "write_task_instructions",
]
