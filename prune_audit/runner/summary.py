"""``prune-audit run``, step 4: the end-of-run summary, computed from the records table."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from prune_audit.analysis.cost import cost_summary
from prune_audit.records.stages import FIRST, LAST, stage_values


def summarize(records: pa.Table) -> dict[str, float | int | str]:
    """One-screen summary numbers of a records table (``RUN_SCHEMA``).

    Retention, lost and diluted objects are given at the first stage (the earliest point at
    which tokens leave the model) and lost objects also at the last stage that keeps tokens;
    ``last_is_first`` says when that is the first stage on every record (nothing more to say).
    """
    n = records.num_rows
    if n == 0:
        return {"questions": 0}

    def column(name: str) -> np.ndarray:
        return np.asarray(records[name].to_pylist(), dtype=float)

    first, last = (stage_values(records, choice, "the run") for choice in (FIRST, LAST))
    with_mask = np.isfinite(first.lost)
    return {
        "questions": n,
        "accuracy": float(np.mean(column("correct"))),
        "mean_confidence": float(np.mean(column("confidence"))),
        "visual_tokens_avg": float(np.mean(column("visual_tokens_avg"))),
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

