"""FastVID on a Qwen2.5-VL clip end to end (tiny fp32 model): the adapter's ``step_attention`` against the official
forward's ``frame_attn_weights`` re-derived on the last vision block's input (window order, view-and-mean, then the
reverse window index, as LunarShen/FastVID a40a109c), FastVID with ``merge=false`` keeps its selection of the
adapter's signals and the pruned prefill equals the stock forward with the other video tokens masked out, keep-all
is dense, and the merging default is refused in one line (Qwen2.5-VL keeps original positions)."""

from __future__ import annotations

import math

import pytest
import torch
from eight_frame_clips import (
    assert_keep_all_is_dense,
    assert_merging_and_still_images_refused,
    eight_frame_item,
    spied,
    tiny_video_vlm,
)
from tiny_models import masked_reference_logits

from prune_audit.pruners import get_selector

TOL = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_video_vlm(tmp_path_factory)


@pytest.fixture(scope="module")
def item(vlm):
    return eight_frame_item(vlm)


def official_frame_attention(vlm, item) -> torch.Tensor:
    """``frame_attn_weights`` as the official vision attention forms it on the last block's input (float32 model)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
    from transformers.vision_utils import get_vision_window_index

    visual = vlm.model.model.visual
    attn, seen = visual.blocks[-1].attn, {}
    handle = attn.register_forward_pre_hook(
        lambda _, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    grid_thw = item.extras["video_grid_thw"]
    with torch.no_grad():
        vlm.model.model.get_video_features(item.pixel_values, grid_thw)
    handle.remove()
    hidden = seen["args"][0] if seen["args"] else seen["kwargs"]["hidden_states"]
    cos, sin = seen["kwargs"]["position_embeddings"]
    q, k, _ = attn.qkv(hidden).reshape(hidden.shape[0], 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    t, h, w = grid_thw[0].tolist()
    d = q.shape[-1]
    q = q.reshape(attn.num_heads, t, h * w, d).mean(-2, keepdim=True)
    k = k.reshape(attn.num_heads, t, h * w // 4, 4, d).mean(-2)
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1).mean(2).mean(0)
    window_index, _ = get_vision_window_index(
        grid_thw, spatial_merge_size=2, window_size=visual.window_size, patch_size=visual.patch_size
    )
    return weights.reshape(-1)[torch.argsort(window_index)]


def test_step_attention_is_the_official_frame_attention(vlm, item):
    selector, calls = spied(get_selector("fastvid", merge=False))
    with torch.no_grad():
        vlm.prefill([item], selector, 12)
    (signals,) = calls
    assert signals.video_grid == (4, 4, 5)
    torch.testing.assert_close(signals.step_attention, official_frame_attention(vlm, item), atol=1e-6, rtol=1e-5)
    assert torch.allclose(signals.step_attention.view(4, 20).sum(dim=1), torch.ones(4))


def test_fastvid_without_merging_keeps_its_selection_and_keep_all_is_dense(vlm, item):
    selector, calls = spied(get_selector("fastvid", merge=False))
    prefill, selections = vlm.prefill([item], selector, 16, generator=torch.Generator().manual_seed(0))
    expected = get_selector("fastvid", merge=False).select(calls[0], 16, torch.Generator().manual_seed(0))
    assert torch.equal(selections[0].kept, expected.kept) and 1 <= selections[0].kept.numel() <= 16
    reference = masked_reference_logits(vlm, item, [0], [selections[0].kept.tolist()])
    assert (prefill.logits[0] - reference).abs().max() <= TOL
    assert_keep_all_is_dense(vlm, item, get_selector("fastvid", merge=False))


def test_merging_fastvid_and_still_images_are_refused_in_one_line(vlm, item):
    assert_merging_and_still_images_refused(vlm, item, "fastvid")
