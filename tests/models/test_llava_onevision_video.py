"""A video clip through LLaVA-OneVision (``LlavaOnevisionModel.read_clip`` / ``prepare_video``): lmms-eval's uniform
frame sampling and the declared frame count, the frames' pixels against the image processor's base view, the
``<video>`` token count against the stock processor's rule, dense prefill logits equal to the stock
``LlavaOnevisionForConditionalGeneration`` forward with ``pixel_values_videos`` (tiny fp32 model, 1e-5: token count,
pooling, trailing newline and order), the clip geometry (round trip, token -> frame and pixel box), the video
selectors keeping all equal to dense, a pruned clip's language-model input rebuilt from the stock modules, the
one-line refusals, and an end-to-end ``prune-audit run --task video_presence`` on clip files.

The tiny tower reads 186-px frames: 13 x 13 patches of 14 px (the last 4 px unseen, as 384 px leave 6) pooled to
7 x 7 tokens of 26 px, an odd grid as the released 27 -> 14."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from clip_files import CLIP_WORDS
from test_clip_run import records, recounted, refused, run, write_clip_files
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.data.geometry import token_footprints, token_index_map
from prune_audit.data.video import ClipGeometry
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.llava_onevision import (
    LlavaOnevisionModel,
    frame_pixels,
    pooled_frame_geometry,
    uniform_frame_indices,
)
from prune_audit.models.video_sampling import VIDEO_SAMPLING_FILE, checkpoint_video_sampling, write_video_sampling
from prune_audit.pruners import get_selector
from prune_audit.pruners.composed import parse_selector
from prune_audit.pruners.signals import InputSignals

TOL = 1e-5
TILE, SIDE, POOLED = 186, 13, 7
FRAME = (90, 70)  # a frame's (width, height) before the resize
VIDEO_SELECTORS = ("evs", "vidcom2", "dycoke", "prunevid", "framefusion")  # those whose signals a OneVision clip gives
PER_FRAME = ("coverage", "divprune", "gprune", "random", "uniform")  # image selectors with a per-frame run


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = LlavaOnevisionModel.build_tiny(
        tmp_path_factory.mktemp("onevision") / "model", words=[*WORDS, "Is"], image_size=TILE, text_layers=3, seed=5
    )
    write_video_sampling(path, {"frames": 4})  # a declared frame count instead of lmms-eval's 32
    return load_vlm(path, device="cpu")


@pytest.fixture(scope="module")
def clip(vlm):
    return vlm.read_clip([random_image(seed, FRAME) for seed in range(6)], 2.0)


@pytest.fixture(scope="module")
def item(vlm, clip):
    return vlm.prepare_video(clip, QUESTIONS[0])


def stock_logits(vlm, item) -> torch.Tensor:
    with torch.no_grad():
        return vlm.model(input_ids=item.input_ids[None], pixel_values_videos=item.pixel_values[None]).logits[:, -1]


def stock_video_features(vlm, item) -> torch.Tensor:
    """(T * h * w + 1, D) the stock ``get_video_features`` of the clip: its pooled frame tokens, then the newline."""
    config = vlm.model.config
    with torch.no_grad():
        return vlm.model.model.get_video_features(
            item.pixel_values[None],
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        ).pooler_output[0]


@pytest.mark.parametrize(("total", "count"), [(6, 4), (100, 32), (7, 32), (1, 3), (32, 32)])
def test_frames_are_sampled_as_lmms_eval_reads_them(total, count):
    assert uniform_frame_indices(total, count) == np.linspace(0, total - 1, count, dtype=int).tolist()


def test_the_declared_frame_count_is_read_and_the_default_is_32(vlm, clip, tmp_path):
    assert clip.geometry.frames == (0, 1, 3, 5) and clip.geometry.frames_per_step == 1  # linspace(0, 5, 4) truncated
    assert clip.geometry.sample_fps == pytest.approx(4 / 6 * 2.0)
    assert [frame.size for frame in clip.frames] == [(TILE, TILE)] * 4
    default = object.__new__(LlavaOnevisionModel)
    default.__dict__.update(vlm.__dict__, video_sampling={})
    assert default.read_clip([random_image(0, FRAME)] * 40, 2.0).geometry.frames == tuple(
        np.linspace(0, 39, 32, dtype=int)
    )
    (tmp_path / VIDEO_SAMPLING_FILE).write_text(json.dumps({"min_pixels": 3136}))  # a Qwen key: refused here
    with pytest.raises(PruneAuditError, match="may hold only frames") as error:
        checkpoint_video_sampling(tmp_path, LlavaOnevisionModel.video_sampling_keys)
    assert "\n" not in str(error.value)


def test_frame_pixels_equal_the_image_processors_base_view(vlm):
    """Where the video path and the image processor coincide: a frame's resize to the tile and its normalisation are
    the processor's base view (crop 0) of that image."""
    processor = vlm.image_processor
    for size in ((TILE, TILE), FRAME):
        image = random_image(3, size)
        resized = vlm.read_clip([image], 1.0).frames[0]
        base_view = processor(images=[image], return_tensors="pt")["pixel_values"][0][0]
        assert torch.allclose(frame_pixels([resized], processor)[0], base_view, atol=1e-5)


def test_the_video_span_holds_the_stock_token_count_and_ends_in_the_newline(vlm, item):
    assert item.video_grid == (4, POOLED, POOLED) and item.grid == (4 * POOLED, POOLED)
    assert item.num_visual == 4 * POOLED * POOLED  # budgets count frame tokens only
    stock = SimpleNamespace(num_image_tokens=SIDE * SIDE, video_token="<video>")
    expected = transformers.LlavaOnevisionProcessor.replace_video_token(
        stock, {"pixel_values_videos": [item.pixel_values]}, 0
    )
    start, end = item.image_span
    assert end - start == len(expected) // len("<video>") == item.num_visual + 1
    assert item.extras["visual_columns"].tolist() == list(range(start, end - 1))
    assert vlm.tower_crops(item) == {"crops": 4, "crop_grid": (SIDE, SIDE), "projected_tokens": 4 * SIDE * SIDE}


def test_released_frames_pool_to_14_x_14_tokens_of_27_px():
    """At the released 384-px SigLIP input: 27 x 27 patches over 378 px pool to 196 tokens of 27 px a frame, and 32
    frames take the stock processor's 32 x 196 + 1 ``<video>`` tokens."""
    frame = pooled_frame_geometry((640, 480), 384, 14)
    assert frame.grid == (14, 14) and frame.token_pixels == 27 and frame.processed_width == 378
    stock = SimpleNamespace(num_image_tokens=27 * 27, video_token="<video>")
    video = transformers.LlavaOnevisionProcessor.replace_video_token(stock, {"pixel_values_videos": [[0] * 32]}, 0)
    assert len(video) // len("<video>") == 32 * frame.num_tokens + 1
    with pytest.raises(PruneAuditError, match="no whole-pixel token cell") as error:
        pooled_frame_geometry((640, 480), 160, 14)  # 11 patches (154 px) pool to 6 tokens: 25.7 px each
    assert "\n" not in str(error.value)


def test_dense_prefill_equals_the_stock_forward(vlm, item):
    prefill, _ = vlm.prefill([item])
    assert (prefill.logits - stock_logits(vlm, item)).abs().max() <= TOL


def test_clip_geometry_round_trips_and_maps_tokens_to_frames_and_pixels(clip):
    geometry = clip.geometry
    assert ClipGeometry.from_dict(json.loads(json.dumps(geometry.to_dict()))) == geometry
    frame = geometry.frame
    assert frame == pooled_frame_geometry(FRAME, TILE, 14) and frame.token_pixels == SIDE * 14 // POOLED == 26
    boxes = token_footprints(frame)
    index = token_index_map(frame)
    for token in (0, 8, 2 * 49 + 6, geometry.num_tokens - 1):
        step, row, col = geometry.token_position(token)
        assert geometry.token_index(step, row, col) == token and geometry.token_frames(token) == (step,)
        box = geometry.token_box(token)
        np.testing.assert_allclose(box, boxes[row * POOLED + col])
        np.testing.assert_allclose(box, (col * 26 * 90 / TILE, row * 26 * 70 / TILE, (col + 1) * 26 * 90 / TILE,
                                         (row + 1) * 26 * 70 / TILE))  # fmt: skip
        centre = int((box[1] + box[3]) / 2), int((box[0] + box[2]) / 2)
        assert index[centre] == row * POOLED + col
        assert geometry.frame_cells(step, [token]) == [row * POOLED + col]
    # the 4 px past the 13 patches of each resized side are seen by no token: the last original pixel column
    assert (index[:, -1] == -1).all() and (index[-1] == -1).all()


@pytest.mark.parametrize("name", VIDEO_SELECTORS)
def test_video_selectors_keeping_all_equal_dense(vlm, item, name):
    full, _ = vlm.prefill([item], get_selector(name), item.num_visual)
    assert (full.logits - stock_logits(vlm, item)).abs().max() <= TOL


@pytest.mark.parametrize("name", PER_FRAME)
def test_per_frame_image_selectors_select_each_frame_alone(vlm, item, name):
    """One frame a temporal step: a per-frame run gives each frame an even share of the budget; keep-all is dense."""
    full, _ = vlm.prefill([item], get_selector(name), item.num_visual)
    assert (full.logits - stock_logits(vlm, item)).abs().max() <= TOL
    _, selections = vlm.prefill([item], get_selector(name), 42)
    assert torch.bincount(selections[0].kept // (POOLED * POOLED), minlength=4).tolist() == [11, 11, 10, 10]


def test_dycoke_with_its_kv_stage_keeping_all_equals_dense_and_prunes_below(vlm, item):
    composed = parse_selector("dycoke+dycoke_kv", [])
    both, _ = vlm.prefill([item], composed, (item.num_visual, item.num_visual))
    assert (both.logits - stock_logits(vlm, item)).abs().max() <= TOL
    pruned, selections = vlm.prefill([item], composed, (120, 60))
    assert selections[0].kept.numel() <= 120 and torch.isfinite(pruned.logits).all()


def test_evs_on_the_clip_keeps_its_mask_and_the_newline(vlm, item):
    """EVS's kept set is its own on the clip's features (the stock pooled tokens, newline left out), and the pruned
    prompt is the stock modules' input with those tokens and the newline after them (compact positions)."""
    evs, budget = get_selector("evs"), 100
    prefill, selections = vlm.prefill([item], evs, budget)
    features = stock_video_features(vlm, item)
    signals = InputSignals(grid=item.grid, features=features[:-1].float(), video_grid=item.video_grid)
    expected = evs.select(signals, budget)
    kept = selections[0].kept
    assert torch.equal(kept, expected.kept) and set(range(49)) <= set(kept.tolist())  # the first frame whole
    start, end = item.image_span
    embed = vlm.model.get_input_embeddings()
    ids = item.input_ids
    embeds = torch.cat([embed(ids[:start]), features[kept], features[-1:], embed(ids[end:])])[None]
    with torch.no_grad():
        reference = vlm.model(inputs_embeds=embeds).logits[0, -1]
    assert (prefill.logits[0] - reference).abs().max() <= TOL


def test_each_frame_is_a_crop_of_the_clip(vlm, item):
    """The tower ran on each frame alone: ``budget_scope=crop`` shares a budget evenly over the frames."""
    crops = vlm.crop_tokens(item)
    assert [grid for _, grid in crops] == [(POOLED, POOLED)] * 4
    assert torch.equal(torch.cat([tokens for tokens, _ in crops]), torch.arange(item.num_visual))
    _, selections = vlm.prefill([item], get_selector("random", budget_scope="crop"), 40)
    assert torch.bincount(selections[0].kept // (POOLED * POOLED), minlength=4).tolist() == [10] * 4


def test_fastvid_and_mixed_batches_are_refused_in_one_line(vlm, item):
    with pytest.raises(PruneAuditError, match="needs step_attention") as error:
        vlm.prefill([item], get_selector("fastvid"), 50)
    assert "on clips it computes no tower attention by frame" in str(error.value) and "\n" not in str(error.value)
    image = vlm.prepare(random_image(0, FRAME), QUESTIONS[0])
    for batch in ([item, image], [image, item]):
        with pytest.raises(PruneAuditError, match="separate batches"):
            vlm.prefill(batch)


@pytest.fixture(scope="module")
def onevision_clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("onevision_clips")
    model = LlavaOnevisionModel.build_tiny(root / "model", words=[*CLIP_WORDS, "Is"], image_size=TILE, seed=2)
    write_video_sampling(model, {"frames": 4})
    return {"model": model, **write_clip_files(root)}


def test_video_presence_runs_end_to_end_on_onevision(onevision_clips, tmp_path):
    """``prune-audit run --task video_presence`` on the tiny OneVision: EVS's records give per-frame evidence
    recounted from the masks (one frame a step), and keeping all equals dense."""
    out = tmp_path / "evs"
    result = run(onevision_clips, out, "--selector", "evs", "--budget", "100")
    assert result.exit_code == 0, result.output
    rows = records(out)
    assert [row["question_id"] for row in rows] == [1, 2, 3]
    for row in rows:
        geometry = json.loads(row["geometry"])
        assert geometry["frames_per_step"] == 1 and row["sampled_frames"] == geometry["frames"] == [0, 1, 3, 5]
        assert len(row["kept"]) == 100
        shares, lost_in_window = recounted(row)
        np.testing.assert_allclose(row["frame_retention"] if row["object"] == "cat" else shares, shares)
        assert row["lost_in_window"] == lost_in_window
    dense, kept_all = tmp_path / "dense", tmp_path / "all"
    assert run(onevision_clips, dense).exit_code == 0
    assert run(onevision_clips, kept_all, "--selector", "evs", "--budget", "all").exit_code == 0
    for a, b in zip(records(dense), records(kept_all)):
        assert a["kept_stages"] == b["kept_stages"] and a["answer"] == b["answer"]
        assert a["p_yes"] == pytest.approx(b["p_yes"], abs=1e-5)
        assert math.isnan(a["retention"]) and math.isnan(b["retention"]) or a["retention"] == b["retention"]
    out = tmp_path / "fastvid"
    refused(run(onevision_clips, out, "--selector", "fastvid", "--budget", "50"), out, "needs step_attention")


@pytest.mark.parametrize("name", [None, "evs", "divprune"])
def test_clip_flops_equal_the_counted_flops(vlm, clip, name):
    """The tower runs on each frame as an image (``tower_crops``) and the projector and pooling on the clip:
    ``FlopCounterMode`` over the same eager forward counts what the accounting says."""
    from test_compute import counted, eager

    counting = eager(load_vlm(vlm.model_id, device="cpu"))
    item = counting.prepare_video(clip, QUESTIONS[0])
    selector = None if name is None else get_selector(name)
    outside, _, answer = counted(counting, item, selector, None if name is None else item.num_visual // 2)
    assert outside == answer.cost.flops_vision + answer.cost.flops_llm, name
