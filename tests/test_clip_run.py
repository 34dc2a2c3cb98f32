"""`prune-audit run` on video clips, end to end through the CLI on a tiny random Qwen2.5-VL (it answers nonsense; the
records must be complete and consistent): video_presence under EVS with per-frame evidence recounted from the masks
and the kept tokens, keep-all equal to dense, video_mc under VidCom2, and the one-line refusals with nothing written
(a still-image family, an image selector without a per-frame run, a video file instead of a frame folder, a missing frame folder)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from clip_files import H, W, square_mask, tiny_clip_model, write_clip, write_tracks
from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()
FRAMES = 6


def write_clip_files(root: Path) -> dict[str, Path]:
    """The clip task files under ``root``: the frame folder ``videos/slide/`` (a cat sliding over the first three
    frames), its tracks, three video_presence questions and one video_mc question (a tiny model of any family that
    takes clips answers them, its vocabulary holding ``CLIP_WORDS``)."""
    videos = root / "videos"
    write_clip(videos / "slide", [square_mask(frame) for frame in range(FRAMES)])
    write_tracks(root / "tracks.json", {"slide": [square_mask(frame) for frame in range(FRAMES)]})
    presence = [
        {"question_id": 1, "video": "slide.mp4", "question": "Is there a cat at the beginning of the video?",
         "answer": "yes", "category": "cat", "window": [0, 1]},
        {"question_id": 2, "video": "slide.mp4", "question": "Is there a cat at the end of the video?",
         "answer": "no", "category": "cat", "window": [4, 5]},
        {"question_id": 3, "video": "slide.mp4", "question": "Is there a dog in the video?", "answer": "no",
         "category": "dog", "window": None, "fps": 3.0},
    ]  # fmt: skip
    (root / "presence.json").write_text(json.dumps(presence))
    mvbench = [{"video": "slide.mp4", "question": "What moves?", "candidates": ["a cat", "a dog", "nothing"],
                "answer": "a cat"}]  # fmt: skip
    (root / "moving_direction.json").write_text(json.dumps(mvbench))
    return {"videos": videos, "tracks": root / "tracks.json", "presence": root / "presence.json",
            "mvbench": root / "moving_direction.json", "root": root}  # fmt: skip


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clips")
    return {"model": tiny_clip_model(root / "qwen"), **write_clip_files(root)}


def run(clips, out: Path, *extra: str, task: str = "video_presence", model: Path | None = None):
    questions = clips["presence"] if task == "video_presence" else clips["mvbench"]
    args = ["run", "--task", task, "--model", str(model or clips["model"]), "--questions", str(questions)]
    args += ["--images", str(clips["videos"]), "--out", str(out), "--device", "cpu", *extra]
    if task == "video_presence":
        args += ["--annotations", str(clips["tracks"])]
    return runner.invoke(app, args)


def records(out: Path):
    return pq.read_table(out / "records.parquet").to_pylist()


def recounted(record: dict, stage: int = 0) -> tuple[list[float], bool | None]:
    """Per sampled frame the share of the mask whose pixel centres fall in a kept cell of its step, and lost in the
    window, counted from the masks, the recorded geometry and the kept tokens of ``stage`` (the first)."""
    geometry = json.loads(record["geometry"])
    per_step = geometry["frames_per_step"]
    frame = geometry["frame"]
    rows, cols, side = frame["grid_rows"], frame["grid_cols"], frame["token_pixels"]
    kept = set(record["kept_stages"][stage])
    shares, window_kept, window_total = [], 0, 0
    for k, stored in enumerate(geometry["frames"]):
        mask = square_mask(stored) if record["object"] == "cat" else np.zeros((H, W), dtype=bool)
        covered = 0
        for y, x in zip(*np.nonzero(mask)):  # the pixel centre's cell in the resized frame
            row = int((y + 0.5) * frame["scale_y"] // side)
            col = int((x + 0.5) * frame["scale_x"] // side)
            covered += (k // per_step) * rows * cols + row * cols + col in kept
        shares.append(covered / mask.sum() if mask.sum() else math.nan)
        window = record["window"] or [0, FRAMES - 1]
        if window[0] <= stored <= window[1]:
            window_kept, window_total = window_kept + covered, window_total + int(mask.sum())
    return shares, (None if window_total == 0 else window_kept == 0)


def test_presence_under_evs_records_per_frame_evidence(clips, tmp_path):
    out = tmp_path / "evs"
    result = run(clips, out, "--selector", "evs", "--budget", "150")
    assert result.exit_code == 0, result.output
    rows = records(out)
    lost = sum(row["lost_in_window"] is True for row in rows)
    measured = sum(row["lost_in_window"] is not None for row in rows)
    assert re.search(rf"objects lost in the asked window, first stage\s*│\s*{lost} of {measured}", result.output)
    assert [row["question_id"] for row in rows] == [1, 2, 3] and {row["task"] for row in rows} == {"video_presence"}
    # 6 frames at the default 2 fps: all read; the dog question's clip at 3 fps: 4 of round(linspace(0, 5, 4))
    sampled = [list(range(FRAMES)), list(range(FRAMES)), [0, 2, 3, 5]]
    for row, frames in zip(rows, sampled):
        geometry = json.loads(row["geometry"])
        assert row["sampled_frames"] == geometry["frames"] == frames
        assert len(row["kept"]) == 150 and row["label"] in ("yes", "no") and row["answer"] in ("yes", "no")
        shares, lost_in_window = recounted(row)
        np.testing.assert_allclose(row["frame_retention"] if row["object"] == "cat" else shares, shares)
        assert row["lost_in_window"] == lost_in_window
    beginning, end, dog = rows
    assert beginning["window"] == [0, 1] and end["window"] == [4, 5] and dog["window"] is None
    assert end["lost_in_window"] is None and math.isnan(end["window_retention"])  # the cat is gone by frame 4
    assert beginning["object_area"] == 3 * 400 and beginning["evidence_objects"] == ["cat"]
    assert len(dog["frame_retention"]) == 4 and all(math.isnan(v) for v in dog["frame_retention"])
    assert dog["lost"] is None and dog["evidence_objects"] == []
    assert beginning["lost"] == (beginning["object_tokens_kept"] == 0)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["images"]["count"] == FRAMES  # every frame pinned by content
    assert manifest["processor"]["first_image"]["frames"] == list(range(FRAMES))


def test_per_frame_evidence_at_every_stage_of_an_in_llm_clip_stage(clips, tmp_path):
    """``dycoke+dycoke_kv`` records an input stage and a decoder stage: each stage's per-frame retention and loss in
    the window are recounted from that stage's kept tokens; the unsuffixed columns are the first stage's."""
    out = tmp_path / "dycoke"
    result = run(clips, out, "--selector", "dycoke+dycoke_kv", "--budget", "200,120")
    assert result.exit_code == 0, result.output
    for row in records(out):
        assert len(row["kept_stages"]) == len(row["frame_retention_stages"]) == len(row["lost_in_window_stages"]) == 2
        assert row["kept_stages"][1] != row["kept_stages"][0]
        for stage in range(2):
            shares, lost_in_window = recounted(row, stage)
            recorded = row["frame_retention_stages"][stage]
            np.testing.assert_allclose(recorded if row["object"] == "cat" else shares, shares)
            assert row["lost_in_window_stages"][stage] == lost_in_window
        np.testing.assert_equal(row["frame_retention"], row["frame_retention_stages"][0])
        assert row["lost_in_window"] == row["lost_in_window_stages"][0]


def test_keep_all_equals_dense(clips, tmp_path):
    dense, kept_all = tmp_path / "dense", tmp_path / "all"
    assert run(clips, dense).exit_code == 0
    result = run(clips, kept_all, "--selector", "evs", "--budget", "all")
    assert result.exit_code == 0, result.output
    for a, b in zip(records(dense), records(kept_all)):
        assert a["kept_stages"] == b["kept_stages"] and a["answer"] == b["answer"]
        assert a["p_yes"] == pytest.approx(b["p_yes"], abs=1e-5) and a["logit_diff"] == pytest.approx(
            b["logit_diff"], abs=1e-4
        )
        assert a["retention"] == b["retention"] or math.isnan(a["retention"]) and math.isnan(b["retention"])
        assert a["lost_in_window"] == b["lost_in_window"]


def test_video_mc_under_vidcom2_at_a_share_of_the_clips_tokens(clips, tmp_path):
    out = tmp_path / "mc"
    result = run(clips, out, "--selector", "vidcom2", "--budget", "25%", task="video_mc")
    assert result.exit_code == 0, result.output
    (row,) = records(out)
    assert row["split"] == "moving_direction" and row["references"] == ["A"] and row["answer_text"] in "ABC"
    steps, rows, cols = 3, *[json.loads(row["geometry"])["frame"][k] for k in ("grid_rows", "grid_cols")]
    assert len(row["letter_probs"]) == row["options_offered"] == 3 and len(row["kept"]) == steps * rows * cols // 4
    assert row["sampled_frames"] == list(range(FRAMES)) and row["frame_retention"] is None and row["window"] is None
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompt"]["first"].count("Only give the best option.") == 1


def refused(result, out: Path, needle: str) -> None:
    assert result.exit_code != 0 and needle in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_a_still_image_family_is_refused(clips, workspace, tmp_path):
    out = tmp_path / "llava"
    result = run(clips, out, model=workspace["model"])
    refused(result, out, "use a checkpoint of a family that takes clips (qwen2_5_vl")
    assert "llava_onevision" in result.output and "qwen3_vl" in result.output


def test_an_image_selector_without_a_per_frame_run_on_clips_is_refused(clips, tmp_path):
    out = tmp_path / "hiprune"  # per-layer vision attention: not computed on clips (tests/test_clip_per_frame.py)
    refused(run(clips, out, "--selector", "hiprune", "--budget", "50"), out, "has no per-frame run")


def test_a_video_file_or_a_missing_folder_is_refused(clips, tmp_path):
    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "slide.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    out = tmp_path / "file"
    args = ["--images", str(videos)]
    refused(run(clips, out, *args), out, "is a video file, and clips are read as frame folders: extract its frames")
    (videos / "slide.mp4").unlink()
    refused(run(clips, out, *args), out, "no frame folder")


def clip_selectors() -> list[str]:
    """Every registered selector ``run`` takes on clips: it reads the temporal grid or is declared a video method's."""
    from prune_audit.pruners import list_selectors, selector_class
    from prune_audit.pruners.signals import VIDEO_GRID

    return [n for n in list_selectors() if selector_class(n).clip_method or VIDEO_GRID in selector_class(n).requires]


@pytest.fixture(scope="module")
def dense(clips, tmp_path_factory):
    out = tmp_path_factory.mktemp("dense") / "run"
    assert run(clips, out).exit_code == 0
    return records(out)


@pytest.mark.parametrize("selector", clip_selectors())
def test_every_clip_selector_keeping_all_equals_dense_or_is_refused_in_one_line(clips, dense, tmp_path, selector):
    from prune_audit.models.qwen import QwenModel
    from prune_audit.pruners import get_selector, selector_class
    from prune_audit.pruners.signals import STEP_ATTENTION, VIDEO_GRID

    out = tmp_path / selector
    # a default that ignores the budget (a video method's official in-LLM share) keeps all under its average rule
    averaging = () if get_selector(selector).averages_budget else ("--option", "budget_rule=average")
    result = run(clips, out, "--selector", selector, "--budget", "all", *averaging)
    refusal = QwenModel.refusal(selector_class(selector), QwenModel.input_signals | {VIDEO_GRID, STEP_ATTENTION})
    if refusal is not None:  # the family lacks what it needs on clips too (merged tokens' positions)
        return refused(result, out, f"selector {selector!r} needs")
    assert result.exit_code == 0, result.output
    for a, b in zip(dense, records(out)):
        assert b["kept_stages"][0] == a["kept_stages"][0] and b["answer"] == a["answer"]
        assert b["p_yes"] == pytest.approx(a["p_yes"], abs=1e-5)
        assert b["lost_in_window"] == a["lost_in_window"]


def test_an_image_selector_composed_after_a_video_selector_is_refused(clips, tmp_path):
    out = tmp_path / "composed"
    refused(
        run(clips, out, "--selector", "evs+fastv", "--budget", "200,100"),
        out,
        "selector fastv prunes inside the language",
    )


def test_a_clip_run_resumes_and_is_visualized(clips, tmp_path):
    out = tmp_path / "evs"
    assert run(clips, out, "--selector", "evs", "--budget", "150").exit_code == 0
    first = (out / "records.parquet").read_bytes()
    again = run(clips, out, "--selector", "evs", "--budget", "150")
    assert again.exit_code == 0 and (out / "records.parquet").read_bytes() == first  # all recorded: nothing asked
    drawn = runner.invoke(app, ["visualize", "--run", str(out), "--question-id", "1", "--out", str(tmp_path / "v.png")])
    assert drawn.exit_code == 0 and (tmp_path / "v.png").exists()  # a frame strip (tests/test_clip_visualize.py)
