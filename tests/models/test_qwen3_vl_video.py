"""A video clip through Qwen3-VL (``Qwen3VLModel.read_clip`` / ``prepare_video``): qwen-vl-utils' Qwen3-VL frame
sizes, the prompt equal to the one ``Qwen3VLProcessor`` expands (a text timestamp and its own vision markers per
temporal step), the per-step M-RoPE ids, dense prefill logits equal to the stock forward on the processor's inputs
(tiny fp32 model, 1e-5: timestamps, ids and the video deepstack sets), each selector run takes on clips (keep-all
equals dense, a pruned input equal to the stock forward with the dropped keys masked), the clip's FLOPs as counted
and the one-line refusals; then ``prune-audit run --task video_presence`` end to end on the CLI with
test_clip_run's clip files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from clip_files import CLIP_WORDS
from test_clip_run import records, recounted, refused, run, write_clip_files
from test_qwen2_5_vl_video import rederived_patches
from tiny_models import (
    QUESTIONS,
    WORDS,
    assert_batch_equals_one_at_a_time,
    masked_reference_logits,
    random_image,
    stock_inputs,
)

from prune_audit.data.video import Clip, sample_clip
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.qwen import video_patches
from prune_audit.models.qwen3_vl import Qwen3VLModel, step_seconds
from prune_audit.models.video_sampling import write_video_sampling
from prune_audit.pruners import get_selector

TOL = 1e-5
LLM_STAGE = ("dycoke_kv", "framefusion", "prunevid_llm", "holitom_llm")
#: the timestamps of the clip below as words, so that the tiny tokenizer gives each its own id
TIME_WORDS = ["<", ">", "seconds", "0.3", "1.3"]
SMALL = {"min_pixels": 4 * 32 * 32, "total_pixels": 4 * 192 * 192}  # tiny frames: 130 x 100 -> a 3 x 4 token grid
#: what run takes on Qwen3-VL clips: the video selectors (FastVID and HoliTom refused: no step attention), PruneVid
#: without its
#: merge (merged tokens have no 3-D position) and the image selectors with a per-frame run
CLIP_SELECTORS = [
    ("evs", {}), ("vidcom2", {}), ("dycoke", {}), ("dycoke_kv", {}), ("framefusion", {}), ("prunevid", {"merge": False}),
    ("prunevid_llm", {"budget_rule": "average"}),  # its official default keeps 0.4 of each step whatever the budget
    ("holitom_llm", {"budget_rule": "average"}),  # its official default folds half whatever the budget
    ("coverage", {}), ("divprune", {}), ("gprune", {}), ("random", {}), ("uniform", {}),
]  # fmt: skip


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = Qwen3VLModel.build_tiny(
        tmp_path_factory.mktemp("qwen3") / "qwen3", words=[*WORDS, *TIME_WORDS], text_layers=3, seed=4
    )
    write_video_sampling(path, SMALL)
    return load_vlm(path, device="cpu")


@pytest.fixture(scope="module")
def clip(vlm):
    return vlm.read_clip([random_image(seed, (130, 100)) for seed in range(6)], 3.0)  # 2 s: 4 frames at 2 fps


@pytest.fixture(scope="module")
def item(vlm, clip):
    return vlm.prepare_video(clip, QUESTIONS[0])


def stock_logits(vlm, item) -> torch.Tensor:
    with torch.no_grad():
        return vlm.model(**stock_inputs(vlm, item)).logits[:, -1]


def processor_prompt(vlm, clip: Clip, question: str) -> str:
    """The prompt ``Qwen3VLProcessor`` (transformers' own ``replace_video_token`` and ``get_text_with_replacements``)
    makes of the chat template's video slot, with qwen-vl-utils' metadata (the video's frame rate and the sampled
    frames' indices). Its video processor needs torchvision, so the instance is built bare with the attributes
    those two methods read."""
    from types import SimpleNamespace

    from transformers import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    processor = object.__new__(Qwen3VLProcessor)
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    image = vlm.image_processor
    processor.video_processor = SimpleNamespace(
        merge_size=image.merge_size, temporal_patch_size=image.temporal_patch_size
    )
    steps, rows, cols = clip.geometry.video_grid
    metadata = VideoMetadata(
        total_num_frames=6, fps=clip.video_fps, frames_indices=list(clip.geometry.frames)
    )  # the 6 frames given
    grid = torch.tensor([[steps, rows * image.merge_size, cols * image.merge_size]])
    expanded = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    template = vlm.prompt(question).replace("<|image_pad|>", "<|video_pad|>")  # the chat template's video slot
    (text,), _ = processor.get_text_with_replacements([template], videos_replacements=[expanded])
    return text


def test_read_clip_follows_qwen_vl_utils_at_32_px_tokens(vlm, clip):
    assert clip.geometry.frames == (0, 2, 3, 5) and clip.video_fps == 3.0  # 6 frames at 3 fps: 2 s, 4 at 2 fps
    assert clip.geometry.frame.token_pixels == 32 and clip.geometry.video_grid == (2, 3, 4)
    assert step_seconds(clip) == pytest.approx([1 / 3, 4 / 3])  # the mean time of each step's two frames
    sampling, vlm.video_sampling = vlm.video_sampling, {}  # qwen-vl-utils' own limits for Qwen3-VL
    try:
        # 130 x 100 grows to 128 tokens of 32 x 32 px at least: 416 x 320 px; 1600 x 1200 shrinks to 768 at most
        small = vlm.read_clip([random_image(0, (130, 100))] * 4, 2.0).geometry.frame
        large = vlm.read_clip([random_image(0, (1600, 1200))] * 4, 2.0).geometry.frame
    finally:
        vlm.video_sampling = sampling
    assert (small.processed_width, small.processed_height, small.grid) == (416, 320, (10, 13))
    assert (large.processed_width, large.processed_height, large.grid) == (1024, 768, (24, 32))


def test_the_prompt_is_the_processors_and_time_is_text(vlm, clip, item):
    expected = vlm.tokenizer(processor_prompt(vlm, clip, QUESTIONS[0]), return_tensors="pt")["input_ids"][0]
    assert torch.equal(item.input_ids, expected)
    text = vlm.tokenizer.decode(item.input_ids)
    assert text.count("< 0.3 seconds >") == 1 and text.count("< 1.3 seconds >") == 1
    assert item.video_grid == (2, 3, 4) and item.grid == (6, 4) and item.num_visual == 24
    columns = item.extras["visual_columns"]
    start, end = item.image_span
    assert int(columns[0]) == start and int(columns[-1]) == end - 1 and columns.numel() == 24
    between = end - start - 24  # </vision_end>, the second timestamp (4 words), <|vision_start|>
    assert between == 6 and torch.equal(columns[12:] - columns[:12], torch.full((12,), 12 + between))


def test_each_step_has_its_own_m_rope_grid_after_its_timestamp(item):
    positions, columns = item.extras["positions"], item.extras["visual_columns"]
    rows, cols = torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij")
    for step in range(2):
        at = columns[12 * step : 12 * (step + 1)]
        first = int(positions[0, at[0] - 1]) + 1  # the id after the marker before the step
        assert positions[0, at].tolist() == [first] * 12  # t = 1: one time id, no clip time
        assert torch.equal(positions[1, at] - first, rows.flatten()) and torch.equal(
            positions[2, at] - first, cols.flatten()
        )
        assert int(positions[0, at[-1] + 1]) == first + 4  # the text after a step resumes after its widest axis


def test_patches_follow_the_video_processors_flattening(vlm, clip, item):
    assert torch.allclose(item.pixel_values, rederived_patches(clip.frames, vlm.image_processor), atol=1e-5)
    assert torch.equal(item.pixel_values, video_patches(clip.frames, vlm.image_processor))


def test_dense_prefill_equals_the_stock_forward_with_its_deepstack(vlm, item):
    prefill, _ = vlm.prefill([item])
    assert (prefill.logits - stock_logits(vlm, item)).abs().max() <= TOL
    after_layer, vlm.loop.stack.after_layer = vlm.loop.stack.after_layer, None
    try:  # the video deepstack sets matter: without them the logits move
        assert (vlm.prefill([item])[0].logits - prefill.logits).abs().max() > 1e-3
    finally:
        vlm.loop.stack.after_layer = after_layer


def test_every_selector_run_takes_on_clips_is_listed():
    from test_clip_run import clip_selectors

    from prune_audit.pruners import list_selectors, selector_class

    per_frame = [name for name in list_selectors() if selector_class(name).per_frame]
    assert sorted(clip_selectors() + per_frame) == sorted([name for name, _ in CLIP_SELECTORS] + ["fastvid", "holitom"])


@pytest.mark.parametrize(("name", "options"), CLIP_SELECTORS)
def test_each_clip_selector_keeping_all_equals_dense(vlm, item, name, options):
    full, _ = vlm.prefill([item], get_selector(name, **options), item.num_visual)
    assert (full.logits - stock_logits(vlm, item)).abs().max() <= TOL


@pytest.mark.parametrize(("name", "options"), [entry for entry in CLIP_SELECTORS if entry[0] not in LLM_STAGE])
def test_an_input_selection_is_the_stock_forward_without_the_dropped_tokens(vlm, item, name, options):
    prefill, selections = vlm.prefill([item], get_selector(name, **options), 10)
    kept = selections[0].kept.tolist()
    assert len(kept) == 10 and prefill.tokens_per_layer[0] == [10] * vlm.num_layers
    reference = masked_reference_logits(vlm, item, [0], [kept])  # the timestamps between the steps stay
    assert (prefill.logits[0] - reference).abs().max() <= TOL


def test_an_in_llm_stage_is_the_stock_forward_without_the_dropped_tokens_from_its_layer(vlm, item):
    prefill, _ = vlm.prefill([item], get_selector("dycoke_kv"), 10)
    (layer,), (kept,) = prefill.stage_layers[0], prefill.kept_stages[0]
    assert layer > 0 and len(kept) < item.num_visual
    reference = masked_reference_logits(vlm, item, [layer], [kept])
    assert (prefill.logits[0] - reference).abs().max() <= TOL


def test_a_batch_of_clips_equals_each_clip_alone(vlm, clip, item):
    other = vlm.prepare_video(clip, QUESTIONS[1])  # another prompt length
    assert_batch_equals_one_at_a_time(vlm, [item, other], get_selector("evs"), 10)


@pytest.fixture(scope="module")
def eager_vlm(vlm):
    from test_compute import eager

    return eager(load_vlm(vlm.model_id, device="cpu"))


@pytest.mark.parametrize("name", [None, "evs", "vidcom2", "divprune", "dycoke_kv", "fastv"])
def test_clip_flops_equal_the_counted_flops(eager_vlm, item, name):
    """The tower attends within each temporal step here too (T images of one step's patches) and the deepstack
    mergers count as projector matmuls: ``FlopCounterMode`` over the eager forward counts what the accounting says
    (the timestamps between the steps are text tokens)."""
    from test_compute import counted

    selector = None if name is None else get_selector(name)
    budget = None if name is None else item.num_visual // 2
    outside, inside, answer = counted(eager_vlm, item, selector, budget)
    assert outside == answer.cost.flops_vision + answer.cost.flops_llm, name
    if selector is not None and selector.flops_exact:
        assert inside == answer.cost.flops_selector, name


def test_the_step_attention_selectors_are_refused_on_qwen3_clips_in_one_line(vlm, item):
    for name, options, needle in [
        ("fastvid", {"merge": False}, "step_attention, which qwen3_vl does not provide"),
        ("fastvid", {}, "positions for merged tokens"),
        ("holitom", {"merge": False}, "step_attention, which qwen3_vl does not provide"),
    ]:
        with pytest.raises(PruneAuditError, match=needle) as refusal:
            vlm.prefill([item], get_selector(name, **options), 10)
        assert "\n" not in str(refusal.value) and "step-attention (FastVID, HoliTom) port" in str(refusal.value)


def test_clips_and_images_in_one_batch_are_refused(vlm, item):
    image = vlm.prepare(random_image(0, (128, 128)), QUESTIONS[0])
    for batch in ([item, image], [image, item]):
        with pytest.raises(PruneAuditError, match="separate batches"):
            vlm.prefill(batch)


def test_a_clip_without_its_frame_rate_or_of_other_tokens_is_refused(vlm, clip):
    from dataclasses import replace

    with pytest.raises(PruneAuditError, match="frame rate is unknown"):
        vlm.prepare_video(replace(clip, video_fps=None), QUESTIONS[0])
    qwen2_5 = sample_clip([random_image(seed, (130, 100)) for seed in range(4)], 2.0)  # 28-px tokens
    with pytest.raises(PruneAuditError, match="sample it with patch_size=16"):
        vlm.prepare_video(qwen2_5, QUESTIONS[0])


# ----- the CLI -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_clips(tmp_path_factory):
    """test_clip_run's clip files and a tiny Qwen3-VL declaring small frames (64 x 48 px: 4 x 3 tokens a step)."""
    root = tmp_path_factory.mktemp("qwen3_clips")
    model = Qwen3VLModel.build_tiny(root / "model", words=[*CLIP_WORDS, "Is"], seed=4)
    write_video_sampling(model, {"min_pixels": 128 * 96, "total_pixels": 200000})
    return {"model": model, **write_clip_files(root)}


def test_video_presence_runs_on_qwen3_vl_and_keep_all_is_dense(qwen3_clips, tmp_path):
    dense, kept_all, pruned = tmp_path / "dense", tmp_path / "all", tmp_path / "evs"
    assert run(qwen3_clips, dense).exit_code == 0
    result = run(qwen3_clips, kept_all, "--selector", "evs", "--budget", "all")
    assert result.exit_code == 0, result.output
    for a, b in zip(records(dense), records(kept_all)):
        assert a["kept_stages"] == b["kept_stages"] and a["answer"] == b["answer"]
        assert a["p_yes"] == pytest.approx(b["p_yes"], abs=1e-5)
    result = run(qwen3_clips, pruned, "--selector", "evs", "--budget", "50%")
    assert result.exit_code == 0, result.output
    rows = records(pruned)
    assert [row["question_id"] for row in rows] == [1, 2, 3]
    for row in rows:
        geometry = json.loads(row["geometry"])
        assert geometry["frame"]["token_pixels"] == 32 and geometry["frames_per_step"] == 2
        assert (geometry["frame"]["grid_rows"], geometry["frame"]["grid_cols"]) == (3, 4)
        steps = len(geometry["frames"]) // 2
        assert len(row["kept"]) == steps * 12 // 2 and row["sampled_frames"] == geometry["frames"]
        shares, lost_in_window = recounted(row)  # per-frame evidence recounted from the masks and the kept cells
        np.testing.assert_allclose(row["frame_retention"] if row["object"] == "cat" else shares, shares)
        assert row["lost_in_window"] == lost_in_window
    out = tmp_path / "fastvid"
    refused(run(qwen3_clips, out, "--selector", "fastvid", "--budget", "10"), out, "selector 'fastvid'")
