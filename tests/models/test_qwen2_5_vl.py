"""What only Qwen2.5-VL has: its 3-D M-RoPE positions, kept when pruning (input level and named in-LLM selectors
equal to the masked reference), generation extending them, its pixel limits and refusals. What every family
shares is in tests/models/test_families_registry.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import (
    QUESTIONS,
    WORDS,
    RecordingLayerSelector,
    masked_reference_logits,
    random_image,
)

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
