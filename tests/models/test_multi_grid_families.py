"""What the families with several token grids share (LLaVA-NeXT's and LLaVA-OneVision's base view and tiles,
InternVL's tiles and thumbnail): their geometries survive the records' JSON, uniform runs per grid, merged tokens
take their first cell's place among the newlines. What every family shares is in
tests/models/test_families_registry.py."""

from __future__ import annotations

import pytest
import torch
from test_llava_next import LLAVA_NEXT_PINPOINTS
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.data.geometry import token_footprints
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.families import adapter_for
from prune_audit.pruners import get_selector

TOL = 1e-5
SIZES = [(130, 100), (100, 130)]  # landscape and portrait: non-square grids


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
