"""What only LLaVA-NeXT has: its real-size anyres processor, each crop's own CLS attention, the per-crop budget
(``budget_scope=crop``) and the official per-crop codes of VisionZip, CDPruner, HiPrune and VScan re-derived on
the stock modules, E2S on the base view's and the tile grid. What every family shares is in
tests/models/test_families_registry.py; what it shares with LLaVA-OneVision in tests/models/test_multi_grid_families.py."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tiny_models import QUESTIONS, WORDS, random_image, run_args
from torch import Tensor
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.geometry import token_index_map
from prune_audit.data.scenes import CATEGORIES
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.families import adapter_for
from prune_audit.pruners import get_selector

TOL = 1e-5
NUM_LAYERS = 4
SIZES = [(130, 100), (100, 130)]  # landscape and portrait: non-square grids

runner = CliRunner()


# llava-hf/llava-v1.6-vicuna-7b's image processor: 336-px crops and its canvases (height, width)
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (500, 333), (672, 672), (1000, 300)])
def test_llava_next_real_size_processor_puts_every_pixel_on_its_predicted_token(size):
    """At llava-v1.6's 336-px crops: the token count equals the processor's (visual tokens plus one newline per
    tile-grid row; 2,880 + 48 at 672 px), and a token-id image of each grid through the bicubic processor shows,
    away from token borders, the predicted token on the base crop and on the joined, unpadded tiles; the
    unpadded grid's padding pixels lie where the geometry puts no image."""
    from types import SimpleNamespace

    import transformers
    from test_geometry import IMAGE_BLUE, _expected_tokens

    from prune_audit.data.multigrid import anyres_geometry, anyres_layout

    def token_id_image(grid):  # up to 4,096 tokens: green steps of 16 (test_geometry's steps of 40 stop at 1,280)
        index = token_index_map(grid)
        return np.stack([index % 256, index // 256 * 16 + 8, np.full_like(index, IMAGE_BLUE)], axis=-1).astype(np.uint8)

    processor = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS
    )
    geometry = anyres_geometry(size, pinpoints=LLAVA_NEXT_PINPOINTS)
    base, tiles = geometry.grids
    stock = SimpleNamespace(image_processor=processor, patch_size=14, num_additional_image_tokens=0)
    stock._get_unpadded_features = lambda *args: transformers.LlavaNextProcessor._get_unpadded_features(stock, *args)
    count = transformers.LlavaNextProcessor._get_number_of_features(stock, size[1], size[0], 336, 336)
    assert count == geometry.num_tokens + tiles.grid_rows
    if size == (672, 672):
        assert geometry.num_tokens == 2880
    layout = anyres_layout(size, LLAVA_NEXT_PINPOINTS, 336, 14)
    tile_rows, tile_cols = layout.canvas[0] // 336, layout.canvas[1] // 336
    for grid in (base, tiles):
        crops = processor(images=token_id_image(grid), return_tensors="np", do_rescale=False, do_normalize=False)[
            "pixel_values"
        ][0]
        if grid is base:
            pixels = crops[0]
        else:  # the tiles joined row-major into the canvas, then the unpadded window
            canvas = crops[1:].reshape(tile_rows, tile_cols, 3, 336, 336).transpose(2, 0, 3, 1, 4)
            top, left = layout.cut[0] * 14, layout.cut[1] * 14
            pixels = canvas.reshape(3, tile_rows * 336, tile_cols * 336)[
                :, top : top + grid.processed_height, left : left + grid.processed_width
            ]
        pixels = np.rint(pixels).astype(int)
        assert pixels.shape[1:] == (grid.processed_height, grid.processed_width)
        ys, xs = np.arange(grid.processed_height), np.arange(grid.processed_width)
        inner = ((ys % 14 >= 3) & (ys % 14 < 11))[:, None] & ((xs % 14 >= 3) & (xs % 14 < 11))[None, :]
        # processed pixels at least 3 px inside / outside the image the geometry places
        inside_y = (ys + 0.5 >= grid.offset_y + 3) & (ys + 0.5 <= grid.offset_y + grid.image_height * grid.scale_y - 3)
        inside_x = (xs + 0.5 >= grid.offset_x + 3) & (xs + 0.5 <= grid.offset_x + grid.image_width * grid.scale_x - 3)
        outside_y = (ys + 0.5 < grid.offset_y - 3) | (ys + 0.5 > grid.offset_y + grid.image_height * grid.scale_y + 3)
        outside_x = (xs + 0.5 < grid.offset_x - 3) | (xs + 0.5 > grid.offset_x + grid.image_width * grid.scale_x + 3)
        image = inner & inside_y[:, None] & inside_x[None, :]
        decoded = pixels[0] + 256 * ((pixels[1] - 8) // 16)
        assert image.any() and (pixels[2][image] == IMAGE_BLUE).all()
        assert (decoded[image] == _expected_tokens(grid)[image]).all()
        assert (pixels[2][outside_y[:, None] | outside_x[None, :]] == 0).all()


def test_llava_next_cls_attention_is_each_crops_own_cls_row(tmp_path):
    """Per-crop CLS attention (VisionZip's and FasterVLM's LLaVA-NeXT reading): each visual token gets the attention
    its own crop's CLS pays it at the feature layer, as the stock eager CLIP tower returns it for that crop alone."""
    from prune_audit.data.multigrid import anyres_crop_patches

    checkpoint = adapter_for("llava_next", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"], seed=3)
    vlm = load_vlm(checkpoint, device="cpu")
    image = random_image(0, (130, 100))
    item = vlm.prepare(image, QUESTIONS[0])
    [output] = vlm._vision([item], frozenset({"cls_attention", "vision_features"}))
    tower = vlm.model.model.vision_tower
    tower.set_attn_implementation("eager")
    config = vlm.model.config
    crops = item.pixel_values
    with torch.no_grad():
        stock = tower(crops, output_attentions=True, output_hidden_states=True)
    layer = len(stock.hidden_states) + config.vision_feature_layer - 1  # the attention producing the feature layer
    expected = stock.attentions[layer][:, :, 0, 1:]  # (K, H, P): each crop's CLS row over its own patches
    order = torch.from_numpy(
        anyres_crop_patches(
            image.size,
            pinpoints=config.image_grid_pinpoints,
            tile=config.vision_config.image_size,
            patch_size=config.vision_config.patch_size,
        )
    )
    torch.testing.assert_close(output.signals["cls_attention"], expected.transpose(0, 1).flatten(1)[:, order])
    for crop in range(crops.shape[0]):  # a softmax per crop: each crop's patches share its CLS row's mass
        assert 0 < float(expected[crop].sum(dim=-1).max()) <= 1 + 1e-6
    features = stock.hidden_states[config.vision_feature_layer][:, 1:].flatten(0, 1)[order]
    torch.testing.assert_close(output.signals["vision_features"], features)


def test_per_crop_budget_equals_an_independent_per_crop_top_k(tmp_path):
    """``budget_scope=crop`` (VisionZip's, CDPruner's and FasterVLM's LLaVA-NeXT convention): the budget split evenly
    over the crops, then each crop's own top-k. Re-derived here from the layout: the crop of each unpadded tile
    token from its row and column in the joined grid, FasterVLM's head-mean CLS score, a top-k per crop."""
    from prune_audit.data.multigrid import anyres_layout
    from prune_audit.pruners.crop_scope import crop_budgets
    from prune_audit.pruners.registry import selector_from_strings

    checkpoint = adapter_for("llava_next", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"], seed=3)
    vlm = load_vlm(checkpoint, device="cpu")
    image = random_image(1, (130, 100))
    item = vlm.prepare(image, QUESTIONS[0])
    config = vlm.model.config
    tile, side = config.vision_config.image_size, config.vision_config.image_size // config.vision_config.patch_size
    layout = anyres_layout(image.size, config.image_grid_pinpoints, tile, config.vision_config.patch_size)
    rows, cols = np.indices(layout.grid)
    tile_crop = 1 + (rows + layout.cut[0]) // side * (layout.canvas[1] // tile) + (cols + layout.cut[1]) // side
    crop_of = np.concatenate([np.zeros(side * side, dtype=np.int64), tile_crop.ravel()])
    [output] = vlm._vision([item], frozenset({"cls_attention"}))
    scores = output.signals["cls_attention"].mean(dim=0)
    crops = [np.flatnonzero(crop_of == crop) for crop in np.unique(crop_of)]
    assert len(crops) > 2  # the base view and several tiles
    budget = 13
    shares = [
        min(len(tokens), budget // len(crops) + (index < budget % len(crops))) for index, tokens in enumerate(crops)
    ]
    assert crop_budgets(budget, [len(tokens) for tokens in crops]) == shares
    expected = sorted(
        int(tokens[index])
        for tokens, share in zip(crops, shares)
        for index in torch.topk(scores[torch.from_numpy(tokens)], share).indices
    )
    selector = selector_from_strings("cls_attn", ["budget_scope=crop"])
    answer = vlm.answer([item], selector, budget)[0]
    assert answer.kept_stages == [expected]
    assert answer.kept_stages != vlm.answer([item], get_selector("cls_attn"), budget)[0].kept_stages


def official_visionzip_next(vlm, item, selector, budget):
    """VisionZip's LLaVA-NeXT forward re-derived from dvlab-research/VisionZip 3151f6d (``clip_encoder.py`` on each
    crop, ``llava_arch.py::restore_image_features_sorted``) on the stock eager CLIP tower, among each crop's
    unpadded patches (docs/fidelity.md): per crop its share of ``budget``, the CLS plus the patches with the
    largest head-summed CLS attention, the rest merged into contextual tokens by the head-mean keys' cosine
    (targets every ``step`` in raster order, ``target + mean(members)``); laid out as the base view's
    ``[CLS, dominant, contextual]``, the tiles' dominant patches in joined-grid order, the tiles' CLS tokens, the
    tiles' contextual tokens. Returns the (M, Dv) tokens, the dominant patches and each contextual token's
    sources, both as image indices."""
    from prune_audit.pruners.crop_scope import crop_budgets

    tower = vlm.model.model.vision_tower
    tower.set_attn_implementation("eager")
    layer = len(tower.encoder.layers) + vlm.model.config.vision_feature_layer  # its output is the feature layer
    captured = []
    handle = tower.encoder.layers[layer].self_attn.k_proj.register_forward_hook(
        lambda module, args, output: captured.append(output)
    )
    with torch.no_grad():
        stock = tower(item.pixel_values, output_attentions=True, output_hidden_states=True)
    handle.remove()
    heads = vlm.model.config.vision_config.num_attention_heads
    metric = captured[0].unflatten(-1, (heads, -1)).mean(dim=2)  # (K, 1 + P, d) head-mean keys
    hidden = stock.hidden_states[layer + 1]  # (K, 1 + P, Dv) the feature layer, CLS first
    cls_row = stock.attentions[layer][:, :, 0]  # (K, H, 1 + P)
    patches = item.extras["crop_patches"]
    per_crop = hidden.shape[1] - 1
    crop_of = patches // per_crop
    groups = [torch.nonzero(crop_of == crop).flatten() for crop in torch.unique(crop_of)]
    base, plain, cls_tokens, contextual, dominant_all, sources = [], [], [], [], [], []
    for tokens, share in zip(groups, crop_budgets(budget, [group.numel() for group in groups])):
        crop, local = int(crop_of[tokens[0]]), 1 + patches[tokens] % per_crop  # tower positions of its tokens
        if share >= tokens.numel():  # every token kept as itself
            chosen = [(int(token), hidden[crop, position]) for token, position in zip(tokens, local)]
            (base if crop == 0 else plain).extend(chosen)
            dominant_all += tokens.tolist()
            continue
        dominant_count, contextual_count = selector.split(share)
        top = torch.topk(cls_row[crop][:, local].sum(dim=0), dominant_count - 1).indices.sort().values
        rest = torch.tensor([i for i in range(tokens.numel()) if i not in set(top.tolist())])
        step = max(1, rest.numel() // contextual_count)
        is_target = torch.zeros(rest.numel(), dtype=torch.bool)
        is_target[torch.arange(0, rest.numel(), step)[:contextual_count]] = True
        unit = metric[crop, local[rest]] / metric[crop, local[rest]].norm(dim=-1, keepdim=True)
        assign = (unit[~is_target] @ unit[is_target].T).argmax(dim=1)
        merged, merged_sources = [], []
        for slot, target in enumerate(rest[is_target]):
            members = rest[~is_target][assign == slot]
            mean = hidden[crop, local[members]].mean(dim=0) if members.numel() else torch.zeros(hidden.shape[-1])
            merged.append(hidden[crop, local[target]] + mean)
            merged_sources.append(sorted(tokens[torch.cat([target.reshape(1), members])].tolist()))
        dominant = [(int(tokens[i]), hidden[crop, local[i]]) for i in top]
        dominant_all += [token for token, _ in dominant]
        sources += merged_sources
        if crop == 0:
            base += [(None, hidden[0, 0]), *dominant, *((None, token) for token in merged)]
        else:
            plain += dominant
            cls_tokens.append(hidden[crop, 0])
            contextual += merged
    plain.sort(key=lambda entry: entry[0])
    joined = [token for _, token in base] + [token for _, token in plain] + cls_tokens + contextual
    return torch.stack(joined), sorted(dominant_all), sources


@pytest.mark.parametrize("budget", [40, 62])  # every crop merges; the tiles keep all their 12 tokens (share 12 or 13)
def test_visionzip_runs_per_crop_on_llava_next_as_its_official_code(tmp_path, budget):
    """VisionZip's official LLaVA-NeXT code selects dominant and contextual tokens in each crop with that crop's own
    CLS attention, CLS state and keys: with ``budget_scope=crop`` the language model's input equals the official
    per-crop layout (no newlines) re-derived on the stock eager tower and fed to the stock language model, and the
    records carry the dominant patches and each contextual token's sources; the image scope is refused in one line
    naming the per-crop option."""
    from prune_audit.pruners.registry import selector_from_strings

    checkpoint = adapter_for("llava_next", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"], seed=3)
    vlm = load_vlm(checkpoint, device="cpu")
    item = vlm.prepare(random_image(2, (130, 100)), QUESTIONS[0])
    with pytest.raises(PruneAuditError) as error:
        vlm.check_selector(get_selector("visionzip"))
    assert "--option budget_scope=crop" in str(error.value) and "\n" not in str(error.value)
    selector = selector_from_strings("visionzip", ["budget_scope=crop", "contextual_fraction=0.3"])
    tokens, dominant, sources = official_visionzip_next(vlm, item, selector, budget)
    [answer] = vlm.answer([item], selector, budget)
    assert answer.kept_stages == [dominant] and answer.merged_stages == [sources]
    assert answer.tokens_per_layer[0] == tokens.shape[0] == min(budget, 13 + 4 * 12)  # a tile holds 12 tokens
    prefill, _ = vlm.prefill([item], selector, budget)
    start, end = item.image_span
    model = vlm.model.model
    ids = item.input_ids
    with torch.no_grad():
        embeds = torch.cat(
            [
                model.get_input_embeddings()(ids[:start]),
                model.multi_modal_projector(tokens),
                model.get_input_embeddings()(ids[end:]),
            ]
        )
        states = model.language_model(inputs_embeds=embeds[None]).last_hidden_state
        expected = vlm.model.lm_head(states[:, -1]).float()
    assert (prefill.logits - expected).abs().max() <= TOL


def official_dpp_map(kernel: torch.Tensor, count: int) -> list[int]:
    """CDPruner's fast greedy MAP (Theia-4869/CDPruner 9541616 ``llava_arch.py::encode_images``) on one (N, N)
    kernel: ``count`` plain argmax picks with incremental Cholesky rows, returned ascending."""
    rows, gains, picks = torch.zeros(count, kernel.shape[0]), kernel.diagonal().clone(), []
    for step in range(count):
        pick = int(torch.argmax(gains))
        picks.append(pick)
        rows[step] = (kernel[pick] - rows[:step, pick] @ rows[:step]) / torch.sqrt(gains[pick])
        gains -= rows[step] ** 2
        gains[pick] = -float("inf")
    return sorted(picks)


def test_cdpruner_runs_on_llava_next_with_a_clip_text_tower(tmp_path):
    """CDPruner's official LLaVA-NeXT code: the CLIP relevance of every crop's patches min-max normalised over all
    crops at once, then a DPP per crop on that crop's projector outputs at its share of the budget. Re-derived on
    the stock tower, projector and CLIP model (among the unpadded tokens, docs/fidelity.md); ``budget_scope=image``
    runs one DPP over all tokens; LLaVA-OneVision (SigLIP) refuses a CLIP text tower in one line."""
    from prune_audit.models.build import build_clip
    from prune_audit.pruners.crop_scope import crop_budgets
    from prune_audit.pruners.registry import selector_from_strings

    checkpoint = adapter_for("llava_next", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"], seed=3)
    clip_path = build_clip(tmp_path / "clip", words=[*WORDS, "Is"], vision_hidden_size=64)
    with pytest.raises(PruneAuditError, match="clip_text"):
        load_vlm(checkpoint, device="cpu").check_selector(get_selector("cdpruner"))
    vlm = load_vlm(checkpoint, device="cpu", clip_text=clip_path)
    assert vlm.describe()["clip_text"] == str(clip_path)  # the manifest names the CLIP text tower
    item = vlm.prepare(random_image(3, (130, 100)), QUESTIONS[0])
    model, (clip, tokenizer) = vlm.model.model, vlm.clip
    with torch.no_grad():
        stock = model.vision_tower(item.pixel_values, output_hidden_states=True)
        patches = stock.hidden_states[vlm.model.config.vision_feature_layer][:, 1:]  # (K, P, Dv)
        image_embeds = clip.visual_projection(model.vision_tower.post_layernorm(patches))
        ids = tokenizer(item.question)["input_ids"]
        context = clip.config.text_config.max_position_embeddings
        chunks = [ids[i : i + context] for i in range(0, len(ids), context)]
        text_embeds = clip.get_text_features(torch.tensor([chunk + [0] * (context - len(chunk)) for chunk in chunks]))
        text_embeds = getattr(text_embeds, "pooler_output", text_embeds)
        features = model.multi_modal_projector(patches)  # (K, P, D)
    unit = features / features.norm(dim=-1, keepdim=True)
    relevance = -(
        image_embeds
        / image_embeds.norm(dim=-1, keepdim=True)
        @ (text_embeds / text_embeds.norm(dim=-1, keepdim=True)).T
    ).mean(dim=-1)  # (K, P)
    order = item.extras["crop_patches"]  # (N,) crop-major patch of each visual token
    per_crop = patches.shape[1]
    crop_of, position = order // per_crop, order % per_crop
    image = relevance[crop_of, position]
    relevance = (relevance - image.min() + 1e-6) / (image.max() - image.min())  # over all crops' tokens at once
    groups = [torch.nonzero(crop_of == crop).flatten() for crop in torch.unique(crop_of)]
    budget, expected = 23, []
    for tokens, share in zip(groups, crop_budgets(23, [group.numel() for group in groups])):
        crop, local = int(crop_of[tokens[0]]), position[tokens]
        weight = relevance[crop, local]
        kernel = weight[:, None] * (unit[crop, local] @ unit[crop, local].T) * weight[None]
        expected += tokens[official_dpp_map(kernel, share)].tolist()
    selector = selector_from_strings("cdpruner", ["budget_scope=crop"])
    assert vlm.answer([item], selector, budget)[0].kept_stages == [sorted(expected)]
    whole = vlm.answer([item], get_selector("cdpruner"), budget)[0]
    assert len(whole.kept) == budget and whole.kept_stages != [sorted(expected)]
    onevision = adapter_for("llava_onevision", "test").build_tiny(tmp_path / "onevision", words=[*WORDS, "Is"])
    with pytest.raises(PruneAuditError) as error:
        load_vlm(onevision, device="cpu", clip_text=clip_path)
    assert "clip_text" in str(error.value) and "\n" not in str(error.value)


def test_hiprune_runs_per_crop_on_llava_next_as_its_official_code(tmp_path):
    """HiPrune's official LLaVA-NeXT code selects in each crop's own grid: with ``budget_scope=crop`` it runs, and
    its kept set is the union of HiPrune on each crop alone: that crop's unpadded tokens as their own grid, the
    attention they receive in the stock eager CLIP tower run on that crop, the crop's share of the budget."""
    from prune_audit.pruners.crop_scope import crop_budgets
    from prune_audit.pruners.registry import selector_from_strings
    from prune_audit.pruners.signals import InputSignals

    checkpoint = adapter_for("llava_next", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"], seed=3)
    vlm = load_vlm(checkpoint, device="cpu")
    item = vlm.prepare(random_image(2, (100, 130)), QUESTIONS[0])
    with pytest.raises(PruneAuditError, match="one regular token grid"):
        vlm.check_selector(get_selector("hiprune"))
    selector = selector_from_strings("hiprune", ["budget_scope=crop"])
    tower = vlm.model.model.vision_tower
    tower.set_attn_implementation("eager")
    with torch.no_grad():
        stock = tower(item.pixel_values, output_attentions=True)
    layers = len(stock.attentions) + vlm.model.config.vision_feature_layer + 1  # those up to the feature layer
    received = torch.stack([probs.mean(dim=(1, 2))[:, 1:] for probs in stock.attentions[:layers]], dim=1)
    patches = item.extras["crop_patches"]  # (N,) crop-major patch of each visual token, checked against the processor
    per_crop = received.shape[-1]  # P patches per crop
    crops = patches // per_crop
    base, tiles = item.geometry.grids
    budget = 25
    groups = [torch.nonzero(crops == crop).flatten() for crop in torch.unique(crops)]
    expected = []
    for tokens, share in zip(groups, crop_budgets(budget, [group.numel() for group in groups])):
        rows = (
            base.grid[0]
            if tokens[0] < base.num_tokens
            else torch.unique((tokens - base.num_tokens) // tiles.grid[1]).numel()
        )
        signals = InputSignals(
            grid=(rows, tokens.numel() // rows),
            layer_attention=received[crops[tokens[0]], :, patches[tokens] % per_crop],
        )
        expected += tokens[selector.select(signals, share).kept].tolist()
    assert vlm.answer([item], selector, budget)[0].kept_stages == [sorted(expected)]


def official_vscan_per_crop(vlm, item, shares: list[int], window: int) -> tuple[Tensor, Tensor]:
    """VScan's LLaVA-NeXT vision stage re-derived from the official order of operations (Tencent/SelfEvolvingAgent
    a82450e ``encode_images``, ``window_cls_selection``, ``token_merging``, then the unpadding of the index mask):
    per crop the head-mean CLS attention of the stock eager tower, ``int(T / 2) // W`` per full window of the
    shallow layer, ``T - int(T / 2)`` more from the deep layer with the local ones zeroed, every other patch
    averaged into its most cosine-similar kept one on the projector outputs; then the base view's mask and the
    tiles' mask laid out and unpadded by transformers' own ``unpad_image``. Returns the (k,) kept visual tokens
    and the (N, D) features after merging."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    config = vlm.model.config
    tower = vlm.model.model.vision_tower
    tower.set_attn_implementation("eager")
    with torch.no_grad():
        stock = tower(item.pixel_values, output_attentions=True, output_hidden_states=True)
        features = vlm.model.model.multi_modal_projector(stock.hidden_states[config.vision_feature_layer][:, 1:])
    layers = len(stock.attentions) + config.vision_feature_layer + 1  # those up to the feature layer
    cls = torch.stack([probs[:, :, 0, 1:].mean(dim=1) for probs in stock.attentions[:layers]])  # (Lv, K, P)
    shallow, deep = cls[max(1, round(6 * layers / 23)) - 1], cls[layers - 1].clone()
    crops, patches = shallow.shape
    side = math.isqrt(patches)
    masks = torch.zeros(crops, patches, dtype=torch.bool)
    merged = features.clone()
    for crop, share in enumerate(shares):
        windows = (side // window) ** 2
        local = []
        for top in range(0, side - window + 1, window):
            for left in range(0, side - window + 1, window):
                block = shallow[crop].reshape(side, side)[top : top + window, left : left + window].reshape(-1)
                for index in torch.topk(block, int(share / 2) // windows).indices.tolist():
                    local.append((top + index // window) * side + left + index % window)
        deep[crop, local] = 0
        chosen = local + torch.topk(deep[crop], share - int(share / 2)).indices.tolist()
        masks[crop, chosen] = True
        kept, rest = features[crop][masks[crop]], features[crop][~masks[crop]]
        nearest = torch.nn.functional.cosine_similarity(rest[:, None], kept[None], dim=2).argmax(dim=1)
        sums, counts = kept.clone(), torch.ones(kept.shape[0])
        sums.index_add_(0, nearest, rest)
        counts.index_add_(0, nearest, torch.ones(rest.shape[0]))
        merged[crop, masks[crop]] = sums / counts[:, None]
    size = item.extras["image_sizes"][0].tolist()
    tiles_down, tiles_across = get_anyres_image_grid_shape(size, config.image_grid_pinpoints, tower.config.image_size)

    def laid_out(values: Tensor) -> Tensor:  # tiles (K - 1, P, ...) -> (..., rows, cols) unpadded, as the official
        tiles = values[1:].reshape(tiles_down, tiles_across, side, side, -1).permute(4, 0, 2, 1, 3)
        return unpad_image(tiles.flatten(1, 2).flatten(2, 3), size).flatten(1).T  # (unpadded tokens, ...)

    mask = torch.cat([masks[0], laid_out(masks[:, :, None].float())[:, 0] > 0])
    return torch.nonzero(mask).flatten(), torch.cat([merged[0], laid_out(merged)])


def test_vscan_runs_per_crop_on_llava_next_as_its_official_code(tmp_path, workspace):
    """VScan's official LLaVA-NeXT code scans and merges in each crop's padded grid, then unpads: with
    ``budget_scope=crop`` the kept set equals the independent re-derivation exactly and the merged layer-0 inputs
    match within 1e-5 (a 4-layer tower, so the shallow and deep scans read different layers); kept padding patches
    are gone; the compute accounting equals the counted FLOPs (padding projected, merges per crop); ``run`` records
    it; on the whole image it is refused in one line naming the option."""
    from prune_audit.models.llava_next import build_llava_next
    from prune_audit.pruners.crop_scope import crop_budgets
    from prune_audit.pruners.registry import selector_from_strings
    from prune_audit.pruners.signals import PADDED_CROPS, LayerSignals

    checkpoint = build_llava_next(
        tmp_path / "model", words=[*WORDS, "Is", *CATEGORIES], vision_layers=4, text_layers=NUM_LAYERS, seed=3
    )
    vlm = load_vlm(checkpoint, device="cpu")
    with pytest.raises(PruneAuditError, match="budget_scope=crop") as error:
        vlm.check_selector(get_selector("vscan"))
    assert "\n" not in str(error.value)
    selector = selector_from_strings("vscan", ["budget_scope=crop", "window_size=2", "local_count=official"])
    for seed, size in enumerate(SIZES):
        item = vlm.prepare(random_image(seed, size), QUESTIONS[0])
        budget = item.num_visual // 3
        first = vlm.schedule(selector, item.num_visual, budget)[0]
        crops = item.pixel_values.shape[0]
        shares = crop_budgets(first.keep, [16] * crops)  # 4 x 4 patches per 56-px crop
        expected, features = official_vscan_per_crop(vlm, item, shares, window=2)
        assert expected.numel() < first.keep  # kept patches in the padding were dropped
        prefill, _ = vlm.prefill([item], selector, budget)
        plain, merged = prefill.kept_stages[0][0], prefill.merged_stages[0][0]
        # each merged token stands in its kept token's slot: the one kept token among its sources
        targets = [sorted(set(sources) & set(expected.tolist())) for sources in merged]
        assert all(len(target) == 1 for target in targets)
        assert sorted(plain + [target for [target] in targets]) == expected.tolist()
        [output] = vlm._vision([item], frozenset({"layer_cls_attention", PADDED_CROPS}))
        signals = LayerSignals(
            alive=torch.arange(item.num_visual),
            grid=item.grid,
            layer=0,
            num_layers=NUM_LAYERS,
            hidden_states=output.features.float(),
            padded_crops=output.signals[PADDED_CROPS],
            layer_cls_attention=output.signals["layer_cls_attention"],
            text_probs=torch.zeros(1, 1, item.num_visual),
        )  # read by the LLM stage only
        state = {}
        kept = selector.prune(first, signals, state)
        merge = selector.merge(first, signals, state, kept)
        assert torch.equal(kept, expected)
        inputs = output.features.float().clone()
        inputs[merge.replaces] = merge.hidden
        torch.testing.assert_close(inputs[kept], features[expected], atol=TOL, rtol=0)
    from test_compute import counted, eager

    outside, inside, answer = counted(eager(vlm), item, selector, budget)  # padding projected, merges per crop
    assert (outside, inside) == (answer.cost.flops_vision + answer.cost.flops_llm, answer.cost.flops_selector)
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        run_args(
            workspace,
            checkpoint,
            out,
            "--selector",
            "vscan",
            "--budget",
            "20",
            "--option",
            "budget_scope=crop",
            "--option",
            "window_size=2",
        ),
    )
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "records.parquet").to_pandas()
    assert len(records) == 4 and records["visual_tokens_avg"].between(1, 20).all()


def test_e2s_sees_the_base_view_and_tile_grids_on_llava_next(tmp_path):
    """E2S's novelty blocks lie on each regular grid: the in-LLM signals carry the base view's and the tile grid's
    (rows, cols) (``LayerSignals.grid_parts``), and E2S runs there (its novelty bonus is tested by hand in
    tests/pruners/test_e2s.py)."""
    from tiny_models import RecordingLayerSelector

    checkpoint = adapter_for("llava_next", "test").build_tiny(
        tmp_path / "model", words=[*WORDS, "Is"], text_layers=NUM_LAYERS
    )
    vlm = load_vlm(checkpoint, device="cpu")
    item = vlm.prepare(random_image(0, SIZES[0]), QUESTIONS[0])
    base, tiles = item.geometry.grids
    recorder = RecordingLayerSelector(layer=1, keep=8)
    vlm.answer([item], recorder, 8)
    assert recorder.records[0].grid_parts == (base.grid, tiles.grid) and item.grid == (1, item.num_visual)
    assert base.grid[0] * base.grid[1] + tiles.grid[0] * tiles.grid[1] == item.num_visual
    [answer] = vlm.answer([item], get_selector("e2s"), item.num_visual // 2)
    assert answer.kept_stages and len(answer.kept_stages[-1]) < item.num_visual


def official_flowcut_anyres_tower(vlm, item, image_size, budget):
    """FlowCut's anyres tower stage re-derived from TungChintao/FlowCut a2ecd24 on the stock CLIP modules:
    ``main.py`` (``target = int(budget / 2) + 1`` per crop), ``modeling_clip_flowcut.py`` on all crops as one
    batch (``CLIPAttention_forward``'s CLS row, unscaled CLS-value softmax and values, each head-mean;
    ``CLIPEncoderLayer_forward``'s running score and cuts after the MLP, ``adaptive_prune_ratio``'s size the
    largest over the batch, ``select_layer = layers - 2``), ``llava_arch.py`` (the base view's kept patches, then
    the tiles' restored into the canvas, ``unpad_mask`` with the image's (width, height), row-major). Returns the
    (M, Dv) features in that order, their visual tokens, and each cut's kept visual tokens (ascending) by layer."""
    from test_flowcut import official_compute_score, official_prune_number  # the official functions, re-typed
    from transformers.image_processing_utils import select_best_resolution

    config = vlm.model.config
    tower = vlm.model.model.vision_tower
    side = config.vision_config.image_size // config.vision_config.patch_size
    height, width = select_best_resolution((image_size[1], image_size[0]), config.image_grid_pinpoints)
    rows, cols = height // config.vision_config.image_size, width // config.vision_config.image_size
    canvas = torch.ones(rows * side, cols * side, dtype=torch.bool)
    original_width, original_height = image_size
    if original_width / original_height > canvas.shape[1] / canvas.shape[0]:  # unpad_mask
        padding = (canvas.shape[0] - int(original_height * canvas.shape[1] / original_width)) // 2
        canvas[:padding], canvas[canvas.shape[0] - padding :] = False, False
    else:
        padding = (canvas.shape[1] - int(original_width * canvas.shape[0] / original_height)) // 2
        canvas[:, :padding], canvas[:, canvas.shape[1] - padding :] = False, False
    number = torch.full(canvas.shape, -1)
    number[canvas] = side * side + torch.arange(int(canvas.sum()))  # the tile grid after the base view's tokens

    def token(crop: int, patch: int) -> int:
        if crop == 0:
            return patch
        row, col = divmod(crop - 1, cols)
        return int(number[row * side + patch // side, col * side + patch % side])

    def tokens_of(keep):
        found = [token(crop, int(p)) for crop in range(keep.shape[0]) for p in keep[crop]]
        return sorted(t for t in found if t >= 0)

    target, layers = budget // 2 + 1, tower.encoder.layers
    select_layer, heads = len(layers) - 2, config.vision_config.num_attention_heads
    with torch.no_grad():
        hidden = tower.pre_layrnorm(tower.embeddings(item.pixel_values))
        keep_all = torch.arange(hidden.shape[1])[None].expand(hidden.shape[0], -1)
        cumulative, cuts, features = None, {}, None
        for idx, layer in enumerate(layers):
            rpl = select_layer - idx - 1
            if idx == select_layer + 1:
                features, kept = hidden[:, 1:].clone(), keep_all.clone()
            attention, batch, length = layer.self_attn, hidden.shape[0], hidden.shape[1]
            normed = layer.layer_norm1(hidden)
            q, k, v = (
                proj(normed).view(batch, length, heads, -1).transpose(1, 2)
                for proj in (attention.q_proj, attention.k_proj, attention.v_proj)
            )
            probs = torch.softmax((q * attention.scale) @ k.transpose(2, 3), dim=-1)
            semantic = torch.softmax(v[:, :, :1] @ v.transpose(2, 3), dim=-1)[:, :, 0].mean(1)
            out = attention.out_proj((probs @ v).transpose(1, 2).reshape(batch, length, -1))
            hidden = hidden + out
            hidden = hidden + layer.mlp(layer.layer_norm2(hidden))
            if length > target:
                cls_attention = probs[:, :, 0, 1:].mean(dim=1)
                scores = official_compute_score(cls_attention, semantic[:, 1:], v.mean(1)[:, 1:])
                cumulative = scores.clone() if cumulative is None else 0.5 * cumulative + 0.5 * scores
                if not rpl % 2:
                    prune_num = official_prune_number(cls_attention, rpl, target - 1) if rpl else length
                    target_num = max(length - prune_num, target)
                    keep = torch.topk(cumulative, target_num - 1, dim=1).indices.sort(dim=1).values
                    index = keep[..., None].expand(-1, -1, hidden.shape[-1])
                    hidden = torch.cat([hidden[:, :1], torch.gather(hidden[:, 1:], 1, index)], dim=1)
                    cumulative = torch.gather(cumulative, 1, keep)
                    keep_all = torch.gather(keep_all, 1, keep)
                    if target_num < length:
                        cuts[idx] = tokens_of(keep_all)
    if features is None:  # a tower of select_layer + 1 layers: the last state
        features, kept = hidden[:, 1:], keep_all
    base = [(int(p), features[0, i]) for i, p in enumerate(kept[0])]
    tiles = [
        (token(crop, int(p)), features[crop, i]) for crop in range(1, kept.shape[0]) for i, p in enumerate(kept[crop])
    ]
    tiles = sorted((entry for entry in tiles if entry[0] >= 0), key=lambda entry: entry[0])
    joined = base + tiles
    return torch.stack([state for _, state in joined]), [t for t, _ in joined], cuts


@pytest.mark.parametrize(("size", "budget"), [((130, 100), 12), ((100, 130), 20), ((130, 100), 25)])
def test_flowcut_tower_stage_runs_per_crop_on_llava_next_as_its_official_anyres_code(tmp_path, size, budget):
    """FlowCut's anyres tower stage on a tiny LLaVA-NeXT with a 6-layer tower (5 run: cuts after layers 1 and 3):
    half the budget kept in every crop, the cut size the largest over the crops, the kept patches that unpadding
    leaves laid out base view first then the tile grid row-major without newlines; the selection (features,
    tokens, each cut's kept tokens as a stage at layer l - 5) equals the official code re-derived on the stock
    tower, and a budget over every token keeps every token (the dense input). The decoder layer-1 cut that
    follows it: test_flowcut_cuts_after_decoder_layer_1_on_llava_next_as_its_official_anyres_code."""
    from prune_audit.models.llava_next import build_llava_next
    from prune_audit.models.prefill_assembly import input_signals

    checkpoint = build_llava_next(tmp_path / "model", words=[*WORDS, "Is"], vision_layers=6, seed=3)
    vlm = load_vlm(checkpoint, device="cpu")
    item = vlm.prepare(random_image(4, size), QUESTIONS[0])
    selector = get_selector("flowcut").tower_stage()
    requires = frozenset({"crop_merging_tower"})
    [output] = vlm._vision([item], requires)
    signals = input_signals(vlm, item, output, requires)
    with torch.no_grad():
        selection = selector.select(signals, budget)
    features, tokens, cuts = official_flowcut_anyres_tower(vlm, item, size, budget)
    assert selection.kept.tolist() == tokens and selection.in_output_order
    torch.testing.assert_close(selection.vision_tokens, features, atol=TOL, rtol=TOL)
    assert [(layer, kept.tolist()) for layer, kept in selection.tower_stages] == [
        (layer - 5, kept) for layer, kept in sorted(cuts.items())
    ]
    assert max(cuts) == 3 and len(tokens) <= item.pixel_values.shape[0] * (budget // 2)
    dense = selector.select(signals, item.num_visual)
    assert dense.kept.tolist() == list(range(item.num_visual)) and dense.sources is None


def official_decoder_forward(vlm, item, selection, budget, appended=None):
    """The official anyres prefill after FlowCut's tower stage, re-derived on the stock decoder modules
    (TungChintao/FlowCut a2ecd24 ``modeling_llama_flowcut.py``): the prompt with the tower stage's features in
    place of the image (no newlines), every layer on positions ``0..L-1`` up to layer 1, whose post-RoPE queries,
    keys and values score the visual span (``official_decoder_cut``, the last prompt token), layer 1 run on every
    token, its output cut to the ``budget`` kept tokens, and positions ``0..L'-1`` from layer 2 on
    (``LlamaModel_forward``). Returns the last position's logits and the kept positions in the span. ``appended``:
    a token id after the prompt, whose logits are then the official first decode step's (its position is the
    prompt's length in layers 0 and 1 and that less the tokens cut from layer 2 on, ``position_ids -= ...``,
    and it attends to every token in layers 0 and 1 and to the kept ones after: the cut of the prompt alone)."""
    from test_flowcut import official_decoder_cut
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = vlm.model
    language = model.model.language_model
    start, end = item.image_span
    ids = item.input_ids
    features = model.model.multi_modal_projector(selection.vision_tokens)
    embed = language.embed_tokens
    tail = ids[end:] if appended is None else torch.cat([ids[end:], torch.tensor([appended])])
    hidden = torch.cat([embed(ids[:start]), features, embed(tail)])[None]
    visual, prompt = features.shape[0], hidden.shape[1] - (appended is not None)
    keep = None
    for index, layer in enumerate(language.layers):
        positions = torch.arange(hidden.shape[1])[None]
        cos, sin = language.rotary_emb(hidden, positions)
        if index == 1:
            attention, length = layer.self_attn, hidden.shape[1]
            normed = layer.input_layernorm(hidden)
            q, k, v = (
                proj(normed).view(1, length, -1, attention.head_dim).transpose(1, 2)
                for proj in (attention.q_proj, attention.k_proj, attention.v_proj)
            )
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # repeat_kv
            keep = official_decoder_cut(q, k, v, start, visual, prompt, budget)  # last_instruct_pos: the prompt's
        hidden = layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
        if index == 1:
            span = hidden[:, start : start + visual]
            hidden = torch.cat([hidden[:, :start], span[:, keep], hidden[:, start + visual :]], dim=1)
    logits = model.lm_head(language.norm(hidden[:, -1])).float()
    return logits[0], keep


@pytest.mark.parametrize(("size", "budget"), [((130, 100), 12), ((100, 130), 20), ((130, 100), 25)])
def test_flowcut_cuts_after_decoder_layer_1_on_llava_next_as_its_official_anyres_code(tmp_path, size, budget):
    """FlowCut end to end on a tiny LLaVA-NeXT (6-layer tower, 4 decoder layers): the tower stage's tokens (tested
    against the official tower above), then the budget kept after decoder layer 1 by the last prompt token's flow
    score, positions renumbered: the stages recorded (tower cuts, the input, layer 2), the tokens kept at layer 2
    and the last position's logits equal the official prefill re-derived on the stock modules, and so does one
    greedy decode step (layers 0 and 1 on every token, positions shifted after); a budget of every token is the
    dense prefill."""
    from prune_audit.models.llava_next import build_llava_next

    checkpoint = build_llava_next(tmp_path / "model", words=[*WORDS, "Is"], vision_layers=6, text_layers=4, seed=3)
    vlm = load_vlm(checkpoint, device="cpu")
    item = vlm.prepare(random_image(4, size), QUESTIONS[0])
    selector = get_selector("flowcut", budget_rule="paper")  # the official target_num after layer 1
    vlm.check_selector(selector)  # no longer refused
    prefill, [selection] = vlm.prefill([item], selector, budget)
    fed = selection.num_output_tokens
    assert fed > budget and selection.in_output_order  # half the budget per crop over 5 crops
    with torch.no_grad():
        logits, keep = official_decoder_forward(vlm, item, selection, budget)
    assert prefill.stage_layers == [[2]] and prefill.tokens_per_layer[0] == [fed, fed, budget, budget]
    assert prefill.kept_stages[0][0] == selection.kept[keep].tolist() and len(keep) == budget
    torch.testing.assert_close(prefill.logits[0], logits, atol=TOL, rtol=TOL)
    cached, _ = vlm.prefill([item], selector, budget, use_cache=True)  # one greedy step, the official positions
    token = int(cached.logits[0].argmax())
    with torch.no_grad():
        step = vlm.loop.decode_step(cached.decode, torch.tensor([token]))
        official_step, _ = official_decoder_forward(vlm, item, selection, budget, appended=token)
    torch.testing.assert_close(step[0], official_step, atol=TOL, rtol=TOL)
    [answer] = vlm.answer([item], selector, budget)  # the record: the tower cuts, the input, layer 2
    assert answer.stage_layers == [layer for layer, _ in selection.tower_stages] + [0, 2]
    assert answer.kept_stages[-2:] == [selection.kept.tolist(), selection.kept[keep].tolist()]
    dense, _ = vlm.prefill([item])
    everything, _ = vlm.prefill([item], selector, item.num_visual)
    assert torch.equal(everything.logits, dense.logits) and everything.stage_layers == [[]]


@pytest.mark.parametrize("size", SIZES)
def test_flowcut_flops_and_kv_bytes_on_llava_next_equal_the_counted(tmp_path, size):
    """FlowCut's cost on the tiny LLaVA-NeXT: the FLOPs ``FlopCounterMode`` counts over the eager prefill (the
    stock tower, the tower rerun on every crop with its cuts, the decoder with its layer-1 probe and values, the
    prompt without newlines) equal the accounting's, the selector's own (its semantic products in the tower and
    at layer 1) equal ``flops_selector``, at budgets that cut in the tower and at layer 1, at layer 1 only, and
    keep everything (``budget_rule=paper``: the tiny decoder's 4 layers leave the average rule few budgets); the
    KV bytes equal the cache's."""
    from test_compute import counted, eager

    from prune_audit.models.llava_next import build_llava_next

    checkpoint = build_llava_next(tmp_path / "model", words=[*WORDS, "Is"], vision_layers=6, text_layers=4, seed=3)
    vlm = eager(load_vlm(checkpoint, device="cpu"))
    item = vlm.prepare(random_image(4, size), QUESTIONS[0])
    selector = get_selector("flowcut", budget_rule="paper")  # the average rule's counts cost the same way
    seen = set()
    for budget in (12, 40, item.num_visual):
        outside, inside, answer = counted(vlm, item, selector, budget)
        cost = answer.cost
        assert outside == cost.flops_vision + cost.flops_llm and inside == cost.flops_selector, budget
        seen.add(tuple(layer for layer in answer.stage_layers if layer != 0))
        prefill, _ = vlm.prefill([item], selector, budget, use_cache=True)
        cache = prefill.decode.cache
        stored = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                     for layer in cache.layers)  # fmt: skip
        assert cost.kv_bytes == stored, budget
    assert seen == {(-2, 2), (2,), ()}  # tower and decoder cuts, the decoder cut alone, none


def test_flowcut_average_rule_solves_the_decoder_count_to_the_layer_average_on_llava_next(tmp_path):
    """The default ``budget_rule=average`` on the tiny LLaVA-NeXT (4 decoder layers): layers 0 and 1 hold the
    tokens the tower stage feeds, layers 2 and 3 the count that makes the realised layer average the budget
    (within a token); a budget the first two layers alone exceed is refused in one line naming the paper rule."""
    from prune_audit.models.llava_next import build_llava_next

    checkpoint = build_llava_next(tmp_path / "model", words=[*WORDS, "Is"], vision_layers=6, text_layers=4, seed=3)
    vlm = load_vlm(checkpoint, device="cpu")
    item = vlm.prepare(random_image(4, SIZES[0]), QUESTIONS[0])
    [answer] = vlm.answer([item], get_selector("flowcut"), 32)
    fed, kept = answer.tokens_per_layer[0], answer.tokens_per_layer[2]
    assert answer.tokens_per_layer == [fed, fed, kept, kept] and kept < fed
    assert abs(sum(answer.tokens_per_layer) / 4 - 32) <= 0.5
    with pytest.raises(PruneAuditError) as error:
        vlm.answer([item], get_selector("flowcut"), 12)
    assert "budget_rule=paper" in str(error.value) and "\n" not in str(error.value)
