"""What only LLaVA-1.5 has: its CLIP CLS row and keys, compact positions equal to a shortened prompt, every
input-level selector at a small budget, named in-LLM selectors equal to the masked reference, CDPruner's CLIP text
tower, the vicuna template, the 4.x key layout, the per-crop budget refused (one crop). What every family shares is
in tests/models/test_families_registry.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import (
    INPUT_FIELDS,
    QUESTIONS,
    WORDS,
    RecordingInputSelector,
    RecordingLayerSelector,
    assert_batch_equals_one_at_a_time,
    masked_reference_logits,
    random_image,
)

from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.build import build_clip
from prune_audit.models.families import adapter_for
from prune_audit.models.llava import LlavaModel
from prune_audit.models.probe import clip_cls_row
from prune_audit.pruners import get_selector, list_selectors, selector_class

TOL = 1e-5
NUM_LAYERS = 4
GRID = 8  # 112 px / 14 px patches


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    llava = LlavaModel.build_tiny(root / "llava", words=WORDS, text_layers=NUM_LAYERS, seed=1)
    clip = build_clip(root / "clip", words=WORDS, vision_hidden_size=64)
    return llava, clip


@pytest.fixture(scope="module")
def vlm(paths):
    return load_vlm(paths[0], device="cpu", clip_text=paths[1])


@pytest.fixture(scope="module")
def prepared(vlm):
    return [vlm.prepare(random_image(seed), question) for seed, question in enumerate(QUESTIONS)]


def logits_of(vlm, items, selector=None, budget=None, **kwargs) -> torch.Tensor:
    prefill, _ = vlm.prefill(items, selector, budget, **kwargs)
    return prefill.logits


def test_prepare_records_grid_span_and_geometry(vlm, prepared):
    item = prepared[0]
    assert item.grid == (GRID, GRID)
    start, end = item.image_span
    assert end - start == GRID * GRID
    assert (item.input_ids[start:end] == vlm.model.config.image_token_id).all()
    assert item.geometry.mode == "hf_crop" and (item.geometry.grid_rows, item.geometry.grid_cols) == (GRID, GRID)


# every input selector LLaVA-1.5 runs (with the CLIP text tower); those needing the anyres crops run on LLaVA-NeXT
@pytest.mark.parametrize(
    "name",
    [n for n in list_selectors() if selector_class(n).stage == "input" and LlavaModel.support_words()[n] != "no"],
)
def test_input_selector_runs_at_small_budget(vlm, prepared, name):
    [answer] = vlm.answer([prepared[0]], get_selector(name), 16, generator=torch.Generator().manual_seed(0))
    assert answer.tokens_per_layer == [16] * NUM_LAYERS
    assert answer.prefill_tokens == prepared[0].input_ids.numel() - GRID * GRID + 16
    assert 0.5 <= answer.confidence <= 1 and answer.answer in ("yes", "no")


def test_input_level_selection_equals_stock_forward_on_a_shortened_prompt(vlm, prepared):
    """Contiguous positions: the stock forward on a prompt with only the kept image tokens."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    item = prepared[0]
    [answer] = vlm.answer([item], get_selector("cls_attn"), 16)
    start, end = item.image_span
    ids = torch.cat([item.input_ids[:start], item.input_ids[start : start + 16], item.input_ids[end:]])
    with torch.no_grad():
        image = vlm.model.model.get_image_features(pixel_values=item.pixel_values[None]).pooler_output[0]
        kept = image[torch.tensor(answer.kept)]
        encoded = {"image": BaseModelOutputWithPooling(pooler_output=[kept])}
        reference = vlm.model(input_ids=ids[None], mm_encoder_outputs=encoded).logits[0, -1]
    assert (logits_of(vlm, [item], get_selector("cls_attn"), 16)[0] - reference).abs().max() <= TOL


@pytest.fixture(scope="module")
def eager_model(paths):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(paths[0], attn_implementation="eager").eval()


def eager_outputs(eager, item):
    with torch.no_grad():
        language = eager(
            input_ids=item.input_ids[None],
            pixel_values=item.pixel_values[None],
            output_attentions=True,
            output_hidden_states=True,
        )
        vision = eager.model.vision_tower(item.pixel_values[None], output_attentions=True, output_hidden_states=True)
    return eager, language, vision


def test_decoder_probe_equals_eager_attention_rows(vlm, eager_model, prepared):
    item = prepared[1]
    _, language, _ = eager_outputs(eager_model, item)
    start, end = item.image_span
    for layer in (1, 2):
        selector = RecordingLayerSelector(layer=layer, keep=GRID * GRID - 1)
        vlm.answer([item], selector, 1)
        signals = selector.records[-1]
        eager = language.attentions[layer][0, :, end:, start:end]  # (H, T, N): text after the image
        assert signals.text_probs.shape == eager.shape
        assert (signals.text_probs - eager).abs().max() <= TOL
        hidden = language.hidden_states[layer][0]
        assert (signals.hidden_states - hidden[start:end]).abs().max() <= TOL
        assert (signals.previous_hidden_states - language.hidden_states[layer - 1][0, start:end]).abs().max() <= TOL
        assert torch.equal(signals.alive, torch.arange(GRID * GRID))


def test_clip_cls_row_equals_eager_attention(vlm, eager_model, prepared):
    item = prepared[0]
    eager, _, vision = eager_outputs(eager_model, item)
    feature_index = vlm.feature_index
    reference = vision.attentions[feature_index - 1][0, :, 0]  # (H, 1 + N) CLS row
    layer = eager.model.vision_tower.encoder.layers[feature_index - 1]
    probs, _, logits = clip_cls_row(layer, vision.hidden_states[feature_index - 1])
    assert (probs[0] - reference).abs().max() <= TOL
    assert (torch.softmax(logits[0], dim=-1) - reference).abs().max() <= TOL  # the official order of operations
    selector = RecordingInputSelector()
    vlm.answer([item], selector, 8)
    signals = selector.records[-1]
    assert (signals.cls_attention - reference[:, 1:]).abs().max() <= TOL
    assert (signals.cls_feature - vision.hidden_states[feature_index][0, 0]).abs().max() <= TOL
    assert (signals.vision_features - vision.hidden_states[feature_index][0, 1:]).abs().max() <= TOL
    assert signals.vision_keys.shape[1] == GRID * GRID + 1


def stock_last_layer(eager, item) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stock eager CLIP tower run whole on one image with PruMerge's official hooks on its last layer's
    ``q_proj`` / ``k_proj``: (1 + N, Dv) queries and keys as hooked, and its (H, 1 + N, 1 + N) attention."""
    tower = eager.model.vision_tower
    attention = tower.encoder.layers[-1].self_attn
    hooked: dict[str, torch.Tensor] = {}
    handles = [
        getattr(attention, name).register_forward_hook(lambda module, args, out, name=name: hooked.update({name: out}))
        for name in ("q_proj", "k_proj")
    ]
    try:
        with torch.no_grad():
            stock = tower(item.pixel_values[None], output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    return hooked["q_proj"][0], hooked["k_proj"][0], stock.attentions[-1][0]


def test_last_layer_cls_row_equals_the_stock_towers_last_layer(vlm, eager_model, prepared):
    """PruMerge's default signals: the adapter's last-layer CLS logits and keys, recomputed from the feature layer's
    output through the last layer's norm and projections, equal the stock tower's hooked projections (the whole
    tower run) and its eager attention; the full-width head is the official ``softmax(q k^T / sqrt(Dv))``."""
    from prune_audit.pruners.prumerge import full_width_attention, full_width_keys

    item = prepared[1]
    queries, keys, attention = stock_last_layer(eager_model, item)
    vision = eager_model.config.vision_config
    heads, width = vision.num_attention_heads, vision.hidden_size
    per_head_keys = keys.view(-1, heads, width // heads).transpose(0, 1)  # (H, 1 + N, d)
    logits = (queries[0].view(heads, 1, -1) @ per_head_keys.transpose(1, 2))[:, 0] * (width // heads) ** -0.5
    selector = RecordingInputSelector()
    selector.requires = INPUT_FIELDS | {"last_layer_cls_logits", "last_layer_vision_keys"}
    vlm.answer([item], selector, 8)
    signals = selector.records[-1]
    assert signals.last_layer_cls_logits.shape == (heads, GRID * GRID + 1)
    assert (signals.last_layer_cls_logits - logits).abs().max() <= TOL
    assert (signals.last_layer_vision_keys - per_head_keys).abs().max() <= TOL
    assert (torch.softmax(signals.last_layer_cls_logits, dim=-1) - attention[:, 0]).abs().max() <= TOL
    official = torch.softmax(keys @ queries[0] * width**-0.5, dim=0)[1:]
    assert (full_width_attention(signals.last_layer_cls_logits) - official).abs().max() <= TOL
    assert (full_width_keys(signals.last_layer_vision_keys) - keys[1:]).abs().max() <= TOL
    assert (signals.last_layer_cls_logits - signals.cls_logits).abs().max() > 0.01  # another layer's row


def test_the_last_layer_row_is_refused_where_the_feature_layer_is_not_its_input(vlm, tmp_path):
    """With features from layer -3 the last layer's input is never computed: PruMerge's default is refused in one
    line naming the signals, signal_layer=feature runs."""
    vlm.check_selector(get_selector("prumerge"))
    path = LlavaModel.build_tiny(tmp_path / "deep", words=WORDS, vision_layers=3, vision_feature_layer=-3)
    shallow = load_vlm(path, device="cpu")
    for name in ("prumerge", "prumerge_plus"):
        message = one_line_error(lambda name=name: shallow.check_selector(get_selector(name)))
        assert "needs last_layer_cls_logits, last_layer_vision_keys" in message and "signal_layer=feature" in message
        shallow.check_selector(get_selector(name, signal_layer="feature"))
    assert "prumerge" not in shallow.supported_selectors()


def test_demand_is_the_first_layer_text_to_visual_attention(vlm, eager_model, prepared):
    item = prepared[1]
    _, language, _ = eager_outputs(eager_model, item)
    start, end = item.image_span
    expected = language.attentions[0][0, :, end:, start:end].mean(dim=(0, 1))
    selector = RecordingInputSelector()
    vlm.answer([item], selector, 8)
    assert (selector.records[-1].demand - expected).abs().max() <= TOL


@pytest.mark.parametrize("name", ["fastv", "e2s", "v2drop", "dart", "recording"])
def test_in_llm_drop_equals_masked_reference(vlm, prepared, name):
    item = prepared[1]
    selector = RecordingLayerSelector(layer=2, keep=20) if name == "recording" else get_selector(name)
    if getattr(selector, "positions", "keep_original") != "keep_original":
        pytest.skip(f"{name} compacts positions")
    prefill, _ = vlm.prefill([item], selector, 40)
    assert prefill.kept_stages[0], "the selector must prune"
    reference = masked_reference_logits(vlm, item, prefill.stage_layers[0], prefill.kept_stages[0])
    assert (prefill.logits[0] - reference).abs().max() <= TOL


def test_compact_positions_renumber_like_a_shortened_prompt(vlm, prepared):
    """A compacting stage at layer 0 is the same as input-level selection of that set."""
    item, kept = prepared[0], list(range(0, GRID * GRID, 3))
    compacting = get_selector("pdrop")
    assert compacting.positions == "compact"
    in_llm = logits_of(vlm, [item], compacting, forced_stages=[[(0, kept)]])
    input_level = logits_of(vlm, [item], forced_kept=[kept])
    assert (in_llm - input_level).abs().max() <= TOL


@pytest.mark.parametrize("name", [None, "cls_attn", "visionzip", "sparsevlm", "e2s", "pdrop"])
def test_batch_equals_one_at_a_time(vlm, prepared, name):
    selector = None if name is None else get_selector(name)
    budget = None if name is None else 24
    assert_batch_equals_one_at_a_time(vlm, prepared, selector, budget)


def test_one_generator_per_question_makes_random_selection_batch_independent(vlm, prepared):
    def generators():
        return [torch.Generator().manual_seed(seed) for seed in (11, 12)]

    together = vlm.answer(prepared, get_selector("random"), 16, generator=generators())
    for b, item in enumerate(prepared):
        [alone] = vlm.answer([item], get_selector("random"), 16, generator=[generators()[b]])
        assert together[b].kept == alone.kept
    assert together[0].kept != together[1].kept
    assert "2 questions" in one_line_error(
        lambda: vlm.answer(prepared, get_selector("random"), 16, generator=generators()[:1])
    )


def test_check_selector_and_positions_for(vlm, paths):
    assert vlm.positions_for(get_selector("cls_attn")) == "compact"
    assert vlm.positions_for(get_selector("fastv")) == "keep_original"
    assert vlm.positions_for(get_selector("pdrop")) == "compact"
    vlm.check_selector(get_selector("cdpruner"))
    assert "clip_text" in one_line_error(
        lambda: load_vlm(paths[0], device="cpu").check_selector(get_selector("cdpruner"))
    )


def test_forced_stages_are_honoured(vlm, prepared):
    stages = [(1, list(range(0, 64, 2))), (3, [0, 4, 8])]
    [answer] = vlm.answer([prepared[0]], forced_stages=[stages])
    assert answer.kept_stages == [stages[0][1], stages[1][1]]
    assert answer.stage_layers == [1, 3]
    assert answer.tokens_per_layer == [64, 32, 32, 3]
    assert answer.visual_tokens_avg == pytest.approx((64 + 32 + 32 + 3) / 4)
    reference = masked_reference_logits(vlm, prepared[0], [1, 3], [stages[0][1], stages[1][1]])
    assert (logits_of(vlm, [prepared[0]], forced_stages=[stages])[0] - reference).abs().max() <= TOL


@pytest.mark.parametrize("name", ["fastv", "pdrop"])
def test_pruned_generation_with_cache_equals_recomputed_prefill(vlm, prepared, name):
    """Each decoded token equals a fresh prefill of prompt + generated text under the same kept sets."""
    item, selector = prepared[0], get_selector(name)
    text = vlm.generate(item, selector, 40, max_new_tokens=4)
    prefill, _ = vlm.prefill([item], selector, 40)
    stages = [list(zip(prefill.stage_layers[0], prefill.kept_stages[0]))]
    ids, expected = item.input_ids, []
    for _ in range(4):
        extended = replace(item, input_ids=ids)
        token = int(logits_of(vlm, [extended], selector, forced_stages=stages)[0].argmax())
        if token in vlm.eos_ids():
            break
        expected.append(token)
        ids = torch.cat([ids, torch.tensor([token])])
    assert text == vlm.tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_vicuna_template_by_name(paths):
    vicuna = load_vlm(paths[0], device="cpu", prompt_template="vicuna_v1", system_prompt="Be brief.")
    prompt = vicuna.prompt("is there a cat?")
    assert prompt == "Be brief. USER: <image>\nis there a cat? ASSISTANT:"  # the template adds no instruction
    assert vicuna.describe()["prompt"] == {"template": "vicuna_v1", "system": "Be brief."}


def test_config_hash_ignores_location_and_dtype(vlm, paths, tmp_path):
    import shutil

    moved = shutil.copytree(paths[0], tmp_path / "elsewhere")
    other = load_vlm(moved, device="cpu", dtype="bfloat16")
    assert other.describe()["model"]["config_hash"] == vlm.describe()["model"]["config_hash"]
    assert other.describe()["dtype"] == "bfloat16"


def one_line_error(call) -> str:
    with pytest.raises(PruneAuditError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


def test_errors_are_one_line(vlm, paths, prepared, tmp_path):
    item = prepared[0]
    without_clip = load_vlm(paths[0], device="cpu")
    assert "clip_text" in one_line_error(lambda: without_clip.answer([item], get_selector("cdpruner"), 8))
    assert "budget" in one_line_error(lambda: vlm.answer([item], get_selector("fastv")))
    assert "no schedule" in one_line_error(lambda: vlm.answer([item], get_selector("fastv"), 2))
    assert "nested" in one_line_error(lambda: vlm.answer([item], forced_stages=[[(1, [0, 1]), (2, [5])]]))
    assert "prompt template" in one_line_error(lambda: load_vlm(paths[0], device="cpu", prompt_template="chatml"))
    assert "model folder not found" in one_line_error(lambda: load_vlm(tmp_path / "missing" / "model"))


def test_checkpoint_in_the_4x_key_layout_loads_identically(vlm, paths, prepared, tmp_path):
    """transformers 4.x saved ``language_model.model.*`` and ``vision_tower.vision_model.*`` keys."""
    import shutil

    from safetensors.torch import load_file, save_file

    legacy = tmp_path / "legacy"
    shutil.copytree(paths[0], legacy)
    weights = load_file(legacy / "model.safetensors")
    renamed = {}
    for key, value in weights.items():
        key = key.replace("vision_tower.", "vision_tower.vision_model.", 1) if key.startswith("vision_tower.") else key
        if key.startswith("model.language_model."):
            key = "language_model.model." + key.removeprefix("model.language_model.")
        renamed[key] = value
    assert any(key.startswith("language_model.model.") for key in renamed)
    save_file(renamed, legacy / "model.safetensors", metadata={"format": "pt"})
    reloaded = load_vlm(legacy, device="cpu")
    item = prepared[0]
    assert (logits_of(reloaded, [item])[0] - logits_of(vlm, [item])[0]).abs().max() <= TOL


def test_per_crop_budget_is_refused_in_one_line_on_one_crop_families(tmp_path):
    from prune_audit.pruners.registry import selector_from_strings

    vlm = load_vlm(adapter_for("llava", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"]), device="cpu")
    with pytest.raises(PruneAuditError) as error:
        vlm.check_selector(selector_from_strings("divprune", ["budget_scope=crop"]))
    assert "one crop" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(PruneAuditError, match="one crop"):  # VScan, the in-LLM selector with the option
        vlm.check_selector(selector_from_strings("vscan", ["budget_scope=crop"]))
