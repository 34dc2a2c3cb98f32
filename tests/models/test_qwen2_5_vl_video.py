"""A video clip through Qwen2.5-VL (``QwenModel.prepare_video``): the patch flattening against the official image
processor and an independent re-derivation of the video processor's order (transformers' video processor needs
torchvision, not installed), the M-RoPE time axis, dense prefill logits equal to the stock forward on the same
inputs (tiny fp32 model, 1e-5), EVS on the clip (its kept tokens are the EVS mask's, keep-all equals dense), and the
one-line refusals (EVS on still images, clips on other families, mixed batches); FrameFusion inside the LLM on
clips (keep-all equals dense; layer 0's merge of a clip of one repeated frame is the selector's on the clip's
features)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import QUESTIONS, WORDS, masked_reference_logits, random_image, stock_inputs

from prune_audit.data.video import sample_clip
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.families import adapter_for, family_names
from prune_audit.models.qwen import QwenModel, video_patches
from prune_audit.pruners import get_selector
from prune_audit.pruners.signals import InputSignals, LayerSignals

TOL = 1e-5
SMALL = {"min_pixels": 4 * 28 * 28, "total_pixels": 4 * 168 * 168}  # tiny frames: a 4 x 5 token grid of 130 x 100


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = QwenModel.build_tiny(
        tmp_path_factory.mktemp("qwen") / "qwen", words=WORDS, image_size=168, text_layers=3, seed=4
    )
    return load_vlm(path, device="cpu")


@pytest.fixture(scope="module")
def clip():
    return sample_clip([random_image(seed, (130, 100)) for seed in range(4)], 2.0, **SMALL)  # 2 s: 4 frames


@pytest.fixture(scope="module")
def item(vlm, clip):
    return vlm.prepare_video(clip, QUESTIONS[0])


def stock_logits(vlm, item) -> torch.Tensor:
    with torch.no_grad():
        return vlm.model(**stock_inputs(vlm, item)).logits[:, -1]


def rederived_patches(frames, processor) -> torch.Tensor:
    """The Qwen2-VL video processor's flattening, token by token: for temporal patch t and patch (i, j) of the
    14-px grid in merge-block order, the values of channel c, frame 2t + f, pixel (y, x) of the patch."""
    patch, merge = processor.patch_size, processor.merge_size
    mean, std = np.array(processor.image_mean), np.array(processor.image_std)
    video = np.stack([(np.asarray(f, dtype=np.float64) / 255 - mean) / std for f in frames])  # (F, H, W, C)
    steps, rows, cols = len(frames) // 2, video.shape[1] // patch, video.shape[2] // patch
    out = []
    for t in range(steps):
        for block_row in range(rows // merge):
            for block_col in range(cols // merge):
                for i in range(merge):
                    for j in range(merge):
                        y, x = (block_row * merge + i) * patch, (block_col * merge + j) * patch
                        cells = video[2 * t : 2 * t + 2, y : y + patch, x : x + patch]  # (2, p, p, C)
                        out.append(cells.transpose(3, 0, 1, 2).reshape(-1))  # (C, frame, y, x)
    return torch.tensor(np.stack(out), dtype=torch.float32)


def test_patches_follow_the_official_flattening(vlm, clip):
    processor = vlm.image_processor
    pixels = video_patches(clip.frames, processor)
    assert torch.allclose(pixels, rederived_patches(clip.frames, processor), atol=1e-5)
    # a still frame twice is the image processor's own temporal patch of that frame (168 x 168: its fixed size)
    frame = random_image(5, (168, 168))
    official = processor(images=[frame], return_tensors="pt")
    assert official["image_grid_thw"].tolist() == [[1, 12, 12]]
    assert torch.allclose(video_patches([frame, frame], processor), official["pixel_values"], atol=1e-5)


def test_prepare_video_gives_the_clip_grid_and_time_positions(vlm, clip, item):
    assert clip.geometry.video_grid == (2, 4, 5)
    assert item.video_grid == (2, 4, 5) and item.grid == (8, 5) and item.num_visual == 40
    assert item.extras["video_grid_thw"].tolist() == [[2, 8, 10]]
    assert item.extras["second_per_grid_ts"].tolist() == [1.0]  # two frames at 2 fps
    start, end = item.image_span
    positions = item.extras["positions"][:, start:end] - start
    step = int(vlm.model.config.vision_config.tokens_per_second * 1.0)  # get_rope_index: tokens_per_second x seconds
    assert positions[0].tolist() == [0] * 20 + [step] * 20
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(5), indexing="ij")
    assert torch.equal(positions[1], rows.flatten().repeat(2))
    assert torch.equal(positions[2], cols.flatten().repeat(2))


def test_dense_prefill_equals_the_stock_forward(vlm, item):
    prefill, _ = vlm.prefill([item])
    assert (prefill.logits - stock_logits(vlm, item)).abs().max() <= TOL


def test_evs_keeps_the_evs_mask_and_keep_all_is_dense(vlm, item):
    evs = get_selector("evs")
    prefill, selections = vlm.prefill([item], evs, 27)
    features = vlm.model.model.get_video_features(
        item.pixel_values, item.extras["video_grid_thw"], return_dict=True
    ).pooler_output[0]
    expected = evs.select(InputSignals(grid=item.grid, features=features.float(), video_grid=item.video_grid), 27)
    assert torch.equal(selections[0].kept, expected.kept)
    assert set(range(20)) <= set(selections[0].kept.tolist())  # the first temporal step whole
    reference = masked_reference_logits(vlm, item, [0], [selections[0].kept.tolist()])
    assert (prefill.logits[0] - reference).abs().max() <= TOL
    full, _ = vlm.prefill([item], evs, item.num_visual)
    assert (full.logits - stock_logits(vlm, item)).abs().max() <= TOL


def test_evs_is_refused_on_still_images_in_one_line(vlm):
    image = vlm.prepare(random_image(0, (130, 100)), QUESTIONS[0])
    with pytest.raises(PruneAuditError, match="still image") as refusal:
        vlm.prefill([image], get_selector("evs"), 10)
    assert "\n" not in str(refusal.value)
    for family in family_names():  # no family gives a still image a temporal grid
        assert "still image" in adapter_for(family, "test").selector_support()["evs"]


def test_clips_and_images_in_one_batch_are_refused(vlm, item):
    image = vlm.prepare(random_image(0, (130, 100)), QUESTIONS[0])
    with pytest.raises(PruneAuditError, match="separate batches"):
        vlm.prefill([item, image])


def test_qwen2_vl_refuses_clips(clip):
    adapter = adapter_for("qwen2_vl", "test")  # Qwen3-VL reads its own: tests/models/test_qwen3_vl_video.py
    assert not adapter.takes_video
    with pytest.raises(
        PruneAuditError, match="Qwen2-VL has no video path here; use a checkpoint of a family that reads clips"
    ):
        adapter.prepare_video(object.__new__(adapter), clip, "q")


def clip_features(vlm, item) -> torch.Tensor:
    """(T * h * w, D) float32 merged video features of a prepared clip (the language model's layer-0 input)."""
    return (
        vlm.model.model.get_video_features(item.pixel_values, item.extras["video_grid_thw"], return_dict=True)
        .pooler_output[0]
        .float()
    )


def test_framefusion_on_a_clip(vlm, clip, item):
    framefusion = get_selector("framefusion")
    full, _ = vlm.prefill([item], framefusion, item.num_visual)
    assert (full.logits - stock_logits(vlm, item)).abs().max() <= TOL
    pruned, _ = vlm.prefill([item], framefusion, 20)
    assert pruned.stage_layers[0] == list(range(vlm.num_layers))
    assert sum(pruned.tokens_per_layer[0]) / vlm.num_layers <= 21  # the cost model spends at most the budget
    frame = random_image(7, (130, 100))
    still = vlm.prepare_video(sample_clip([frame] * 4, 2.0, **SMALL), QUESTIONS[0])  # two identical steps
    prefill, _ = vlm.prefill([still], framefusion, 27)
    stage = framefusion.schedule(vlm.num_layers, still.num_visual, 27)[0]
    signals = LayerSignals(
        alive=torch.arange(still.num_visual), grid=still.grid, layer=0, num_layers=vlm.num_layers,
        hidden_states=clip_features(vlm, still), text_probs=torch.zeros(1, 1, still.num_visual),
        video_grid=still.video_grid,
    )  # fmt: skip
    state: dict = {}
    kept = framefusion.prune(stage, signals, state)
    merge = framefusion.merge(stage, signals, state, kept)
    assert merge is not None and kept.numel() < still.num_visual  # the second step merges into the first
    heads = set(merge.replaces.tolist())
    assert prefill.kept_stages[0][0] == [cell for cell in kept.tolist() if cell not in heads]
    assert sorted(prefill.merged_stages[0][0]) == sorted(group.tolist() for group in merge.members)
    assert prefill.tokens_per_layer[0] == [kept.numel()] * vlm.num_layers  # a bounded merge ends the process
    assert torch.isfinite(prefill.logits).all()


def test_framefusion_is_refused_on_still_images_in_one_line(vlm):
    image = vlm.prepare(random_image(0, (130, 100)), QUESTIONS[0])
    with pytest.raises(PruneAuditError, match="still image") as refusal:
        vlm.prefill([image], get_selector("framefusion"), 10)
    assert "\n" not in str(refusal.value)


@pytest.fixture(scope="module")
def eager_vlm(vlm):
    from test_compute import eager

    return eager(load_vlm(vlm.model_id, device="cpu"))


@pytest.mark.parametrize(
    "name, options",
    [(None, {}), ("evs", {}), ("fastvid", {"merge": False}), ("divprune", {}), ("vidcom2", {}), ("fastv", {})],
)
def test_clip_flops_equal_the_counted_flops(eager_vlm, clip, name, options, monkeypatch):
    """On a clip the tower attends within each temporal step (T images of one step's patches, windows tiling each
    step) and FastVID's step attention is counted: ``FlopCounterMode`` over the same eager forward counts what
    the accounting says, outside the selector's own methods and inside them; the step attention is named a signal
    source exactly when it ran."""
    from test_compute import counted

    ran = []
    step_attention = eager_vlm._step_attention
    monkeypatch.setattr(eager_vlm, "_step_attention", lambda *args: ran.append(1) or step_attention(*args))
    item = eager_vlm.prepare_video(clip, QUESTIONS[0])
    selector = None if name is None else get_selector(name, **options)
    budget = None if name is None else item.num_visual // 2
    outside, inside, answer = counted(eager_vlm, item, selector, budget)
    assert outside == answer.cost.flops_vision + answer.cost.flops_llm, name
    if selector is not None and selector.flops_exact:
        assert inside == answer.cost.flops_selector, name
    assert ("vision_step_attention" in answer.cost.signal_sources) == bool(ran) == (name == "fastvid")


@pytest.mark.parametrize(
    "name, options",
    [
        ("fastvid", {"merge": False}),
        ("prunevid", {"merge": False}),
        ("prunevid", {"merge": False, "cluster_ratio": 0.5}),
    ],
)
@pytest.mark.parametrize("share", [2, 4])
def test_video_selector_flops_equal_the_counted_flops(eager_vlm, clip, name, options, share):
    """FastVID's and PruneVid's own arithmetic depends on the clip (segments, density candidates, static tokens,
    clusters): the accounting's ``flops_selector``, from the sizes the selection reports, equals what
    ``FlopCounterMode`` counts inside the selector's methods, at a half and a quarter of the clip's tokens."""
    from test_compute import counted

    item = eager_vlm.prepare_video(clip, QUESTIONS[0])
    selector = get_selector(name, **options)
    _, inside, answer = counted(eager_vlm, item, selector, item.num_visual // share)
    assert selector.flops_exact and inside == answer.cost.flops_selector > 0
