"""``prune-audit run``, step 4: the end-of-run summary, computed from the records table."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from prune_audit.analysis.cost import cost_summary
from prune_audit.records.stages import FIRST, LAST, mean_stage_tokens, stage_values

if TYPE_CHECKING:
    from prune_audit.tasks import Task

EVIDENCE_KEYS = ("mean_retention", "lost_objects", "lost_objects_last_stage", "diluted_objects", "questions_with_mask")
"""The summary numbers of the task's evidence regions: left out for a task whose questions name none."""


def summarize(records: pa.Table, task: Task) -> dict[str, float | int | str]:
    """One-screen summary numbers of a records table (``RUN_SCHEMA``) of ``task``.

    Retention, lost and diluted objects are given at the first stage (the earliest point at
    which tokens leave the model) and lost objects also at the last stage that keeps tokens;
    ``last_is_first`` says when that is the first stage on every record (nothing more to say).
    A task without evidence regions (``Task.names_evidence``) has none of ``EVIDENCE_KEYS``.
    """
    n = records.num_rows
    if n == 0:
        return {"questions": 0}

    def column(name: str) -> np.ndarray:
        return np.asarray(records[name].to_pylist(), dtype=float)

    first, last = (stage_values(records, choice, "the run") for choice in (FIRST, LAST))
    with_mask = np.isfinite(first.lost)
    stage_layers, stage_tokens = mean_stage_tokens(records)
    summary = {
        "questions": n,
        "accuracy": float(np.mean(column("correct"))),
        "mean_confidence": float(np.mean(column("confidence"))),
        "visual_tokens_avg": float(np.mean(column("visual_tokens_avg"))),
        "stage_layers": stage_layers,
        "stage_tokens": stage_tokens,  # the realised tokens of each stage (a budget may be a layer average)
        "mean_retention": float(np.nanmean(first.retention)) if np.isfinite(first.retention).any() else math.nan,
        "lost_objects": int(np.sum(first.lost[with_mask])),
        "lost_objects_last_stage": int(np.sum(last.lost[with_mask])),
        "diluted_objects": int(np.sum(first.diluted[with_mask])),
        "first_stage": FIRST.describe(first.layer),
        "last_stage": LAST.describe(last.layer),
        # the last stage is the first one on every record (input-level and single-stage selectors, dense runs)
        "last_is_first": bool(np.array_equal(first.index, last.index)),
        "questions_with_mask": int(with_mask.sum()),
        "mean_latency_ms": float(np.mean(column("latency_ms"))),
        **cost_summary(records),
    }
    return summary if task.names_evidence else {k: v for k, v in summary.items() if k not in EVIDENCE_KEYS}
