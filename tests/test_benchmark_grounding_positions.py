"""``benchmarks/demo_grounding_positions.py``: the same selections under both position modes, in a subprocess (the
diagnostic sets the position mode on the model class)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_grounding_positions.py"


def test_both_position_modes_run_the_same_selection():
    args = ["--selectors", "divprune", "--budgets", "16", "--limit", "4"]
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = json.loads(completed.stdout.strip().splitlines()[-1])
    assert [row["positions"] for row in rows] == ["compact", "keep_original"]
    assert rows[0]["lost_share"] == rows[1]["lost_share"]  # the same tokens, only their position ids differ
    assert all(0 <= row["accuracy"] <= 1 and 0 <= row["mean_iou"] <= 1 for row in rows)
