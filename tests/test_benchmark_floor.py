"""``benchmarks/gemm_floor.py``: the bare matmul chain runs and its FLOP ratio matches the prefill benchmark's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gemm_floor_prints_a_row_per_budget_with_the_prefill_ideal():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gemm_floor",
            "--text-hidden",
            "32",
            "--text-layers",
            "2",
            "--text-heads",
            "2",
            "--budgets",
            "16",
            "576",
            "--repeats",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert [row["budget"] for row in rows] == [16, 576]
    assert all(row["ms"] > 0 and row["floor"] > 0 for row in rows)
    assert rows[0]["ideal"] < 1 and abs(rows[1]["ideal"] - 1) < 1e-12  # every token kept: the dense FLOPs


def test_gemm_floor_refuses_budgets_outside_the_visual_tokens():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gemm_floor", "--budgets", "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and "--budgets must lie in 1..576" in result.stderr
