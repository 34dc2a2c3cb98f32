"""``benchmarks/prefill.py`` at a tiny width: timing and per-selector peak memory columns (issue 18)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


def test_prefill_benchmark_reports_peak_memory_per_selector_against_dense():
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    command = [
        sys.executable,
        "-m",
        "benchmarks.prefill",
        "--text-hidden",
        "64",
        "--text-layers",
        "2",
        "--text-heads",
        "2",
        "--selectors",
        "random",
        "divprune",
        "--budgets",
        "64",
        "--repeats",
        "1",
        "--json-only",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPOSITORY)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["dense_peak_mib"] > report["dense_extra_mib"] > 0
    rows = {row["selector"]: row for row in report["rows"]}
    assert set(rows) == {"random", "divprune"}
    for row in rows.values():
        assert row["ms"] > 0 and row["budget"] == 64
        assert row["peak_mib"] > row["extra_mib"] > 0
        assert row["memory_vs_dense"] == pytest.approx(row["peak_mib"] / report["dense_peak_mib"])
        # the model and inputs dominate a tiny model's resident memory: every run is near dense
        assert 0.5 < row["memory_vs_dense"] < 1.5
