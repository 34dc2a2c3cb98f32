"""`prune-audit study` and `calibrate` on clips through the CLI on a tiny random Qwen2.5-VL clip checkpoint (it
answers nonsense; the outputs must be complete and consistent), on the 16 presence questions of
``clip_files.write_clip_set``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from clip_files import CLIPS, FRAMES, write_clip_set
from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def clip_set(tmp_path_factory) -> dict[str, Path]:
    return write_clip_set(tmp_path_factory.mktemp("clip_set"))


def test_study_and_calibrate_measure_video_presence_on_a_tiny_clip_checkpoint(clip_set, tmp_path):
    out = tmp_path / "study"
    inputs = [f"--questions=video_presence={clip_set['presence']}", f"--images=video_presence={clip_set['videos']}"]
    inputs += [f"--annotations=video_presence={clip_set['tracks']}", "--model", str(clip_set["model"])]
    grid = ["study", "--tasks", "video_presence", "--selectors", "evs", "--budgets", "12", "--device", "cpu"]
    settings = ["--bootstrap", "20", "--splits", "2", "--epsilons", "0.2", "--threads", "1", "--out", str(out)]
    result = runner.invoke(app, [*grid, *inputs, *settings])
    assert result.exit_code == 0, result.output
    with (out / "summary.csv").open() as handle:
        rows = {row["run"]: row for row in csv.DictReader(handle)}
    assert {"dense", "evs@12"} <= set(rows) and float(rows["evs@12"]["visual_tokens"]) == 12
    assert float(rows["dense"]["visual_tokens"]) == 24 and "video_presence" in (out / "report.md").read_text()
    (pruned,) = (path for path in (out / "runs").iterdir() if "evs" in path.name)
    records = pq.read_table(pruned / "records.parquet").to_pylist()
    assert len(records) == 2 * CLIPS and {len(row["kept"]) for row in records} == {12}
    for row in records:
        assert row["sampled_frames"] == list(range(FRAMES)) and len(row["frame_retention"]) == FRAMES
        in_window = [row["frame_retention"][k] for k in range(row["window"][0], row["window"][1] + 1)]
        assert (row["label"] == "yes") == all(share == share for share in in_window)  # NaN: no square in the frame
        assert (row["lost_in_window"] is None) == (row["label"] == "no")
    calibration = tmp_path / "calibration"
    calibrated = runner.invoke(app, ["calibrate", str(pruned), "--bootstrap", "20", "--out", str(calibration)])
    assert calibrated.exit_code == 0, calibrated.output
    report = json.loads((calibration / "calibration.json").read_text())
    assert report["conventions"]["correct"].startswith("video_presence:") and report["runs"][0]["label"] == "evs@12"
    assert report["split"]["calibration_images"] == report["split"]["test_images"] == CLIPS // 2  # split by clip
    assert "video_presence" in report["runs"][0]["metrics"]
