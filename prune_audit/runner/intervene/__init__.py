"""``prune-audit intervene``: does the evidence a pruner removed cause the errors?

The run's recorded kept sets are edited by swapping cells and the model is re-run
with the edited sets forced (``VisionLanguageModel.answer(forced_kept=...)`` for
input-level selectors, ``forced_stages=...`` for in-LLM ones). Every swap removes as
many kept cells as it adds, so the budget stays fixed, and every intervention has a
control that differs from it only in which cells are swapped (``swaps`` states the
rules for restore and remove, and for nested in-LLM stages). On a run of video clips each clip is read from its
frame folder as ``run`` reads it (``runner.clips``) and the swaps move the object in the question's window
(``execute.swap_region``).

The pipeline: ``plan`` (request and source run checked) -> ``swaps`` (pure) -> ``execute``
(forced re-runs) -> ``build`` (records) -> ``report`` (intervention.json).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from prune_audit.analysis.outputs import to_json, write_files
from prune_audit.errors import PruneAuditError
from prune_audit.records.schema import RECORDS_FILE
from prune_audit.records.store import stamped
from prune_audit.runner.intervene.build import parquet_bytes, records_table
from prune_audit.runner.intervene.execute import answer_swaps
from prune_audit.runner.intervene.plan import (
    InterveneRequest,
    check_request,
    check_swappable,
    eligible_records,
    load_source,
)
from prune_audit.runner.intervene.report import REPORT_FILE, intervention_report
from prune_audit.runner.run_dir import check_writable
from prune_audit.safety.ownership import check_output_dir, hold_output_dir

__all__ = ["InterveneRequest", "InterventionResult", "intervene"]

INTERVENE_DIR = Path("intervene")
"""Default parent of ``intervene``'s output folder: intervene/<run name>-<mode>/. Derived outputs never
go inside a run directory (a run folder holds one run's outputs), as ``visualize --run`` writes figures/<run name>/."""


def _default_out(run_dir: Path, mode: str) -> Path:
    """intervene/<run name>-<mode>, e.g. intervene/demo-e2s-64-restore for runs/demo-e2s-64 and --mode restore."""
    return INTERVENE_DIR / f"{Path(run_dir).resolve().name}-{mode}"


@dataclass
class InterventionResult:
    out: Path
    report: dict[str, Any]
    records: pa.Table  # INTERVENE_SCHEMA


def intervene(request: InterveneRequest, on_progress: Callable[[int, int], None] | None = None) -> InterventionResult:
    """Re-run the eligible questions of a run under intervention and control swaps; write OUT.

    ``on_progress(done, total)`` is called after each question. Nothing is written unless
    every question was answered.
    """
    check_request(request)
    out = Path(request.out) if request.out is not None else _default_out(request.run_dir, str(request.mode))
    settings = {
        "run": str(Path(request.run_dir).resolve()),
        "mode": request.mode,
        "max_cells": request.max_cells,
        "controls": request.controls,
        "bootstrap": request.bootstrap,
        "seed": request.seed,
        "stage": request.stage.name,
    }
    source = load_source(request.run_dir, request.stage, request.inputs)
    check_swappable(source)
    eligible = eligible_records(source, request.mode)
    check_output_dir(out, "intervene", settings)  # after the inputs: a mistyped run is named as such
    check_writable(out)
    rows, skipped = answer_swaps(request, source, eligible, on_progress)
    if not rows:
        reasons = "; ".join(f"{reason} ({count})" for reason, count in skipped.items())
        raise PruneAuditError(f"none of the {len(eligible)} eligible questions allows a {request.mode} swap: {reasons}")
    table = records_table(rows)
    report = intervention_report(request, source, table, len(eligible), skipped)
    with hold_output_dir(out, "intervene", settings):
        # the report (intervene's manifest) lands before the records; they carry the source run's id
        records = parquet_bytes(stamped(table, source.manifest["run_id"]))
        write_files(out, {REPORT_FILE: to_json(report), RECORDS_FILE: records})
    return InterventionResult(out, report, table)
