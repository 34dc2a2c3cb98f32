"""Run-level compute numbers from the cost columns of the records (docs/compute.md)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

COST_MEANS = (
    "flops", "flops_vision", "flops_selector", "flops_llm", "flops_dense", "kv_bytes", "cost_tokens",
    "flop_equivalent_tokens", "latency_vision_ms", "latency_selection_ms", "latency_prefill_ms",
)  # fmt: skip
"""Record columns whose run means are reported (``mean_<column>``)."""


def cost_summary(records: pa.Table) -> dict[str, float]:
    """``mean_<column>`` of every ``COST_MEANS`` column and ``flops_relative``: mean FLOPs over the mean
    FLOPs of the same questions unpruned."""
    mean = {name: float(np.mean(np.asarray(records[name].to_pylist(), dtype=float))) for name in COST_MEANS}
    return {
        **{f"mean_{name}": value for name, value in mean.items()},
        "flops_relative": mean["flops"] / mean["flops_dense"],
    }


__all__ = ["COST_MEANS", "cost_summary"]
