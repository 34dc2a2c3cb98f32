"""Image selectors on video clips, per frame (``Selector.per_frame``, ``pruners.frame_scope``): through the model,
the kept set equals the selector run by hand on each temporal step's tower features and the logits the stock forward
without the dropped tokens; through `prune-audit run` on the tiny random Qwen2.5-VL clips of tests/test_clip_run.py,
each temporal step keeps its even share of the budget, per-frame evidence is recorded and recounts from the kept
tokens, the manifest says so, the selector's FLOPs are counted per step, keep-all equals dense, and a selector
without a per-frame run (an in-LLM one here; an input one in test_clip_run.py) is refused in one line with nothing
written."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_clip_run import clips, dense, records, recounted, refused, run  # noqa: F401  # its fixtures and helpers
from tiny_models import QUESTIONS, WORDS, masked_reference_logits, random_image

from prune_audit.data.video import sample_clip
from prune_audit.flop_convention import matmul
from prune_audit.models import load_vlm
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import InputSignals, get_selector, list_selectors, selector_class


def feature_width(model) -> int:
    """The tiny checkpoint's language-model width: the width of the features DivPrune compares."""
    config = json.loads((model / "config.json").read_text())
    return config.get("text_config", config)["hidden_size"]


def test_divprune_on_a_clip_selects_each_temporal_step_alone_through_the_model(tmp_path):
    path = QwenModel.build_tiny(tmp_path / "qwen", words=WORDS, image_size=168, text_layers=3, seed=4)
    vlm = load_vlm(path, device="cpu")
    frames = [random_image(seed, (130, 100)) for seed in range(4)]  # 2 steps of a 4 x 5 token grid
    clip = sample_clip(frames, 2.0, min_pixels=4 * 28 * 28, total_pixels=4 * 168 * 168)
    item = vlm.prepare_video(clip, QUESTIONS[0])
    assert item.video_grid == (2, 4, 5)
    prefill, (selection,) = vlm.prefill([item], get_selector("divprune"), 15)
    with torch.no_grad():
        features = vlm.model.model.get_video_features(
            item.pixel_values, item.extras["video_grid_thw"], return_dict=True
        ).pooler_output[0]
    by_hand = [  # each step's 20 features alone, at 8 and 7 of the 15
        step * 20 + get_selector("divprune").select(InputSignals(grid=(4, 5), features=step_features), share).kept
        for step, (step_features, share) in enumerate(zip(features.float().split(20), (8, 7)))
    ]
    assert torch.equal(selection.kept, torch.cat(by_hand))
    reference = masked_reference_logits(vlm, item, [0], [selection.kept.tolist()])
    assert (prefill.logits[0] - reference).abs().max() <= 1e-5


@pytest.mark.parametrize("selector", ["divprune", "coverage"])
def test_an_image_selector_runs_per_frame_on_clips_and_records_per_frame_evidence(clips, tmp_path, selector):
    out = tmp_path / selector
    result = run(clips, out, "--selector", selector, "--budget", "50")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["selector"]["name"] == selector and manifest["selector"]["per_frame"] is True
    width = feature_width(clips["model"])
    for row in records(out):
        geometry = json.loads(row["geometry"])
        size = geometry["frame"]["grid_rows"] * geometry["frame"]["grid_cols"]
        steps = len(geometry["frames"]) // 2  # two sampled frames per temporal step
        kept = np.asarray(row["kept_stages"][0])
        per_step = [int(((kept >= t * size) & (kept < (t + 1) * size)).sum()) for t in range(steps)]
        assert per_step == [50 // steps + (t < 50 % steps) for t in range(steps)]  # crop_budgets' even split
        shares, lost_in_window = recounted(row)
        if row["object"] == "cat":
            np.testing.assert_allclose(row["frame_retention"], shares)
        else:
            assert len(row["frame_retention"]) == 2 * steps and all(math.isnan(v) for v in row["frame_retention"])
        assert row["lost_in_window"] == lost_in_window
        if selector == "divprune":  # one (h w) x (h w) cosine per step, not the clip's (T h w)^2
            assert row["flops_selector"] == steps * matmul(size, width, size)


@pytest.mark.parametrize("selector", [name for name in list_selectors() if selector_class(name).per_frame])
def test_every_per_frame_selector_keeping_all_equals_dense(clips, dense, tmp_path, selector):
    out = tmp_path / selector
    result = run(clips, out, "--selector", selector, "--budget", "all")
    assert result.exit_code == 0, result.output
    for a, b in zip(dense, records(out), strict=True):
        assert b["kept_stages"][0] == a["kept_stages"][0] and b["answer"] == a["answer"]
        assert b["p_yes"] == pytest.approx(a["p_yes"], abs=1e-5)
        assert b["lost_in_window"] == a["lost_in_window"]


def test_an_in_llm_image_selector_on_clips_is_refused_naming_the_per_frame_ones(clips, tmp_path):
    out = tmp_path / "fastv"
    result = run(clips, out, "--selector", "fastv", "--budget", "50")
    refused(result, out, "selector fastv prunes inside the language model over the whole sequence")
    assert "one run per frame (coverage, divprune, gprune, random, uniform)" in result.output
