"""What only InternVL has: the pixel shuffle's 2 x 2 patch blocks, the processor's tiles and thumbnail (the tile
grid choice re-derived and swept, a one-tile checkpoint), uniform, E2S, pool and ToMe on each tile's grid, the
real-size processor and real COCO masks per grid. What every family shares is in
tests/models/test_families_registry.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import (
    QUESTIONS,
    WORDS,
    RecordingLayerSelector,
    assert_batch_equals_one_at_a_time,
    random_image,
    stock_inputs,
)

from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import token_index_map
from prune_audit.data.multigrid import grid_pieces
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.families import adapter_for
from prune_audit.pruners import get_selector

TOL = 1e-5
NUM_LAYERS = 4


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
