"""``prune-audit run``, step 4: the end-of-run summary, computed from the records table."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa


def summarize(records: pa.Table) -> dict[str, float | int]:
    """One-screen summary numbers of a records table (``RUN_SCHEMA``)."""
    n = records.num_rows
    if n == 0:
        return {"questions": 0}

    def column(name: str) -> np.ndarray:
        return np.asarray(records[name].to_pylist(), dtype=float)

    lost = [v for v in records["lost"].to_pylist() if v is not None]
    retention_values = column("retention")
    return {
        "questions": n,
        "accuracy": float(np.mean(column("correct"))),
        "mean_confidence": float(np.mean(column("confidence"))),
        "visual_tokens_avg": float(np.mean(column("visual_tokens_avg"))),
        "mean_retention": float(np.nanmean(retention_values)) if np.isfinite(retention_values).any() else math.nan,
        "lost_objects": int(sum(lost)),
        "questions_with_mask": len(lost),
        "mean_latency_ms": float(np.mean(column("latency_ms"))),
    }
