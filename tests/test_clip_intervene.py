"""`prune-audit intervene` on clips through the CLI on a tiny random Qwen2.5-VL clip checkpoint, on the 16 presence
questions of ``clip_files.write_clip_set`` under EVS at 12 of 24 tokens (it keeps temporal step 0, tokens 0-11).

Hand-counted cells (frames read at 112 x 84 px, 28 px cells, scale 1.75, a 4-column grid): the square of frames
0-1 (x 5-24 then 13-32, y 10-29) covers cells (0, 0), (0, 1), (1, 0), (1, 1) and, in frame 1, (0, 2) and (1, 2):
tokens 0, 1, 2, 4, 5, 6 of step 0; in frames 2-3 the same cells of step 1, tokens 12, 13, 14, 16, 17, 18. Each
window of two frames holds 2 x 400 square pixels."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_checks import refused
from clip_files import CLIPS, write_clip_set
from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()
STEP_0_SQUARE, STEP_1_SQUARE = {0, 1, 2, 4, 5, 6}, {12, 13, 14, 16, 17, 18}


@pytest.fixture(scope="module")
def clip_set(tmp_path_factory) -> dict[str, Path]:
    return write_clip_set(tmp_path_factory.mktemp("clip_set"))


def run_clips(clip_set, out: Path, *extra: str, questions: Path | None = None, task: str = "video_presence"):
    args = [
        "run",
        "--task",
        task,
        "--model",
        str(clip_set["model"]),
        "--questions",
        str(questions or clip_set["presence"]),
    ]
    args += ["--images", str(clip_set["videos"]), "--out", str(out), "--device", "cpu", *extra]
    return runner.invoke(app, args)


@pytest.fixture(scope="module")
def evs_run(clip_set, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("evs") / "run"
    result = run_clips(clip_set, out, "--selector", "evs", "--budget", "12", "--annotations", str(clip_set["tracks"]))
    assert result.exit_code == 0, result.output
    assert {tuple(row["kept"]) for row in rows(out)} == {tuple(range(12))}  # step 0 whole (the cells below rely on it)
    return out


def rows(folder: Path) -> list[dict]:
    return pq.read_table(folder / "records.parquet").to_pylist()


def intervene(run: Path, out: Path, *extra: str):
    return runner.invoke(
        app, ["intervene", str(run), *extra, "--bootstrap", "20", "--device", "cpu", "--out", str(out)]
    )


def test_restore_puts_back_the_square_of_the_asked_window(evs_run, tmp_path):
    out = tmp_path / "restore"
    result = intervene(evs_run, out, "--mode", "restore")
    assert result.exit_code == 0, result.output
    records = rows(out)
    # eligible: the odd clips' "end" questions, the square in frames 2-3 and no kept token of step 1
    assert sorted({row["question_id"] for row in records}) == [4 * k + 4 for k in range(CLIPS // 2)]
    for row in records:
        kept = set(row["kept"])
        assert len(kept) == 12 and row["cells_changed"] == 6 and row["sampled_frames"] == [0, 1, 2, 3]
        if row["condition"] == "intervention":  # all 6 square cells (max_cells 8) replace 6 of step 0's tokens
            assert kept & STEP_1_SQUARE == STEP_1_SQUARE and row["object_area_changed"] == 800
            assert row["lost_in_window"] is False and row["window_retention"] == 1.0
            assert row["frame_retention"][2:] == [1.0, 1.0] and row["lost"] is False
        else:  # 6 random step-1 cells off the square
            assert not kept & STEP_1_SQUARE and row["object_area_changed"] == 0
            assert row["lost_in_window"] is True and row["window_retention"] == 0.0
        assert len(kept & set(range(12))) == 6
    report = json.loads((out / "intervention.json").read_text())
    assert report["questions"]["eligible"] == report["questions"]["intervened"] == report["questions"]["images"] == 4
    windows = [report[part]["mean_window_retention"] for part in ("recorded", "intervention", "control")]
    assert windows == [0.0, 1.0, 0.0] and "window" in result.output  # a table row (wrapped at the terminal's width)


def test_remove_takes_the_square_of_the_asked_window_out(clip_set, evs_run, tmp_path):
    moved = tmp_path / "moved"  # the frame folders elsewhere: --images, each frame checked against its pin
    shutil.copytree(clip_set["videos"], moved)
    out = tmp_path / "remove"
    result = intervene(evs_run, out, "--mode", "remove", "--images", str(moved))
    assert result.exit_code == 0, result.output
    records = rows(out)
    # eligible: the even clips' "beginning" questions, the square in frames 0-1, all 6 of its cells kept
    assert sorted({row["question_id"] for row in records}) == [4 * k + 1 for k in range(CLIPS // 2)]
    added = {(row["question_id"], row["condition"]): set(row["kept"]) - set(range(12)) for row in records}
    for row in records:
        kept = set(row["kept"])
        assert len(kept) == 12 and added[row["question_id"], row["condition"]] == added[row["question_id"], "control"]
        assert len(added[row["question_id"], "control"]) == 6  # the same 6 step-1 cells in both conditions
        if row["condition"] == "intervention":
            assert not kept & STEP_0_SQUARE and row["object_area_changed"] == -800
            assert row["lost_in_window"] is True and row["window_retention"] == 0.0
        else:
            assert kept & STEP_0_SQUARE == STEP_0_SQUARE and row["object_area_changed"] == 0
            assert row["lost_in_window"] is False and row["window_retention"] == 1.0


def test_an_empty_swap_answers_as_the_run(evs_run, tmp_path, monkeypatch):
    """The re-answer prepares each clip as run does (its frame folder, the checkpoint's declared frame size): under
    the recorded kept set it gives the run's answer."""
    import prune_audit.runner.intervene.execute as execute
    from prune_audit.runner.intervene.swaps import Swap, SwapPair

    monkeypatch.setattr(execute, "plan_swaps", lambda *args: SwapPair(Swap((), ()), Swap((), ())))
    out = tmp_path / "same"
    assert intervene(evs_run, out, "--mode", "restore").exit_code == 0
    recorded = {row["question_id"]: row for row in rows(evs_run)}
    for row in rows(out):
        run_row = recorded[row["question_id"]]
        assert row["kept"] == run_row["kept"] and row["geometry"] == run_row["geometry"]
        assert row["p_yes"] == pytest.approx(run_row["p_yes"], abs=1e-6) and row["answer"] == run_row["answer"]
        assert row["lost_in_window"] is True and math.isnan(run_row["frame_retention"][0])


def test_a_later_stage_and_a_task_without_objects_are_refused_in_one_line(clip_set, evs_run, tmp_path):
    out = tmp_path / "iv"
    refused(
        intervene(evs_run, out, "--mode", "restore", "--stage", "last"), "intervene on a clip run with --stage first"
    )
    mvbench = [{"video": f"c{clip}.mp4", "question": "What moves?", "candidates": ["a cat", "a dog"], "answer": "a cat"}
               for clip in range(CLIPS)]  # fmt: skip
    questions = tmp_path / "moving_direction.json"
    questions.write_text(json.dumps(mvbench))
    mc = tmp_path / "mc"
    assert (
        run_clips(clip_set, mc, "--selector", "evs", "--budget", "12", questions=questions, task="video_mc").exit_code
        == 0
    )
    refused(intervene(mc, out, "--mode", "restore"), "task video_mc names no objects in its images")
    assert not out.exists()
