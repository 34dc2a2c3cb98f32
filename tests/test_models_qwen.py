"""Qwen2.5-VL adapter: M-RoPE positions, GQA probe, pruning with original 3-D positions, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector, list_selectors
from tiny_models import (
    QUESTIONS,
    WORDS,
    RecordingLayerSelector,
    masked_reference_logits,
    random_image,
    stock_inputs,
)

TOL = 1e-5
NUM_LAYERS = 4
SIZES = [(130, 100), (120, 120)]  # -> 6x7 and 6x6 token grids at 168x168 pixels


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return QwenModel.build_tiny(tmp_path_factory.mktemp("qwen") / "qwen", words=WORDS, image_size=168,
                            text_layers=NUM_LAYERS, seed=2)


@pytest.fixture(scope="module")
def vlm(path):
    return load_vlm(path, device="cpu")


@pytest.fixture(scope="module")
def prepared(vlm):
    return [vlm.prepare(random_image(seed, size), q) for seed, (size, q) in enumerate(zip(SIZES, QUESTIONS))]


def stock_logits(vlm, item) -> torch.Tensor:
    with torch.no_grad():
        return vlm.model(**stock_inputs(vlm, item)).logits[0, -1].float()


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


def test_unpruned_equals_stock_forward(vlm, prepared):
    for item in prepared:
        assert (logits_of(vlm, [item])[0] - stock_logits(vlm, item)).abs().max() <= TOL


@pytest.mark.parametrize("name", list_selectors())
def test_every_selector_at_full_budget_equals_unpruned_or_refuses(vlm, prepared, name):
    item = prepared[0]
    if name not in vlm.supported_selectors():
        with pytest.raises(PruneAuditError) as error:
            vlm.answer([item], get_selector(name), item.num_visual)
        assert "selectors that work here: " + ", ".join(vlm.supported_selectors()) in str(error.value)
        return
    prefill, _ = vlm.prefill([item], get_selector(name), item.num_visual)
    assert prefill.tokens_per_layer[0] == [item.num_visual] * NUM_LAYERS
    assert (prefill.logits[0] - stock_logits(vlm, item)).abs().max() <= TOL


def test_decoder_probe_equals_eager_attention_with_gqa_and_mrope(vlm, path, prepared):
    from transformers import Qwen2_5_VLForConditionalGeneration

    assert vlm.model.config.text_config.num_key_value_heads < vlm.model.config.text_config.num_attention_heads
    item = prepared[0]
    eager = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        outputs = eager(**stock_inputs(vlm, item), output_attentions=True, output_hidden_states=True)
    start, end = item.image_span
    for layer in (1, 3):
        selector = RecordingLayerSelector(layer=layer, keep=item.num_visual - 1)
        vlm.answer([item], selector, 1)
        signals = selector.records[-1]
        expected = outputs.attentions[layer][0, :, end:, start:end]
        assert signals.text_probs.shape == expected.shape
        assert (signals.text_probs - expected).abs().max() <= TOL


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


@pytest.mark.parametrize("name", [None, "divprune", "fastv", "e2s"])
def test_batch_with_different_grids_equals_one_at_a_time(vlm, prepared, name):
    selector = None if name is None else get_selector(name)
    budget = None if name is None else 16
    together, selections = vlm.prefill(prepared, selector, budget)
    for b, item in enumerate(prepared):
        alone, selection = vlm.prefill([item], selector, budget)
        assert together.kept_stages[b] == alone.kept_stages[0]
        assert together.tokens_per_layer[b] == alone.tokens_per_layer[0]
        if selection[0] is not None:
            assert torch.equal(selections[b].kept, selection[0].kept)
        assert (together.logits[b] - alone.logits[0]).abs().max() <= 1e-4


def test_unpruned_generation_equals_stock_generate(vlm, prepared):
    item = prepared[0]
    with torch.no_grad():
        stock = vlm.model.generate(**stock_inputs(vlm, item), max_new_tokens=5, do_sample=False)
    expected = vlm.tokenizer.decode(stock[0, item.input_ids.numel() :], skip_special_tokens=True).strip()
    assert vlm.generate(item, max_new_tokens=5) == expected


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
