"""``prune-audit run``'s output folder: its default name, and the checks that it may be written (planning writes
nothing; ``execute`` creates it)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune_audit.compute.budget import budget_text
from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import MANIFEST_FILE
from prune_audit.records.store import RecordStore, check_run_layout
from prune_audit.safety.ownership import check_output_dir
from prune_audit.tasks.registry import DEFAULT_TASK

if TYPE_CHECKING:
    from prune_audit.pruners.composed import RunSelector
    from prune_audit.runner.request import RunRequest
    from prune_audit.tasks import TaskQuestion


def run_dir_of(request: RunRequest, selector: RunSelector | None) -> Path:
    """--out, else runs/<model>[-<task>]-<selector>-<budget>[-<each option that differs from its default>][-limit<N>].

    The limit is part of the name so that a quick try (``--limit 200``) never lands in, or is refused
    by, the folder of the full run of the same settings; so is every task but POPE, so that one model's
    runs of several tasks each get their own folder.
    """
    if request.out is not None:
        return Path(request.out)
    model_name = file_safe(Path(str(request.model).rstrip("/")).name) or "model"
    prefix = [model_name] if request.task == DEFAULT_TASK else [model_name, request.task]
    parts = (
        [*prefix, "dense"]
        if selector is None
        else [*prefix, request.selector, budget_text(request.budget), *_changed_options(selector)]
    )
    if request.limit is not None:
        parts.append(f"limit{request.limit}")
    return Path("runs") / "-".join(parts)


def file_safe(text: str) -> str:
    """``text`` with every run of characters outside [A-Za-z0-9._-] turned into one "-" (a file-name part)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)


def _changed_options(selector: RunSelector) -> list[str]:
    """Name parts of the options that differ from the defaults: budget_rule=paper -> "paper", alpha=0.5 -> "alpha0.5"
    (a composed selector's parts in their order)."""
    from prune_audit.pruners.base import option_defaults
    from prune_audit.pruners.composed import ComposedSelector

    names = []
    for part in selector.parts if isinstance(selector, ComposedSelector) else (selector,):
        defaults = option_defaults(type(part))
        changed = sorted((key, value) for key, value in part.options().items() if defaults.get(key, value) != value)
        names += [file_safe(str(value) if key == "budget_rule" else f"{key}{value}") for key, value in changed]
    return names


def check_run_dir(run_dir: Path) -> None:
    """The folder is no other command's, holds nothing but a run's files, and can be written."""
    check_output_dir(run_dir, "run")
    check_run_layout(run_dir)
    check_writable(run_dir)


def check_writable(run_dir: Path) -> None:
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PruneAuditError(
            f"cannot write the run directory {run_dir} ({existing} is not writable); pass a writable --out"
        )


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
