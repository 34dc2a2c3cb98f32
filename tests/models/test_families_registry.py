"""Every registered model family, the same checks (as timm tests every registered model).

Each family builds its own tiny random-weight checkpoint offline (``build_tiny``). For
each: keep-all equals the stock transformers forward (logits) and stock greedy
generation; the decoder probe equals eager attention; dropping tokens equals the stock
forward with them masked; every selector runs at the full budget or is refused in one
line (the class-level ``selector_support`` and ``selectors --model FAMILY`` say the same); a batch of two
image sizes equals each prompt alone; forced kept sets and stages are honoured; the yes/no reduction and
``describe`` hold; ``prune-audit run`` records every supported selector, shards merge to one
process's records, a rerun resumes, ``visualize`` (live and ``--run``; one picture per token grid on
LLaVA-NeXT and LLaVA-OneVision) and ``intervene`` run; the token
geometry maps every visual token to its pixels, on synthetic images and on a real COCO
image's object masks; docs/models.md's selector table says what runs. The registry itself
(registration order, one-line refusals of other model types and bad options) is checked here too. What only
LLaVA-1.5 or Qwen2.5-VL has is in tests/models/test_llava.py and tests/models/test_qwen2_5_vl.py; other
family-specific checks follow at the end (InternVL's pixel shuffle and tiling refusal, Qwen3-VL's
deepstack, the real-size image processors, LLaVA-NeXT's and LLaVA-OneVision's anyres crops).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from tiny_models import (
    QUESTIONS,
    WORDS,
    RecordingLayerSelector,
    assert_batch_equals_one_at_a_time,
    masked_reference_logits,
    random_image,
    stock_inputs,
    visual_columns,
)
from torch import Tensor
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import mask_area_per_token, token_footprints, token_index_map
from prune_audit.data.multigrid import grid_pieces
from prune_audit.data.scenes import CATEGORIES
from prune_audit.errors import PruneAuditError
from prune_audit.models import families, family_names, load_vlm, register_family
from prune_audit.models.families import adapter_for
from prune_audit.models.llava import LlavaModel
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector, list_selectors
from prune_audit.records.schema import TIMING_COLUMNS

TOL = 1e-5
NUM_LAYERS = 4
SIZES = [(130, 100), (100, 130)]  # landscape and portrait: non-square grids where the family allows them

runner = CliRunner()


@pytest.fixture(scope="module", params=family_names())
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    words = [*WORDS, "Is", *CATEGORIES]
    return adapter_for(family, "test").build_tiny(
        tmp_path_factory.mktemp(family) / "model", words=words, text_layers=NUM_LAYERS, seed=3
    )


@pytest.fixture(scope="module")
def vlm(checkpoint):
    return load_vlm(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def prepared(vlm):
    return [vlm.prepare(random_image(seed, size), q) for seed, (size, q) in enumerate(zip(SIZES, QUESTIONS))]


@pytest.mark.parametrize("name", [None, "divprune", "fastv", "e2s"])
def test_batch_with_different_grids_equals_one_at_a_time(vlm, prepared, name):
    """Two prompts of different image sizes in one batch (padding, per-row positions) answer as alone."""
    selector = None if name is None else get_selector(name)
    if name is not None and name not in vlm.supported_selectors():
        pytest.skip(f"{name} does not run on {vlm.family}")
    budget = None if name is None else min(item.num_visual for item in prepared) // 2
    assert_batch_equals_one_at_a_time(vlm, prepared, selector, budget)


def test_forced_kept_sets_and_stages_are_honoured(vlm, prepared):
    item = prepared[0]
    n = item.num_visual
    kept = [n - 1, 1, 5, 0]
    [answer] = vlm.answer([item], forced_kept=[kept])
    assert answer.kept == sorted(kept) and answer.kept_stages == [sorted(kept)]
    assert answer.tokens_per_layer == [len(kept)] * NUM_LAYERS
    stages = [(1, list(range(0, n, 2))), (3, [0, 4])]
    [answer] = vlm.answer([item], forced_stages=[stages])
    assert answer.kept_stages == [stages[0][1], stages[1][1]] and answer.stage_layers == [1, 3]
    assert answer.tokens_per_layer == [n, len(stages[0][1]), len(stages[0][1]), 2]


def test_yes_no_reduction_is_consistent(vlm, prepared):
    [answer] = vlm.answer([prepared[0]])
    probs = torch.softmax(vlm.prefill([prepared[0]])[0].logits[0].double(), dim=-1)
    assert answer.p_yes == pytest.approx(float(probs[vlm.yes_ids].sum()))
    assert answer.p_yes_2way == pytest.approx(answer.p_yes / (answer.p_yes + answer.p_no))
    assert answer.logit_diff == pytest.approx(float(torch.log(probs[vlm.yes_ids].sum() / probs[vlm.no_ids].sum())))
    assert sorted(vlm.tokenizer.convert_ids_to_tokens(vlm.yes_ids + vlm.no_ids)) == ["No", "Yes", "no", "yes"]


def test_describe_names_what_a_manifest_needs(family, vlm):
    description = vlm.describe()
    assert description["family"] == family and description["attn_implementation"] == "sdpa"
    assert description["dtype"] == "float32" and description["device"] == "cpu"
    assert description["num_layers"] == NUM_LAYERS and len(description["model"]["config_hash"]) == 16
    assert description["processor"]["mode"]


# ----- the registry itself -------------------------------------------------------------------------------


def test_registered_families_in_registration_order():
    assert family_names() == [
        "llava",
        "qwen2_5_vl",
        "qwen2_vl",
        "internvl",
        "qwen3_vl",
        "llava_next",
        "llava_onevision",
    ]
    assert families.adapter_for("llava", "x") is LlavaModel
    assert families.adapter_for("qwen2_5_vl", "x") is QwenModel


def test_an_unregistered_model_type_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(PruneAuditError) as error:
        load_vlm(tmp_path, device="cpu")
    assert (
        str(error.value)
        == f"{tmp_path} is a 'bert' model; supported families: llava, qwen2_5_vl, qwen2_vl, internvl, qwen3_vl, llava_next, llava_onevision"
    )


def test_a_model_type_cannot_be_served_by_two_adapters():
    register_family("llava", LlavaModel)  # the same registration again is harmless
    with pytest.raises(ValueError, match="already served by LlavaModel"):
        register_family("llava", QwenModel)


def test_load_vlm_uses_the_registered_adapter(tmp_path, monkeypatch):
    class CustomLlava(LlavaModel):
        pass

    path = LlavaModel.build_tiny(tmp_path / "llava", words=WORDS, text_layers=2, seed=1)
    monkeypatch.setitem(families._ADAPTERS, "llava", CustomLlava)
    assert type(load_vlm(path, device="cpu")) is CustomLlava


@pytest.mark.parametrize(
    ("adapter", "template", "clip_text", "message"),
    [
        (LlavaModel, "chatml", None, "unknown LLaVA prompt template 'chatml'; choose llava_hf or vicuna_v1"),
        (QwenModel, "vicuna_v1", None, "unknown Qwen2.5-VL prompt template 'vicuna_v1'; choose qwen2_5_vl"),
        (QwenModel, None, "clip", "clip_text applies to LLaVA's CLIP vision tower; Qwen2.5-VL has no CLIP space"),
    ],
)
def test_options_are_checked_by_the_adapter_class(adapter, template, clip_text, message):
    with pytest.raises(PruneAuditError) as error:
        adapter.resolve_template(template)
        adapter.check_clip_text(clip_text)
    assert str(error.value) == message


def test_every_family_declares_its_parts():
    for name in family_names():
        adapter = adapter_for(name, "test")
        assert adapter.family == name and adapter.display_name and adapter.prompt_templates
        assert callable(adapter.build_tiny) and adapter.transformers_class().__name__.endswith(
            "ForConditionalGeneration"
        )


def test_loaded_model_is_the_registered_adapter(family, vlm):
    assert type(vlm) is adapter_for(family, "test")
    assert vlm.describe()["family"] == family


DIRECT_FORWARD_FAMILIES = {"llava", "qwen2_5_vl", "qwen2_vl"}  # the demo's direct forwards hold on these only


def test_direct_forwards_equal_the_stock_forward_or_refuse_in_one_line(family, vlm):
    image = random_image(5, (112, 112))  # square: Qwen's first_token_logits rebuilds the grid from the count
    if family not in DIRECT_FORWARD_FAMILIES:
        for call in (
            lambda: vlm.vision_state_width,
            lambda: vlm.image_inputs([image]),
            lambda: vlm.first_token_logits(None, None, []),
        ):
            with pytest.raises(PruneAuditError, match="has no direct forwards") as error:
                call()
            assert "\n" not in str(error.value)
        return
    item = vlm.prepare(image, QUESTIONS[0])
    ids = item.input_ids[None]
    with torch.no_grad():
        features = vlm.image_features(**vlm.image_inputs([image]))[0]
        direct = vlm.first_token_logits(ids, torch.ones_like(ids), [features])[0].float()
        stock = vlm.model(**stock_inputs(vlm, item)).logits[0, -1].float()
    assert (direct - stock).abs().max() <= TOL


def test_keep_all_equals_the_stock_forward(vlm, prepared):
    for item in prepared:
        with torch.no_grad():
            stock = vlm.model(**stock_inputs(vlm, item)).logits[0, -1].float()
        assert (vlm.prefill([item])[0].logits[0] - stock).abs().max() <= TOL


def test_decoder_probe_equals_eager_attention(vlm, checkpoint, prepared):
    """The text-to-image attention rows the in-LLM selectors score, against the stock eager attention
    (GQA, M-RoPE, Qwen3's per-head query/key norms, deepstack additions before the layer)."""
    item = prepared[0]
    eager = type(vlm).transformers_class().from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = eager(**stock_inputs(vlm, item), output_attentions=True).attentions
    end = item.image_span[1]
    for layer in (1, NUM_LAYERS - 1):
        selector = RecordingLayerSelector(layer=layer, keep=item.num_visual - 1)
        vlm.answer([item], selector, 1)
        expected = attentions[layer][0, :, end:, visual_columns(item)]
        assert (selector.records[-1].text_probs - expected).abs().max() <= TOL


def test_in_llm_drop_equals_the_stock_forward_with_dropped_keys_masked(vlm, prepared):
    """Dropping tokens at a layer (original positions) equals masking them from that layer on in the stock
    forward: Qwen3-VL's deepstack features follow the same kept set."""
    item = prepared[1]
    kept = list(range(0, item.num_visual, 3))
    logits = vlm.prefill([item], forced_stages=[[(1, kept)]])[0].logits[0]
    assert (logits - masked_reference_logits(vlm, item, [1], [kept])).abs().max() <= TOL
    if vlm.positions_for(get_selector("divprune")) == "keep_original":  # input level, same ids
        logits = vlm.prefill([item], forced_kept=[kept])[0].logits[0]
        assert (logits - masked_reference_logits(vlm, item, [0], [kept])).abs().max() <= TOL


def test_keep_all_generation_equals_stock_generate(vlm, prepared):
    item = prepared[0]
    with torch.no_grad():
        stock = vlm.model.generate(**stock_inputs(vlm, item), max_new_tokens=5, do_sample=False)
    expected = vlm.tokenizer.decode(stock[0, item.input_ids.numel() :], skip_special_tokens=True).strip()
    assert vlm.generate(item, max_new_tokens=5) == expected


@pytest.mark.parametrize("name", list_selectors())
def test_every_selector_at_full_budget_equals_keep_all_or_refuses_in_one_line(vlm, prepared, name):
    item = prepared[0]
    if name not in vlm.supported_selectors():
        with pytest.raises(PruneAuditError) as error:
            vlm.answer([item], get_selector(name), item.num_visual)
        message = str(error.value)  # the cause, and the fix: other selectors or the missing CLIP text tower
        assert "\n" not in message and ("selectors that work here: " in message or "--clip-text" in message)
        return
    prefill, _ = vlm.prefill([item], get_selector(name), item.num_visual)
    assert prefill.tokens_per_layer[0] == [item.num_visual] * NUM_LAYERS


def test_geometry_maps_every_visual_token_to_its_pixels(vlm, prepared):
    """Every grid of the geometry (LLaVA-NeXT: base view and unpadded tiles) maps each of its tokens to pixels
    it owns, and the grids together number every visual token once; the family declares that geometry
    from the image size alone (``token_geometry``, what ``import --geometry`` and the demo ask)."""
    for item in prepared:
        geometry = item.geometry
        assert vlm.token_geometry(item.image_size) == geometry
        assert geometry.grid == item.grid and geometry.num_tokens == item.num_visual
        assert geometry.image_size == item.image_size
        covered = []
        for first, grid in grid_pieces(geometry):
            index = token_index_map(grid)
            # every token owns pixels; pixels without a token (-1) are those a centre crop or unpadding removed, or
            # the strip a SigLIP crop leaves unseen (OneVision: 27 patches of 14 px in a 384-px crop)
            assert set(np.unique(index)) - {-1} == set(range(grid.num_tokens))
            assert (index >= 0).all() or grid.mode in ("hf_crop", "anyres_tiles", "anyres_tiles_downsampled")
            covered += range(first, first + grid.num_tokens)
        assert covered == list(range(item.num_visual))
        boxes = token_footprints(geometry)
        assert boxes.shape == (item.num_visual, 4) and (boxes[:, 2] > boxes[:, 0]).all()


def test_real_coco_mask_area_sums_back_per_token(vlm, shared_data):
    coco_dir = shared_data / "coco" / "tiny_coco_val2017"
    coco = CocoInstances.load(coco_dir / "instances_val2017.json")
    image_id = next(i for i in sorted(coco.images) if coco.object_names(i))
    entry = coco.image(image_id)
    image = Image.open(coco_dir / "val2017" / entry.file_name)
    geometry = vlm.prepare(image, QUESTIONS[0]).geometry
    assert geometry.image_size == entry.size
    for name in coco.object_names(image_id):
        mask = coco.category_mask(image_id, name)
        area = mask_area_per_token(mask, geometry)
        for first, grid in grid_pieces(geometry):  # each grid alone counts every mask pixel it sees once
            seen = token_index_map(grid) >= 0
            assert mask.any() and area[first : first + grid.num_tokens].sum() == (mask & seen).sum()


def run_args(workspace, checkpoint, out, *extra: str) -> list[str]:
    args = [
        "run",
        "--model",
        str(checkpoint),
        "--images",
        str(workspace["images"]),
        "--annotations",
        str(workspace["instances"]),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--limit",
        "4",
        "--batch-size",
        "2",
    ]
    for path in workspace["pope"]:
        args += ["--pope", str(path)]
    return args + list(extra)


@pytest.mark.parametrize("name", list_selectors())
def test_run_records_every_supported_selector_and_refuses_the_rest(
    vlm, prepared, checkpoint, workspace, tmp_path, name
):
    out = tmp_path / name
    budget = prepared[0].num_visual // 2  # feasible for every schedule: above the layer-0 share of 4 layers
    result = runner.invoke(app, run_args(workspace, checkpoint, out, "--selector", name, "--budget", str(budget)))
    if name not in vlm.supported_selectors():
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
        assert name in result.stderr and ("selectors that work here" in result.stderr or "--clip-text" in result.stderr)
        assert not (out / "records.parquet").exists()
        return
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "records.parquet").to_pandas()
    assert len(records) == 4
    assert records["visual_tokens_avg"].between(1, records["prefill_tokens"].min()).all()


def test_internvl_pixel_shuffle_puts_each_2x2_patch_block_in_one_row_major_token():
    """The geometry's claim (token (r, c) covers patches 2r..2r+1 x 2c..2c+1), checked on the stock
    ``pixel_shuffle`` the adapter calls, with patch coordinates as features."""
    from transformers.models.internvl.modeling_internvl import (
        InternVLModel as StockInternVL,
    )

    side = 6
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    patches = torch.stack([rows, cols], dim=-1).float()[None]  # (1, side, side, 2): each patch's (row, col)
    shuffled = StockInternVL.pixel_shuffle(None, patches, scale_factor=0.5).reshape(-1, 4, 2)
    for token, members in enumerate(shuffled):
        r, c = divmod(token, side // 2)
        assert {tuple(m) for m in members.int().tolist()} == {(2 * r + i, 2 * c + j) for i in (0, 1) for j in (0, 1)}


def test_internvl_tiles_are_the_processors_and_the_one_tile_checkpoint_still_runs(tmp_path):
    """The tiny InternVL tiles (registry checkpoint: up to 6 tiles plus a thumbnail): the processor's tile count
    times a tile's tokens is the prompt's ``<IMG_CONTEXT>`` count and the geometry's; the crops are the tiles then
    the thumbnail; a batch of images with 7, 5 and 1 tiles answers as each alone. A processor without
    ``crop_to_patches`` gives one grid, and keep-all equals the stock forward."""
    from prune_audit.models.internvl import build_internvl

    vlm = load_vlm(adapter_for("internvl", "test").build_tiny(tmp_path / "tiled", words=WORDS), device="cpu")
    for size, tiles in [((130, 100), 6 + 1), ((56, 168), 3 + 1), ((32, 32), 1)]:
        item = vlm.prepare(random_image(0, size), QUESTIONS[0])
        count = vlm.image_processor.get_number_of_image_patches(size[1], size[0])
        assert item.pixel_values.shape[0] == count == tiles
        assert item.num_visual == tiles * 4 == int((item.input_ids == vlm.model.config.image_token_id).sum())
        assert [tokens.tolist() for tokens, _ in vlm.crop_tokens(item)] == [
            list(range(4 * t, 4 * t + 4)) for t in range(tiles)
        ]
    sizes = [(130, 100), (64, 64), (32, 32)]
    mixed = [vlm.prepare(random_image(seed, size), QUESTIONS[0]) for seed, size in enumerate(sizes)]
    assert [item.pixel_values.shape[0] for item in mixed] == [7, 5, 1]  # one tower call splits them back per image
    assert_batch_equals_one_at_a_time(vlm, mixed, None, None)
    assert_batch_equals_one_at_a_time(vlm, mixed, get_selector("divprune"), 3)
    one_tile = load_vlm(build_internvl(tmp_path / "one", words=WORDS, image_size=56), device="cpu")
    item = one_tile.prepare(random_image(0, (130, 100)), QUESTIONS[0])
    assert item.grid == (2, 2) and item.pixel_values.shape[0] == 1
    inputs = stock_inputs(one_tile, item)
    with torch.no_grad():
        stock = one_tile.model(**inputs).logits[:, -1].float()
    torch.testing.assert_close(one_tile.prefill([item])[0].logits, stock, atol=TOL, rtol=0)


def test_internvl_uniform_and_e2s_run_on_each_tile_grid(tmp_path):
    """Uniform and E2S need only a grid layout: on InternVL each tile's and the thumbnail's grid is one
    (``grid_parts``). Re-derived here: the tiles from the processor's tile count, each a block of consecutive
    4 x 4 tokens (64-px tiles of 8-px patches, pixel-shuffled); the budget split by hand (equal grids: ``b // 7``, the
    first ``b % 7`` one more); uniform on each grid alone; by hand at 4 per grid the lattice points (1, 1), (1, 3),
    (3, 1), (3, 3) of a 4 x 4 grid take their tied nearest cells' first, 0, 2, 8 and 10. ``budget_scope=crop`` gives the
    same sets (the same even split). E2S: the in-LLM signals carry the seven 4 x 4 grids, and its novelty bonus marks
    the best token of each 2 x 2 block of every tile (re-derived by reshaping the scores)."""
    from prune_audit.pruners.e2s import novelty_bonus
    from prune_audit.pruners.registry import selector_from_strings
    from prune_audit.pruners.signals import InputSignals

    checkpoint = adapter_for("internvl", "test").build_tiny(
        tmp_path / "model", words=WORDS, image_size=64, text_layers=NUM_LAYERS
    )
    vlm = load_vlm(checkpoint, device="cpu")
    item = vlm.prepare(random_image(0, (130, 100)), QUESTIONS[0])
    grids = item.pixel_values.shape[0]
    assert grids == 7 and item.num_visual == 16 * grids
    vlm.check_selector(get_selector("uniform"))  # over the whole image now, no budget_scope=crop needed
    uniform = get_selector("uniform")
    assert vlm.answer([item], uniform, 28)[0].kept == [16 * tile + cell for tile in range(7) for cell in (0, 2, 8, 10)]
    for budget in (1, 5, 30, item.num_visual // 3):
        shares = [budget // grids + (tile < budget % grids) for tile in range(grids)]
        expected = [
            16 * tile + int(cell)
            for tile, share in enumerate(shares)
            if share
            for cell in uniform.select(InputSignals(grid=(4, 4)), share).kept
        ]
        assert vlm.answer([item], uniform, budget)[0].kept_stages == [expected]
        crop_scoped = selector_from_strings("uniform", ["budget_scope=crop"])
        assert vlm.answer([item], crop_scoped, budget)[0].kept_stages == [expected]

    recorder = RecordingLayerSelector(layer=1, keep=8)
    vlm.answer([item], recorder, 8)
    assert recorder.records[0].grid_parts == ((4, 4),) * grids
    [answer] = vlm.answer([item], get_selector("e2s"), item.num_visual // 2)
    assert answer.kept_stages and len(answer.kept_stages[-1]) < item.num_visual
    scores = torch.rand(item.num_visual, generator=torch.Generator().manual_seed(0))
    blocks = scores.view(grids, 2, 2, 2, 2).permute(0, 1, 3, 2, 4).reshape(grids, 4, 4)  # tile, block, cell
    best = blocks.argmax(dim=-1)  # (tile, block) -> cell (r, c) within the 2 x 2 block
    block_r, block_c = torch.arange(4) // 2, torch.arange(4) % 2
    expected = torch.zeros(item.num_visual)
    for tile in range(grids):
        for block in range(4):
            r, c = 2 * block_r[block] + best[tile, block] // 2, 2 * block_c[block] + best[tile, block] % 2
            expected[16 * tile + 4 * r + c] = 1
    bonus = novelty_bonus(torch.arange(item.num_visual), recorder.records[0].grid_parts, scores, cells=2)
    assert torch.equal(bonus, expected)


def test_internvl_pool_and_tome_merge_within_each_tile_through_the_projector(tmp_path):
    """Pool and ToMe merge within each tile's and the thumbnail's 4 x 4 grid (64-px tiles of 8-px patches). By hand at
    4 per grid (28 over 7): pool's windows are each tile's four 2 x 2 blocks, its tokens the means of the tower's
    pixel-shuffled pre-projector tokens, fed through the stock projector; ToMe's outputs are 4 per tile, each the mean
    of its sources' projected features (size-weighted merging). Each merged token takes the next compact position:
    the pruned logits equal the stock language model fed that row. ``budget_scope=crop`` is refused in one line."""
    from prune_audit.models.kinds import input_kinds
    from prune_audit.pruners.registry import selector_from_strings

    checkpoint = adapter_for("internvl", "test").build_tiny(tmp_path / "model", words=WORDS, image_size=64)
    vlm = load_vlm(checkpoint, device="cpu")
    item = vlm.prepare(random_image(1, (130, 100)), QUESTIONS[0])
    grids = item.pixel_values.shape[0]
    assert grids == 7 and item.num_visual == 16 * grids
    start, end = item.image_span
    blocks = [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    for name in ("pool", "tome"):
        with pytest.raises(PruneAuditError, match="merges tokens") as error:
            vlm.check_selector(selector_from_strings(name, ["budget_scope=crop"]))
        assert "\n" not in str(error.value)
        result, [selection] = vlm.prefill([item], get_selector(name), 4 * grids)
        [output] = vlm._vision([item], frozenset({"vision_features"}))
        tiles = [int(group.min()) // 16 for group in selection.sources]
        assert tiles == sorted(tiles) and tiles == [tile for tile in range(grids) for _ in range(4)]
        assert all(bool((group // 16 == tile).all()) for group, tile in zip(selection.sources, tiles))
        assert torch.equal(torch.cat(selection.sources).sort().values, torch.arange(item.num_visual))
        if name == "pool":
            assert [group.tolist() for group in selection.sources] == [
                [16 * tile + cell for cell in block] for tile in range(grids) for block in blocks
            ]
            means = torch.stack(
                [output.signals["vision_features"][group].float().mean(dim=0) for group in selection.sources]
            )
            torch.testing.assert_close(selection.vision_tokens, means, atol=TOL, rtol=0)
            with torch.no_grad():
                fed = vlm.model.model.multi_modal_projector(means.to(vlm.dtype))
        else:
            fed = torch.stack([output.features[group].float().mean(dim=0) for group in selection.sources])
            torch.testing.assert_close(selection.llm_tokens, fed, atol=TOL, rtol=0)
        row = vlm.input_row(item, output, selection)
        torch.testing.assert_close(
            row.embeddings[start : start + 4 * grids], fed.to(row.embeddings.dtype), atol=TOL, rtol=0
        )
        assert row.kinds.numel() == item.input_ids.numel() - (end - start) + 4 * grids
        kinds = input_kinds(selection.sources, selection.kept)
        assert row.kinds[start : start + 4 * grids].tolist() == kinds  # a one-cell ToMe output keeps its index
        assert torch.equal(row.positions[0], torch.arange(row.kinds.numel()))
        with torch.no_grad():
            stock = vlm.model(inputs_embeds=row.embeddings[None]).logits[0, -1]
        assert (result.logits[0] - stock).abs().max() <= TOL


def test_internvl_one_tile_runs_the_grid_selectors_as_before_tiling(tmp_path):
    """A one-tile InternVL checkpoint is one 4 x 4 grid: uniform keeps what it kept on the whole grid before tiling
    (by hand at 4: cells 0, 2, 8, 10; at other budgets uniform on the (4, 4) grid), E2S's blocks are that grid's, and
    pool and ToMe give what they give on the whole grid's signals (the pre-tiling path)."""
    from prune_audit.models.internvl import build_internvl
    from prune_audit.pruners.signals import InputSignals

    vlm = load_vlm(
        build_internvl(tmp_path / "one", words=WORDS, image_size=56, patch_size=7, text_layers=NUM_LAYERS), device="cpu"
    )
    item = vlm.prepare(random_image(0, (130, 100)), QUESTIONS[0])
    assert item.pixel_values.shape[0] == 1 and item.grid == (4, 4)
    uniform = get_selector("uniform")
    assert vlm.answer([item], uniform, 4)[0].kept == [0, 2, 8, 10]
    for budget in (1, 3, 7, 16):
        expected = uniform.select(InputSignals(grid=(4, 4)), budget).kept.tolist()
        assert vlm.answer([item], uniform, budget)[0].kept_stages == [expected]
    recorder = RecordingLayerSelector(layer=1, keep=8)
    vlm.answer([item], recorder, 8)
    assert recorder.records[0].grid_parts == ((4, 4),)
    assert vlm.answer([item], get_selector("e2s"), 8)[0].kept_stages
    [output] = vlm._vision([item], frozenset({"vision_features"}))
    whole = InputSignals(
        grid=(4, 4), features=output.features.float(), vision_features=output.signals["vision_features"].float()
    )
    for name in ("pool", "tome"):
        _, [selection] = vlm.prefill([item], get_selector(name), 4)
        before = get_selector(name).select(whole, 4)  # by hand for pool: the four 2 x 2 blocks
        assert name == "tome" or [group.tolist() for group in selection.sources] == [
            [0, 1, 4, 5],
            [2, 3, 6, 7],
            [8, 9, 12, 13],
            [10, 11, 14, 15],
        ]
        assert [group.tolist() for group in selection.sources] == [group.tolist() for group in before.sources]
        tokens = selection.vision_tokens if name == "pool" else selection.llm_tokens
        torch.testing.assert_close(tokens, before.vision_tokens if name == "pool" else before.llm_tokens)


def test_class_declarations_say_what_the_loaded_model_runs(family, vlm):
    """``selector_support`` (class-level, no checkpoint) agrees with the loaded model's ``supported_selectors``."""
    support = type(vlm).selector_support()
    assert [name for name, refusal in support.items() if refusal is None] == vlm.supported_selectors()
    for name, refusal in support.items():
        if refusal is not None:
            with pytest.raises(PruneAuditError) as error:
                vlm.check_selector(get_selector(name))
            assert refusal in str(error.value) and "\n" not in refusal


@pytest.mark.parametrize(
    ("document", "heading"),
    [("docs/models.md", "## Selectors per family")],
)
def test_docs_table_lists_what_runs_on_each_family(family, document, heading):
    """The families x selectors table of docs/models.md says what the class-level
    ``selector_support`` says."""
    from pathlib import Path

    from prune_audit.models.selector_support import ON_REQUEST_SIGNALS
    from prune_audit.pruners import selector_class

    text = (Path(__file__).resolve().parents[2] / document).read_text()
    table = text.split(heading, 1)[1].split("\n## ", 1)[0]
    lines = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0]]
    column = header.index(family)  # a registered family without a column fails here
    cells = {cell[0].strip(): cell[column].strip() for cell in lines[1:] if not set(cell[0]) <= {"-"}}
    assert sorted(cells) == list_selectors()
    adapter = adapter_for(family, "test")
    available = adapter.input_signals - ON_REQUEST_SIGNALS
    with_clip = {
        name for name in list_selectors() if adapter.refusal(selector_class(name), adapter.input_signals) is None
    }
    expected = {
        name: "yes"
        if refusal is None
        else "with --clip-text"
        if name in with_clip
        else "with budget_scope=crop"
        if adapter.runs_per_crop(selector_class(name), available)
        else "no"
        for name, refusal in adapter.selector_support().items()
    }
    assert cells == expected


@pytest.mark.parametrize("family_name", family_names())
def test_selectors_command_says_what_runs_on_a_family_without_loading_it(family_name):
    """`selectors --model FAMILY` lists, from the class declarations, what runs and each refusal's reason."""
    import json

    result = runner.invoke(app, ["selectors", "--model", family_name, "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    support = adapter_for(family_name, "test").selector_support()
    assert {name: row["refusal"] for name, row in rows.items()} == support
    assert all(row["runs"] == (row["refusal"] is None) and row["family"] == family_name for row in rows.values())
    per_grid = adapter_for(family_name, "test").per_grid_selectors  # how those run on a several-grid image
    assert {name for name, row in rows.items() if row["runs_as"]} == set(per_grid)
    text = " ".join(runner.invoke(app, ["selectors", "--model", family_name], terminal_width=200).stdout.split())
    for name, refusal in support.items():
        runs = f"runs ({per_grid[name]})" if name in per_grid else "runs"
        assert f"on {family_name}: " + (runs if refusal is None else f"refused: {refusal}") in text


def test_selectors_command_names_the_families_when_model_is_neither_a_folder_nor_a_family(tmp_path):
    result = runner.invoke(app, ["selectors", "--model", str(tmp_path / "nosuch")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "name a model family: " + ", ".join(family_names()) in result.stderr


def test_qwen3_vl_keep_all_needs_its_deepstack_features(tmp_path):
    """The stock-forward equality above is sensitive to deepstack: without it the logits move."""
    path = adapter_for("qwen3_vl", "test").build_tiny(tmp_path / "qwen3", words=WORDS, text_layers=NUM_LAYERS)
    vlm = load_vlm(path, device="cpu")
    item = vlm.prepare(random_image(0), QUESTIONS[0])
    with_deepstack = vlm.prefill([item])[0].logits[0]
    vlm.loop.stack.after_layer = None
    assert (vlm.prefill([item])[0].logits[0] - with_deepstack).abs().max() > 1e-3


def test_shards_resume_visualize_and_intervene(vlm, prepared, checkpoint, workspace, tmp_path):
    """The other commands on every family: 2 shards merged equal one process, a rerun resumes without
    duplicates, ``visualize`` draws a kept set, ``intervene`` re-answers with the kept object cells removed."""
    budget = str(prepared[0].num_visual // 2)
    common = ("--selector", "divprune", "--budget", budget, "--limit", "12")
    whole = tmp_path / "whole"
    assert runner.invoke(app, run_args(workspace, checkpoint, whole, *common)).exit_code == 0
    for index in range(2):
        result = runner.invoke(
            app, run_args(workspace, checkpoint, tmp_path / f"shard{index}", *common, "--shard", f"{index}/2")
        )
        assert result.exit_code == 0, result.output
    merged = tmp_path / "merged"
    assert (
        runner.invoke(
            app, ["merge", str(tmp_path / "shard0"), str(tmp_path / "shard1"), "--out", str(merged)]
        ).exit_code
        == 0
    )

    def records(run_dir):
        frame = pq.read_table(run_dir / "records.parquet").to_pandas()
        return frame.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)

    assert records(merged).equals(records(whole))
    assert runner.invoke(app, run_args(workspace, checkpoint, whole, *common)).exit_code == 0
    assert records(whole).equals(records(merged))

    image = sorted(workspace["images"].iterdir())[0]
    figures = tmp_path / "figures"
    result = runner.invoke(
        app,
        [
            "visualize",
            str(image),
            "--model",
            str(checkpoint),
            "--selector",
            "divprune",
            "--budget",
            budget,
            "--question",
            "Is there a cat in the image?",
            "--out",
            str(figures),
        ],
    )
    assert result.exit_code == 0, result.output
    question_id = int(records(whole)["question_id"][0])
    redraw = ["visualize", "--run", str(whole), "--question-id", str(question_id), "--out", str(figures)]
    result = runner.invoke(app, redraw)
    assert result.exit_code == 0, result.output
    assert {path.name for path in figures.glob("*.png")} == {
        f"tokens-{checkpoint.name}-{budget}.png",
        f"tokens-{records(whole)['split'][0]}-{question_id}.png",
    }

    result = runner.invoke(app, ["intervene", str(whole), "--mode", "remove", "--out", str(tmp_path / "intervene")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "intervene" / "records.parquet").exists()


REAL_PROCESSORS = {
    # the real checkpoints' image-processor settings, without weights
    "qwen3_vl": lambda transformers, **kw: transformers.Qwen2VLImageProcessorPil(
        min_pixels=65536, max_pixels=16777216, patch_size=16, merge_size=2, **kw
    ),
}


def real_geometry(name, processor, size):
    """What the family's ``token_geometry`` computes from these processor settings (no weights to load one)."""
    from prune_audit.data.geometry import qwen_geometry_from_processor

    return qwen_geometry_from_processor(processor, size)


@pytest.mark.parametrize("name", sorted(REAL_PROCESSORS))
@pytest.mark.parametrize("size", [(640, 480), (480, 640), (500, 333), (1000, 667)])
def test_real_size_processors_put_every_pixel_on_its_predicted_token(name, size):
    """At the real checkpoints' sizes (Qwen3-VL's 16-px patches), a token-id image
    through the bicubic processor shows, away from token borders (3 px: bicubic support), the token the
    geometry predicts at every processed pixel (tests/test_geometry.py checks LLaVA and Qwen2.5-VL so)."""
    import transformers
    from test_geometry import (
        IMAGE_BLUE,
        _expected_tokens,
        _processed_pixels,
        _token_id_image,
    )

    processor = REAL_PROCESSORS[name](transformers)
    geometry = real_geometry(name, processor, size)
    pixels = np.rint(_processed_pixels(processor, _token_id_image(geometry))).astype(int)
    assert pixels.shape[1:] == (geometry.processed_height, geometry.processed_width)
    within = (np.arange(geometry.processed_height) % geometry.token_pixels)[:, None]
    across = (np.arange(geometry.processed_width) % geometry.token_pixels)[None, :]
    inner = (within >= 3) & (within < geometry.token_pixels - 3) & (across >= 3) & (across < geometry.token_pixels - 3)
    decoded = pixels[0] + 256 * ((pixels[1] - 20) // 40)
    assert (pixels[2] == IMAGE_BLUE).all()  # no padding in either pipeline
    assert (decoded[inner] == _expected_tokens(geometry)[inner]).all()


# InternVL3's released image processor: 448-px tiles, crop_to_patches, 1 to 12 tiles plus a thumbnail
INTERNVL_SIZES = [(640, 480), (480, 640), (500, 333), (1000, 300), (640, 640), (300, 300)]


@pytest.mark.parametrize("size", INTERNVL_SIZES)
def test_internvl_real_size_processor_puts_every_pixel_on_its_predicted_token(size):
    """At InternVL3's released settings the tile count equals ``GotOcr2ImageProcessor``'s for every aspect ratio (13
    tiles of 256 tokens for 640 x 480: a 4 x 3 canvas and the thumbnail), and a token-id image of each grid through
    the bicubic processor shows, away from token borders, the predicted token in every tile (tiles row-major, each
    tile's tokens row-major, then the thumbnail)."""
    import transformers
    from test_geometry import IMAGE_BLUE
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    from prune_audit.data.multigrid import internvl_geometry
    from prune_audit.data.tiles import tiled_canvas

    processor = transformers.GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1, max_patches=12
    )
    geometry = internvl_geometry(size)
    tiles = processor.get_number_of_image_patches(size[1], size[0])
    assert tiles * 256 == geometry.num_tokens
    assert tiled_canvas(size, (448, 448), 1, 12) == get_optimal_tiled_canvas((size[1], size[0]), (448, 448), 1, 12)
    if size == (640, 480):
        assert tiles == 13 and geometry.num_tokens == 3328
    ys = np.arange(448)
    # 8 px from token borders: the bicubic support is 2 source pixels, up to 2.8 processed px each (640 -> 1792)
    inner_axis = (ys % 28 >= 8) & (ys % 28 < 20)
    inner = inner_axis[:, None] & inner_axis[None, :]
    in_tile = (ys // 28)[:, None] * 16 + (ys // 28)[None, :]  # each tile's tokens row-major
    for first, grid in grid_pieces(geometry):
        index = token_index_map(grid)
        image = np.stack([index % 256, index // 256 * 16 + 8, np.full_like(index, IMAGE_BLUE)], axis=-1)
        crops = processor(images=image.astype(np.uint8), return_tensors="np", do_rescale=False, do_normalize=False)[
            "pixel_values"
        ]
        assert crops.shape == (tiles, 3, 448, 448)
        own = range(tiles - 1, tiles) if first else range(grid.num_tokens // 256)  # the thumbnail is the last crop
        for order, crop in enumerate(own):
            pixels = np.rint(crops[crop]).astype(int)
            decoded = pixels[0] + 256 * ((pixels[1] - 8) // 16)
            assert (pixels[2][inner] == IMAGE_BLUE).all()
            assert (decoded[inner] == (order * 256 + in_tile)[inner]).all()


def test_internvl_tile_grid_choice_equals_the_processors_over_a_sweep():
    """``tiled_canvas`` (re-derived from the rule) picks the processor's ``get_optimal_tiled_canvas`` grid for
    every size of a sweep of aspect ratios and areas, at 1 to 12 tiles and the tiny checkpoint's 6."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    from prune_audit.data.tiles import tiled_canvas

    sides = [28, 100, 224, 300, 333, 448, 480, 500, 640, 672, 896, 1000, 1344, 2000, 4000]
    for width in sides:
        for height in sides:
            for tile, max_tiles in (((448, 448), 12), ((32, 32), 6), ((448, 448), 1)):
                assert tiled_canvas((width, height), tile, 1, max_tiles) == get_optimal_tiled_canvas(
                    (height, width), tile, 1, max_tiles
                ), (width, height, max_tiles)


def test_internvl_grid_order_among_equal_tile_counts_never_decides_with_one_tile_minimum():
    """``tiled_canvas``'s docstring: the official code visits grids of one tile count in set order, transformers
    with fewer columns first; with ``min_tiles`` 1 the ratio halfway between two such grids always has a strictly
    closer grid, so the order never decides (exact fractions, up to 40 tiles)."""
    from fractions import Fraction

    for max_tiles in range(1, 41):
        grids = [
            (cols, rows)
            for cols in range(1, max_tiles + 1)
            for rows in range(1, max_tiles + 1)
            if cols * rows <= max_tiles
        ]
        ratios = [Fraction(cols, rows) for cols, rows in grids]
        for (a_cols, a_rows), (b_cols, b_rows) in ((a, b) for a in grids for b in grids if a[0] * a[1] == b[0] * b[1]):
            a, b = Fraction(a_cols, a_rows), Fraction(b_cols, b_rows)
            if a < b:
                assert any(abs((a + b) / 2 - ratio) < (b - a) / 2 for ratio in ratios), (max_tiles, a, b)


def test_internvl_real_size_coco_masks_sum_back_per_grid(shared_data):
    """At InternVL3's released tiling, every object mask of a real COCO image sums back over the tiles' tokens and
    over the thumbnail's (every pixel lies on one token of each): retention divides by twice the mask area."""
    from prune_audit.data.multigrid import internvl_geometry
    from prune_audit.data.retention import object_area

    coco_dir = shared_data / "coco" / "tiny_coco_val2017"
    coco = CocoInstances.load(coco_dir / "instances_val2017.json")
    image_id = next(i for i in sorted(coco.images) if coco.object_names(i))
    geometry = internvl_geometry(coco.image(image_id).size)
    assert len(grid_pieces(geometry)) == 2
    for name in coco.object_names(image_id):
        mask = coco.category_mask(image_id, name)
        area = object_area(mask, geometry)
        tiles = geometry.grids[0].num_tokens
        assert area.area_per_token[:tiles].sum() == mask.sum() == area.area_per_token[tiles:].sum()
        assert area.counted_area == 2 * mask.sum() and area.visible_fraction == 1.0


def test_analytic_flops_equal_the_counted_flops(family, checkpoint, prepared):
    """The family's declared ``shape`` gives the compute accounting the FLOPs ``FlopCounterMode`` counts over
    the same eager forward (tests/test_compute.py holds every selector to it on LLaVA and Qwen2.5-VL)."""
    from test_compute import counted, eager

    vlm = eager(load_vlm(checkpoint, device="cpu"))
    item = prepared[0]
    for name in (None, "divprune", "fastv"):
        selector = None if name is None else get_selector(name)
        outside, _, answer = counted(vlm, item, selector, None if name is None else item.num_visual // 2)
        assert outside == answer.cost.flops_vision + answer.cost.flops_llm, name


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


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (500, 333), (2000, 1500)])
def test_llava_onevision_real_size_processor_puts_every_pixel_on_its_predicted_token(size):
    """At llava-onevision's 384-px SigLIP crops (27 patches of 14 px, the last 6 px unseen) and anyres_max_9: the
    token count equals the processor's rule (2000 x 1500 is downsampled), and a token-id image of each grid
    through the bicubic processor shows, away from token borders, the predicted token on the base crop and on
    the seen part of the joined, unpadded tiles; padding pixels lie where the geometry puts no image."""
    from types import SimpleNamespace

    import transformers
    from test_geometry import IMAGE_BLUE

    from prune_audit.data.multigrid import anyres_layout, onevision_geometry

    processor = transformers.LlavaOnevisionImageProcessorPil()  # the llava-hf OneVision defaults: 384 px, 36 canvases
    pinpoints = processor.image_grid_pinpoints
    geometry = onevision_geometry(size, pinpoints=pinpoints)
    base, tiles = geometry.grids
    stock = SimpleNamespace(image_processor=processor, num_image_tokens=729, vision_aspect_ratio="anyres_max_9")
    stock._get_unpadded_features = lambda *a: transformers.LlavaOnevisionProcessor._get_unpadded_features(stock, *a)
    count = transformers.LlavaOnevisionProcessor._get_number_of_features(stock, size[1], size[0], 384, 384)
    assert count == geometry.num_tokens + tiles.grid[0]
    assert (tiles.mode == "anyres_tiles_downsampled") == (size == (2000, 1500))
    if tiles.mode == "anyres_tiles_downsampled":
        return  # the bilinear resize happens in the model: no processed pixel shows a downsampled token
    layout = anyres_layout(size, pinpoints, 384, 14)
    tile_rows, tile_cols = layout.canvas[0] // 384, layout.canvas[1] // 384
    for grid in (base, tiles):
        index = token_index_map(grid)
        image = np.stack([index % 256, index // 256 * 16 + 8, np.full_like(index, IMAGE_BLUE)], axis=-1)
        crops = processor(images=image.astype(np.uint8), return_tensors="np", do_rescale=False, do_normalize=False)[
            "pixel_values"
        ][0]
        if grid is base:
            seen, canvas_y, canvas_x = crops[0][:, :378, :378], np.arange(378), np.arange(378)
            inside_y = inside_x = np.ones(378, dtype=bool)
            expected = (canvas_y // 14)[:, None] * 27 + (canvas_x // 14)[None, :]
        else:  # each tile's seen 378 px, joined, then the unpadded window
            joined = crops[1:].reshape(tile_rows, tile_cols, 3, 384, 384)[..., :378, :378].transpose(2, 0, 3, 1, 4)
            joined = joined.reshape(3, tile_rows * 378, tile_cols * 378)
            top, left = layout.cut[0] * 14, layout.cut[1] * 14
            rows, cols = grid.grid
            seen = joined[:, top : top + rows * 14, left : left + cols * 14]
            seen_y, seen_x = np.arange(top, top + rows * 14), np.arange(left, left + cols * 14)
            canvas_y, canvas_x = seen_y // 378 * 384 + seen_y % 378, seen_x // 378 * 384 + seen_x % 378
            inside_y = (canvas_y + 0.5 >= layout.paste[1] + 3) & (
                canvas_y + 0.5 <= layout.paste[1] + layout.resized[1] - 3
            )
            inside_x = (canvas_x + 0.5 >= layout.paste[0] + 3) & (
                canvas_x + 0.5 <= layout.paste[0] + layout.resized[0] - 3
            )
            outside_y = (canvas_y + 0.5 < layout.paste[1] - 3) | (
                canvas_y + 0.5 > layout.paste[1] + layout.resized[1] + 3
            )
            outside_x = (canvas_x + 0.5 < layout.paste[0] - 3) | (
                canvas_x + 0.5 > layout.paste[0] + layout.resized[0] + 3
            )
            assert (np.rint(seen[2])[outside_y[:, None] | outside_x[None, :]] == 0).all()  # zero padding
            expected = (np.arange(rows * 14) // 14)[:, None] * cols + (np.arange(cols * 14) // 14)[None, :]
        pixels = np.rint(seen).astype(int)
        ys, xs = np.arange(pixels.shape[1]), np.arange(pixels.shape[2])
        inner = ((ys % 14 >= 3) & (ys % 14 < 11))[:, None] & ((xs % 14 >= 3) & (xs % 14 < 11))[None, :]
        shown = inner & inside_y[:, None] & inside_x[None, :]
        decoded = pixels[0] + 256 * ((pixels[1] - 8) // 16)
        assert shown.any() and (pixels[2][shown] == IMAGE_BLUE).all()
        assert (decoded[shown] == expected[shown]).all()


def test_multi_grid_geometries_survive_the_records_json():
    """A record's ``geometry`` column (JSON of ``to_dict``) reads back to the same geometry (``visualize --run``)."""
    import json

    from prune_audit.data.multigrid import (
        anyres_geometry,
        geometry_from_dict,
        internvl_geometry,
        onevision_geometry,
    )

    for geometry in (
        anyres_geometry((640, 480), pinpoints=LLAVA_NEXT_PINPOINTS),
        onevision_geometry((2000, 1500), pinpoints=[[384, 768], [768, 768], [1152, 1152]]),
        internvl_geometry((640, 480)),
    ):
        again = geometry_from_dict(json.loads(json.dumps(geometry.to_dict())))
        assert again == geometry and (token_footprints(again) == token_footprints(geometry)).all()


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


def test_llava_onevision_refuses_cls_selectors_in_one_line(tmp_path):
    """SigLIP has no CLS token: the CLS-attention selectors are refused on LLaVA-OneVision, naming the reason."""
    vlm = load_vlm(
        adapter_for("llava_onevision", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"]), device="cpu"
    )
    for name in ("cls_attn", "vispruner", "scope", "visionzip"):
        with pytest.raises(PruneAuditError) as error:
            vlm.check_selector(get_selector(name))
        assert "no CLS token" in str(error.value) and "\n" not in str(error.value)


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


def test_per_crop_budget_is_refused_in_one_line_on_one_crop_families(tmp_path):
    from prune_audit.pruners.registry import selector_from_strings

    vlm = load_vlm(adapter_for("llava", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"]), device="cpu")
    with pytest.raises(PruneAuditError) as error:
        vlm.check_selector(selector_from_strings("divprune", ["budget_scope=crop"]))
    assert "one crop" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(PruneAuditError, match="one crop"):  # VScan, the in-LLM selector with the option
        vlm.check_selector(selector_from_strings("vscan", ["budget_scope=crop"]))


def test_budget_scope_through_run_and_visualize(family, vlm, checkpoint, prepared, workspace, tmp_path):
    """``--option budget_scope=crop``: the crops partition the visual tokens (LLaVA-OneVision's resized tile grid
    included), the option is recorded in the manifest, the records' kept sets stay within the budget; one line and
    exit 2 on one-crop families, before anything is written."""
    import json

    for item in prepared:
        crops = vlm.crop_tokens(item)
        assert torch.equal(torch.cat([tokens for tokens, _ in crops]).sort().values, torch.arange(item.num_visual))
        assert all(rows * cols == tokens.numel() for tokens, (rows, cols) in crops)
        assert len(crops) > 2 if vlm.several_crops else len(crops) == 1

    out = tmp_path / "crop"
    budget = str(prepared[0].num_visual // 3)
    args = run_args(
        workspace, checkpoint, out, "--selector", "divprune", "--budget", budget, "--option", "budget_scope=crop"
    )
    result = runner.invoke(app, args)
    if not vlm.several_crops:
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
        assert "one crop" in result.stderr and not out.exists()
        return
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["selector"]["options"]["budget_scope"] == "crop"
    kept = pq.read_table(out / "records.parquet").column("kept").to_pylist()
    assert kept and all(0 < len(tokens) <= int(budget) for tokens in kept)
    if family == "llava_next":  # VisionZip per crop: its contextual tokens' sources are recorded and count
        result = runner.invoke(
            app,
            run_args(
                workspace,
                checkpoint,
                tmp_path / "zip",
                "--selector",
                "visionzip",
                "--budget",
                budget,
                "--option",
                "budget_scope=crop",
            ),
        )
        assert result.exit_code == 0, result.output
        records = pq.read_table(tmp_path / "zip" / "records.parquet").to_pandas()
        assert all(len(merged[0]) for merged in records["merged_stages"])
        assert (records["visual_tokens_avg"] <= int(budget)).all()
    image = sorted(workspace["images"].iterdir())[0]
    result = runner.invoke(
        app,
        [
            "visualize",
            str(image),
            "--model",
            str(checkpoint),
            "--selector",
            "divprune",
            "--option",
            "budget_scope=crop",
            "--budget",
            budget,
            "--question",
            "Is there a cat in the image?",
            "--out",
            str(tmp_path / "figure.png"),
        ],
    )
    assert result.exit_code == 0, result.output


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


@pytest.mark.parametrize("family_name", ["llava_next", "llava_onevision"])
def test_uniform_runs_per_grid_on_multi_grid_families(family_name, tmp_path):
    """Uniform needs only the grid layout: on the base view's grid and on the tile grid (LLaVA-OneVision's after its
    bilinear resize), each with its share of the budget in proportion to its tokens; with ``budget_scope=crop``
    each crop's grid an even share. Re-derived here: the grids from the tower's patch side and the processor's
    layout, the largest-remainder split by hand, uniform on each grid alone."""
    from prune_audit.data.multigrid import anyres_layout
    from prune_audit.pruners.crop_scope import crop_budgets
    from prune_audit.pruners.registry import selector_from_strings
    from prune_audit.pruners.signals import InputSignals

    vlm = load_vlm(adapter_for(family_name, "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"]), device="cpu")
    config = vlm.model.config.vision_config
    side = config.image_size // config.patch_size
    uniform = get_selector("uniform")
    for seed, size in enumerate(SIZES):
        item = vlm.prepare(random_image(seed, size), QUESTIONS[0])
        tiles = anyres_layout(size, vlm.model.config.image_grid_pinpoints, config.image_size, config.patch_size).grid
        if "tile_grid" in item.extras:  # LLaVA-OneVision: anyres_max resized the tile grid
            tiles = tuple(item.extras["tile_grid"][2:].tolist())
        assert side * side + tiles[0] * tiles[1] == item.num_visual
        for budget in (1, 7, item.num_visual // 3):
            exact = [budget * side * side / item.num_visual, budget * tiles[0] * tiles[1] / item.num_visual]
            shares = [int(share) for share in exact]
            if sum(shares) < budget:  # one leftover token at most with two grids: to the larger fraction
                shares[int(exact[1] - shares[1] > exact[0] - shares[0])] += 1
            base_kept = uniform.select(InputSignals(grid=(side, side)), shares[0]).kept if shares[0] else []
            tile_kept = uniform.select(InputSignals(grid=tiles), shares[1]).kept if shares[1] else []
            expected = [int(i) for i in base_kept] + [side * side + int(i) for i in tile_kept]
            assert vlm.answer([item], uniform, budget)[0].kept_stages == [expected]
        crop_scoped = selector_from_strings("uniform", ["budget_scope=crop"])
        budget = item.num_visual // 3
        crops = vlm.crop_tokens(item)
        expected = sorted(
            int(tokens[i])
            for (tokens, grid), share in zip(crops, crop_budgets(budget, [tokens.numel() for tokens, _ in crops]))
            for i in uniform.select(InputSignals(grid=grid), share).kept
        )
        assert vlm.answer([item], crop_scoped, budget)[0].kept_stages == [expected]


def test_e2s_sees_the_base_view_and_tile_grids_on_llava_next(tmp_path):
    """E2S's novelty blocks lie on each regular grid: the in-LLM signals carry the base view's and the tile grid's
    (rows, cols) (``LayerSignals.grid_parts``), and E2S runs there (its novelty bonus is tested by hand in
    tests/test_llm_selectors.py)."""
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


@pytest.mark.parametrize(
    "family_name, name",
    [("llava_next", "pool"), ("llava_next", "downsample"), ("llava_next", "tome"), ("llava_onevision", "tome")],
)
def test_merged_tokens_take_their_first_cells_place_among_the_newlines(family_name, name, tmp_path):
    """Pool, downsample and ToMe merge within each grid; each output token sits at the prompt column of its first cell, every
    newline keeps its column and order, positions are compact; the pruned prefill's logits equal the stock
    language model fed that row's embeddings (with its own default positions)."""
    from prune_audit.models.kinds import TEXT_BEFORE, input_kinds
    from prune_audit.pruners.registry import selector_from_strings

    checkpoint = adapter_for(family_name, "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"])
    vlm = load_vlm(checkpoint, device="cpu")
    with pytest.raises(PruneAuditError, match="merges tokens") as error:  # a crop's share keeps plain tokens
        vlm.check_selector(selector_from_strings(name, ["budget_scope=crop"]))
    assert "\n" not in str(error.value)
    item = vlm.prepare(random_image(1, SIZES[1]), QUESTIONS[0])
    base, _ = item.geometry.grids
    budget = item.num_visual // 3
    result, [selection] = vlm.prefill([item], get_selector(name), budget)
    assert selection.sources is not None and len(selection.sources) <= budget
    assert all(
        bool((group < base.num_tokens).all()) or bool((group >= base.num_tokens).all()) for group in selection.sources
    )
    start, end = item.image_span
    columns = item.extras["visual_columns"].tolist()
    newlines = sorted(set(range(start, end)) - set(columns))
    places = {
        columns[int(group.min())]: kind
        for group, kind in zip(selection.sources, input_kinds(selection.sources, selection.kept))
    }
    places.update(dict.fromkeys(newlines, TEXT_BEFORE))  # newlines are kept like the text before the image
    [output] = vlm._vision([item], vlm.signals_for(get_selector(name)))
    row = vlm.input_row(item, output, selection)
    span = row.kinds[start : start + len(places)].tolist()
    assert span == [places[column] for column in sorted(places)]
    assert row.kinds.numel() == item.input_ids.numel() - (end - start) + len(places)
    assert torch.equal(row.positions[0], torch.arange(row.kinds.numel()))
    with torch.no_grad():
        stock = vlm.model(inputs_embeds=row.embeddings[None]).logits[0, -1]
    assert (result.logits[0] - stock).abs().max() <= TOL
