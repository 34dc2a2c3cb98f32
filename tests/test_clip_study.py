"""`prune-audit study` and `calibrate` on clips, through the CLI on the bundled video demo and its clip files (no
model or question files named: the clip tasks' defaults)."""

from __future__ import annotations

import csv

from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()


def test_study_and_calibrate_measure_a_clip_task_on_the_video_demo(tmp_path):
    out = tmp_path / "study"
    args = ["study", "--tasks", "video_presence", "--selectors", "evs", "--budgets", "36", "--limit", "120"]
    result = runner.invoke(
        app, [*args, "--bootstrap", "50", "--splits", "5", "--epsilons", "0.2", "--threads", "1", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    with (out / "summary.csv").open() as handle:
        rows = {row["run"]: row for row in csv.DictReader(handle)}
    assert {"dense", "evs@36"} <= set(rows) and float(rows["evs@36"]["visual_tokens"]) == 36
    assert all(0 <= float(rows[run]["accuracy"]) <= 1 for run in ("dense", "evs@36"))
    assert "video_presence" in (out / "report.md").read_text()
    (pruned,) = (path for path in (out / "runs").iterdir() if "evs" in path.name)
    calibrated = runner.invoke(app, ["calibrate", str(pruned), "--out", str(tmp_path / "calibration")])
    assert calibrated.exit_code == 0, calibrated.output
    assert (tmp_path / "calibration" / "calibration.json").is_file()
