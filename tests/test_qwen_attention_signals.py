"""The attention signals Qwen2.5-VL's adapter forms for HiPrune and VScan (their official Qwen code: Danielement321/HiPrune
``Qwen2_5_VL/qwen2_5_vl_HiPrune.py`` 6e83a124, Tencent/SelfEvolvingAgent ``VScan/qwen/model/`` a82450e1).

* the ``layer_attention`` signal equals a recomputation in raster patch order from each block's
  input (its own rotary table and window permutation re-derived here), on the tiny model and demo-qwen;
* ``attention_rope="skipped"`` forms the LLM stage's text attention from unrotated queries and keys.

The selectors' own Qwen tests are in ``tests/pruners/test_hiprune.py`` and ``tests/pruners/test_vscan.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from qwen_vision import models, raster_to_window_order  # noqa: F401 (models: fixture)
from tiny_models import QUESTIONS, random_image

TOL = 1e-5


def rotary_tables(rows: int, cols: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, head_dim) cos and sin of the vision 2-D rotary embedding for the processor's patch order:
    merged tokens in raster order, the 2 x 2 patches of each row by row."""
    cells = [(2 * r + i // 2, 2 * c + i % 2) for r in range(rows) for c in range(cols) for i in range(4)]
    height, width = torch.tensor(cells, dtype=torch.float32).T
    inverse = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2))
    angles = torch.cat([height[:, None] * inverse, width[:, None] * inverse], dim=1)
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def recomputed_layer_attention(vlm, item) -> torch.Tensor:
    """(Lv, N) received attention per block, mean over heads, query patches and each token's 4 patches,
    formed in raster order from the block inputs the tower computes (window order undone here)."""
    visual = vlm.model.model.visual
    config = vlm.model.config.vision_config
    rows, cols = item.grid
    inputs: list[torch.Tensor] = []
    hooks = [block.register_forward_pre_hook(lambda module, args: inputs.append(args[0])) for block in visual.blocks]
    with torch.no_grad():
        visual(item.pixel_values, grid_thw=item.extras["image_grid_thw"])
    for hook in hooks:
        hook.remove()
    window = raster_to_window_order(rows, cols, config.window_size // config.spatial_merge_size // config.patch_size)
    to_raster = torch.argsort(window)
    heads, head_dim = config.num_heads, config.hidden_size // config.num_heads
    cos, sin = rotary_tables(rows, cols, head_dim, config.rope_parameters["rope_theta"])
    layers = []
    for hidden, block in zip(inputs, visual.blocks):
        hidden = hidden.view(rows * cols, 4, -1)[to_raster].reshape(rows * cols * 4, -1)
        with torch.no_grad():
            qkv = block.attn.qkv(block.norm1(hidden)).view(-1, 3, heads, head_dim).float()
        query, key = rotate(qkv[:, 0], cos[:, None], sin[:, None]), rotate(qkv[:, 1], cos[:, None], sin[:, None])
        logits = torch.einsum("phd,qhd->hpq", query, key) / math.sqrt(head_dim)
        received = logits.softmax(dim=-1).mean(dim=(0, 1))
        layers.append(received.view(rows * cols, 4).mean(dim=1))
    return torch.stack(layers)


@pytest.mark.parametrize(
    "name, size", [("tiny", (130, 100)), ("tiny", (120, 120)), ("demo-qwen", (96, 96)), ("demo-qwen", (120, 72))]
)
def test_layer_attention_equals_a_raster_order_recomputation(models, name, size):
    vlm = models[name]
    item = vlm.prepare(random_image(7, size), QUESTIONS[0])
    [output] = vlm._vision([item], frozenset({"layer_attention"}))
    signal = output.signals["layer_attention"]
    expected = recomputed_layer_attention(vlm, item)
    assert signal.shape == (len(vlm.model.model.visual.blocks), item.grid[0] * item.grid[1])
    torch.testing.assert_close(signal, expected, rtol=TOL, atol=TOL)
    assert output.signals["vision_tower"] == "qwen2_5_vl"


def test_attention_rope_skipped_forms_the_llm_stage_attention_from_unrotated_q_and_k(models):
    """``attention_rope="skipped"`` (VScan's official Qwen ``layer_prune``): the text rows' attention at layer 1 is
    the causal softmax of q.k / sqrt(d) of the layer's normed input without M-RoPE; the default differs."""
    from dataclasses import dataclass

    from tiny_models import RecordingLayerSelector, stock_inputs

    @dataclass
    class Unrotated(RecordingLayerSelector):
        attention_rope: str = "skipped"

    vlm = models["tiny"]
    item = vlm.prepare(random_image(5, (120, 120)), QUESTIONS[0])
    recorded = {}
    for selector in (Unrotated(), RecordingLayerSelector()):
        vlm.answer([item], selector, 8)
        recorded[selector.attention_rope] = selector.records[-1].text_probs
    with torch.no_grad():
        hidden = vlm.model(**stock_inputs(vlm, item), output_hidden_states=True).hidden_states[1][0]
        layer, config = vlm.model.model.language_model.layers[1], vlm.model.config.text_config
        normed = layer.input_layernorm(hidden)
        head_dim = config.hidden_size // config.num_attention_heads
        query = layer.self_attn.q_proj(normed).view(-1, config.num_attention_heads, head_dim).transpose(0, 1)
        key = layer.self_attn.k_proj(normed).view(-1, config.num_key_value_heads, head_dim).transpose(0, 1)
        key = key.repeat_interleave(config.num_attention_heads // config.num_key_value_heads, dim=0)
    start, end = item.image_span
    logits = query[:, end:] @ key.transpose(1, 2) / math.sqrt(head_dim)
    causal = torch.arange(hidden.shape[0])[None, :] <= torch.arange(end, hidden.shape[0])[:, None]
    expected = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)[:, :, start:end]
    torch.testing.assert_close(recorded["skipped"], expected, rtol=TOL, atol=TOL)
    assert not torch.allclose(recorded["applied"], expected, rtol=TOL, atol=TOL)
