"""`prune-audit study` and `calibrate` on clips through the CLI on a tiny random Qwen2.5-VL clip checkpoint (it
answers nonsense; the outputs must be complete and consistent): eight 4-frame clips, a red square in the first two
frames of the even clips and the last two of the odd ones, asked at the beginning and at the end (16 questions)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from clip_files import square_mask, tiny_clip_model, write_clip, write_tracks
from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()
CLIPS, FRAMES = 8, 4
VIDEO_SAMPLING = {"min_pixels": 112 * 84}
"""64 x 48 px frames read at 112 x 84 px: a 4 x 3 grid of merged tokens per temporal step, 24 tokens a clip."""


def clip_masks(clip: int) -> list:
    """The square in frames 0-1 of an even clip, 2-3 of an odd one."""
    first = 0 if clip % 2 == 0 else 2
    return [square_mask(frame, first, first + 1) for frame in range(FRAMES)]


def presence_questions() -> list[dict]:
    """Per clip: a cat at the beginning (frames 0-1) and at the end (frames 2-3)."""
    questions = []
    for clip in range(CLIPS):
        for where, window in (("beginning", [0, 1]), ("end", [2, 3])):
            present = (clip % 2 == 0) == (where == "beginning")
            questions.append(
                {"question_id": len(questions) + 1, "video": f"c{clip}.mp4", "window": window, "category": "cat",
                 "question": f"Is there a cat at the {where} of the video?", "answer": "yes" if present else "no"}
            )  # fmt: skip
    return questions


@pytest.fixture(scope="module")
def clip_set(tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint (declaring its frame size), the clips' frame folders, tracks and presence questions."""
    root = tmp_path_factory.mktemp("clip_set")
    videos = root / "videos"
    for clip in range(CLIPS):
        write_clip(videos / f"c{clip}", clip_masks(clip))
    (root / "presence.json").write_text(json.dumps(presence_questions()))
    return {
        "model": tiny_clip_model(root / "qwen", seed=5, video_sampling=VIDEO_SAMPLING),
        "videos": videos,
        "tracks": write_tracks(root / "tracks.json", {f"c{clip}": clip_masks(clip) for clip in range(CLIPS)}),
        "presence": root / "presence.json",
    }


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
