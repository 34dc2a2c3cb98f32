"""`visualize --run` on a clip run: a frame strip, one picture per sampled frame, each with the kept cells of its
temporal step, hand-counted on a tiny geometry and recounted from the records of a tiny Qwen2.5-VL clip run."""

from __future__ import annotations

import json

import pytest
from test_clip_run import clips, records, run  # noqa: F401  (clips: the tiny Qwen2.5-VL clip fixture)
from typer.testing import CliRunner

import prune_audit.runner.visualize_record as visualize_record
from prune_audit.cli.main import app
from prune_audit.data.geometry import TokenGeometry
from prune_audit.data.video import ClipGeometry

runner = CliRunner()


def two_step_clip() -> ClipGeometry:
    """2 temporal steps of a 1 x 2 grid: tokens 0, 1 cover frames 0 and 1; tokens 2, 3 frames 2 and 3."""
    frame = TokenGeometry("qwen_smart_resize", 56, 28, 56, 28, 1, 2, 28, 1.0, 1.0)
    return ClipGeometry(frame, (0, 2, 4, 6), 2.0)


def test_frame_cells_are_the_kept_tokens_of_the_frames_step_by_hand():
    clip = two_step_clip()
    kept = [1, 2, 3]  # step 0 keeps cell 1; step 1 keeps cells 0 and 1
    assert [clip.frame_cells(k, kept) for k in range(4)] == [[1], [1], [0, 1], [0, 1]]
    assert [clip.frame_cells(k, []) for k in range(4)] == [[], [], [], []]
    assert ClipGeometry.from_dict(json.loads(json.dumps(clip.to_dict()))) == clip
    with pytest.raises(ValueError):
        clip.frame_cells(4, kept)


def test_visualize_run_draws_one_picture_per_sampled_frame_with_its_steps_kept_cells(clips, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "evs"
    assert run(clips, out, "--selector", "evs", "--budget", "40").exit_code == 0
    drawn_panels = []
    draw = visualize_record.draw_panels

    def recording(image, panels, path, **kwargs):
        drawn_panels.extend(panels)
        return draw(image, panels, path, **kwargs)

    monkeypatch.setattr(visualize_record, "draw_panels", recording)
    figure = tmp_path / "strip.png"
    result = runner.invoke(app, ["visualize", "--run", str(out), "--question-id", "1", "--out", str(figure)])
    assert result.exit_code == 0, result.output
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = next(row for row in records(out) if row["question_id"] == 1)
    geometry = json.loads(record["geometry"])
    cells = geometry["frame"]["grid_rows"] * geometry["frame"]["grid_cols"]
    assert len(drawn_panels) == len(record["sampled_frames"]) == len(geometry["frames"])
    for k, panel in enumerate(drawn_panels):
        step_kept = [t for t in record["kept_stages"][0] if (k // 2) * cells <= t < (k // 2 + 1) * cells]
        assert len(panel.stages) == 1 and len(panel.stages[0]) == len(step_kept)
        assert panel.image is not None and panel.mask is not None
        in_window = record["window"][0] <= record["sampled_frames"][k] <= record["window"][1]
        assert ("outside the asked window" in panel.under(0)) != in_window
        retention = record["frame_retention"][k]
        assert (f"retention {retention:.2f}" in panel.under(0)) or retention != retention  # NaN: no object there
