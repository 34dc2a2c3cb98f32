"""What only Qwen2.5-VL has: its 3-D M-RoPE positions, kept when pruning (input level and named in-LLM selectors
equal to the masked reference), generation extending them, its pixel limits and refusals. What every family
shares is in tests/models/test_families_registry.py."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from tiny_models import (
    QUESTIONS,
    WORDS,
    RecordingLayerSelector,
    masked_reference_logits,
    random_image,
)
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector

TOL = 1e-5
NUM_LAYERS = 4
SIZES = [(130, 100), (120, 120)]  # -> 6x7 and 6x6 token grids at 168x168 pixels


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return QwenModel.build_tiny(
        tmp_path_factory.mktemp("qwen") / "qwen", words=WORDS, image_size=168, text_layers=NUM_LAYERS, seed=2
    )


@pytest.fixture(scope="module")
def vlm(path):
    return load_vlm(path, device="cpu")


@pytest.fixture(scope="module")
def prepared(vlm):
    return [vlm.prepare(random_image(seed, size), q) for seed, (size, q) in enumerate(zip(SIZES, QUESTIONS))]


def logits_of(vlm, items, selector=None, budget=None, **kwargs) -> torch.Tensor:
    return vlm.prefill(items, selector, budget, **kwargs)[0].logits


def test_prepare_gives_grid_and_3d_positions(vlm, prepared):
    assert [item.grid for item in prepared] == [(6, 7), (6, 6)]
    item = prepared[0]
    start, end = item.image_span
    positions = item.extras["positions"]
    assert positions.shape == (3, item.input_ids.numel())
    rows, cols = torch.meshgrid(torch.arange(6), torch.arange(7), indexing="ij")
    assert torch.equal(positions[1, start:end] - start, rows.flatten())
    assert torch.equal(positions[2, start:end] - start, cols.flatten())
    assert positions[0, end] == start + 7  # text resumes after max(rows, cols)
    assert item.geometry.mode == "qwen_smart_resize"


def test_input_level_selection_keeps_original_positions(vlm, prepared):
    item, kept = prepared[0], [0, 3, 7, 20, 41]
    reference = masked_reference_logits(vlm, item, [0], [kept])
    assert (logits_of(vlm, [item], forced_kept=[kept])[0] - reference).abs().max() <= TOL
    selected = vlm.answer([item], get_selector("divprune"), 10)[0]
    reference = masked_reference_logits(vlm, item, [0], [selected.kept])
    assert (logits_of(vlm, [item], get_selector("divprune"), 10)[0] - reference).abs().max() <= TOL


@pytest.mark.parametrize("name", ["fastv", "pdrop", "e2s", "sparsevlm", "recording"])
def test_in_llm_drop_equals_masked_reference(vlm, prepared, name):
    item = prepared[1]
    selector = RecordingLayerSelector(layer=2, keep=9) if name == "recording" else get_selector(name)
    prefill, _ = vlm.prefill([item], selector, 20)
    assert prefill.kept_stages[0]
    reference = masked_reference_logits(vlm, item, prefill.stage_layers[0], prefill.kept_stages[0])
    assert (prefill.logits[0] - reference).abs().max() <= TOL


def test_pruned_generation_with_cache_equals_recomputed_prefill(vlm, prepared):
    item, selector = prepared[0], get_selector("fastv")
    text = vlm.generate(item, selector, 20, max_new_tokens=4)
    prefill, _ = vlm.prefill([item], selector, 20)
    stages = [list(zip(prefill.stage_layers[0], prefill.kept_stages[0]))]
    ids, positions, expected = item.input_ids, item.extras["positions"], []
    for _ in range(4):
        extended = replace(item, input_ids=ids, extras={**item.extras, "positions": positions})
        token = int(logits_of(vlm, [extended], selector, forced_stages=stages)[0].argmax())
        if token in vlm.eos_ids():
            break
        expected.append(token)
        ids = torch.cat([ids, torch.tensor([token])])
        positions = torch.cat([positions, positions.amax() + torch.ones(3, 1, dtype=torch.long)], dim=1)
    assert text == vlm.tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_describe_records_pixel_limits(vlm):
    processor = vlm.describe()["processor"]
    assert processor["mode"] == "qwen_smart_resize"
    assert processor["min_pixels"] == processor["max_pixels"] == 168 * 168
    assert vlm.describe()["answer_tokens"]["yes"]


def test_positions_stay_original_for_every_selector(vlm):
    for name in ("divprune", "fastv", "pdrop", "sparsevlm"):
        assert vlm.positions_for(get_selector(name)) == "keep_original"
    with pytest.raises(PruneAuditError, match="no CLS token"):
        vlm.check_selector(get_selector("cls_attn"))


def test_qwen_refuses_clip_text(path):
    with pytest.raises(PruneAuditError, match="Qwen2.5-VL has no CLIP space"):
        load_vlm(path, device="cpu", clip_text=path)


# ----- the downsampling baseline on the image (VTC-Bench's, issue 41) -----------------------------------
DYNAMIC_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 336 * 336}  # dynamic resolution: the image sets the grid
WIDE = (260, 180)  # -> 6 x 9 tokens (252 x 168 processed pixels)


@pytest.fixture(scope="module")
def resizing_vlm(tmp_path_factory):
    path = QwenModel.build_tiny(
        tmp_path_factory.mktemp("qwen_dynamic") / "qwen",
        words=WORDS,
        image_size=168,
        text_layers=NUM_LAYERS,
        seed=3,
        **DYNAMIC_PIXELS,
    )
    return load_vlm(path, device="cpu")


def vtc_tokens(size: tuple[int, int]) -> int:
    """Merged tokens of an image of ``size`` (width, height) under Qwen2-VL's ``smart_resize`` (28-px tokens),
    written out from transformers' ``qwen2_vl`` image processor."""
    width, height = size
    h_bar, w_bar = round(height / 28) * 28, round(width / 28) * 28
    if h_bar * w_bar > DYNAMIC_PIXELS["max_pixels"]:
        beta = math.sqrt(height * width / DYNAMIC_PIXELS["max_pixels"])
        h_bar, w_bar = max(28, math.floor(height / beta / 28) * 28), max(28, math.floor(width / beta / 28) * 28)
    elif h_bar * w_bar < DYNAMIC_PIXELS["min_pixels"]:
        beta = math.sqrt(DYNAMIC_PIXELS["min_pixels"] / (height * width))
        h_bar, w_bar = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    return (h_bar // 28) * (w_bar // 28)


def vtc_ratio_size(size: tuple[int, int], budget: int) -> tuple[int, int]:
    """VTC-Bench's ``image.resize((W // r, H // r), BICUBIC)`` for the smallest integer r whose tokens fit."""
    ratio = next(r for r in range(1, 100) if vtc_tokens((size[0] // r, size[1] // r)) <= budget)
    return size[0] // ratio, size[1] // ratio


@pytest.mark.parametrize("budget", [6, 15, 20, 40])
def test_downsample_resizes_the_image_as_vtc_bench_and_reruns_the_tower(resizing_vlm, budget):
    """factor=integer: the processed image is VTC-Bench's resize, its tokens fit the budget, and the prefill is
    the stock one on the PIL-bicubic-resized image (every token fed, M-RoPE ids of the smaller grid)."""
    image, selector = random_image(0, WIDE), get_selector("downsample", factor="integer")
    item = resizing_vlm.prepare_for(image, QUESTIONS[0], selector, budget)
    size = vtc_ratio_size(WIDE, budget)
    on_resized = resizing_vlm.prepare(image.resize(size, Image.Resampling.BICUBIC), QUESTIONS[0])
    assert item.num_visual == vtc_tokens(size) <= budget and item.dense_grid == (6, 9)
    assert item.image_size == WIDE and item.geometry.image_size == WIDE
    assert item.geometry.grid == on_resized.geometry.grid == item.grid
    torch.testing.assert_close(item.extras["positions"], on_resized.extras["positions"], rtol=0, atol=0)
    pruned, selections = resizing_vlm.prefill([item], selector, budget)
    assert selections == [None] and pruned.tokens_per_layer[0][0] == item.num_visual
    torch.testing.assert_close(pruned.logits, logits_of(resizing_vlm, [on_resized]), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("budget", [4, 9, 20, 40])
def test_downsample_fit_takes_the_largest_image_within_the_budget(resizing_vlm, budget):
    """factor=fit: the size's tokens fit and one pixel more on the longer side would not."""
    item = resizing_vlm.prepare_for(random_image(0, WIDE), QUESTIONS[0], get_selector("downsample"), budget)
    assert item.num_visual <= budget and item.pixel_values.shape[0] == item.num_visual * 4  # 2 x 2 patches a token
    long = next(side for side in range(WIDE[0], 0, -1) if vtc_tokens((side, (2 * side * 180 + 260) // 520)) <= budget)
    assert item.num_visual == vtc_tokens((long, (2 * long * 180 + 260) // 520))
    assert long == WIDE[0] or vtc_tokens((long + 1, (2 * (long + 1) * 180 + 260) // 520)) > budget


def test_downsample_keeping_every_token_is_the_dense_prompt(resizing_vlm):
    image, selector = random_image(1, WIDE), get_selector("downsample")
    item, dense = resizing_vlm.prepare_for(image, QUESTIONS[0], selector, 54), resizing_vlm.prepare(image, QUESTIONS[0])
    assert item.geometry == dense.geometry and item.grid == dense.grid
    torch.testing.assert_close(logits_of(resizing_vlm, [item], selector, 54), logits_of(resizing_vlm, [dense]))


def test_downsample_costs_the_smaller_tower_and_prefill(resizing_vlm):
    """The cost is the stock prefill's on the resized image (its tower, projector and LLM; the selector counts 0),
    the dense cost that of the image as given."""
    image, selector = random_image(2, WIDE), get_selector("downsample", factor="integer")
    item = resizing_vlm.prepare_for(image, QUESTIONS[0], selector, 15)
    on_resized = resizing_vlm.prepare(image.resize(vtc_ratio_size(WIDE, 15), Image.Resampling.BICUBIC), QUESTIONS[0])
    (answer,) = resizing_vlm.answer([item], selector, 15)
    (small,) = resizing_vlm.answer([on_resized])
    (dense,) = resizing_vlm.answer([resizing_vlm.prepare(image, QUESTIONS[0])])
    assert answer.cost.flops == small.cost.flops < dense.cost.flops == answer.cost.flops_dense
    assert (answer.cost.flops_vision, answer.cost.flops_llm) == (small.cost.flops_vision, small.cost.flops_llm)


def test_downsample_refusals_are_one_line(resizing_vlm):
    image, selector = random_image(0, WIDE), get_selector("downsample")
    resizing_vlm.check_selector(selector)  # runs here: it acts on the image
    with pytest.raises(PruneAuditError, match="prepare_for") as error:
        resizing_vlm.prefill([resizing_vlm.prepare(image, QUESTIONS[0])], selector, 20)
    with pytest.raises(PruneAuditError, match="at least 4") as small:
        resizing_vlm.prepare_for(image, QUESTIONS[0], selector, 3)
    assert "\n" not in str(error.value) + str(small.value)


def test_downsample_run_records_the_resized_geometry(workspace, tmp_path):
    """``run`` on the workspace's 64 x 64 scenes with a dynamic-resolution Qwen2.5-VL (28 px a token down to one
    token): dense 2 x 2 tokens (56 x 56 processed); downsample@2, factor=integer resizes to 32 x 32 (r = 2), one
    token of 28 x 28 processed pixels. Each record keeps that token, its geometry is the 32 x 32 image's mapped
    back to the 64 x 64 original (scale 28 / 64), so every object pixel lies in it: retention 1, one object token,
    nothing lost or diluted; the cost is the one-token prefill's, the dense one the 4-token prompt's."""
    from tiny_models import run_args

    from prune_audit.data.geometry import mapped_to_original, qwen_geometry
    from prune_audit.data.scenes import CATEGORIES

    checkpoint = QwenModel.build_tiny(
        tmp_path / "qwen", words=[*WORDS, "Is", *CATEGORIES], text_layers=2, seed=4, min_pixels=28 * 28
    )
    out = tmp_path / "run"
    args = run_args(workspace, checkpoint, out, "--selector", "downsample", "--option", "factor=integer")
    result = CliRunner().invoke(app, [*args, "--budget", "2"])
    assert result.exit_code == 0, result.output
    expected = mapped_to_original(qwen_geometry((32, 32), min_pixels=28 * 28, max_pixels=112 * 112), (64, 64))
    assert expected.grid == (1, 1) and expected.scale_x == 28 / 64
    records = pq.read_table(out / "records.parquet").to_pylist()
    assert len(records) == 4 and any(record["object_area"] for record in records)
    for record in records:
        assert json.loads(record["geometry"]) == expected.to_dict()
        assert record["kept"] == [0] and record["visual_tokens_avg"] == 1
        assert record["flops"] < record["flops_dense"]
        if record["object_area"]:
            assert record["retention"] == 1.0 and record["object_tokens_kept"] == 1
            assert record["lost"] is False and record["diluted"] is False
