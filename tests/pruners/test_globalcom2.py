"""GlobalCom2 against an independent re-derivation of its official LLaVA-NeXT code, and on a tiny LLaVA-NeXT.

``official_*`` below follow xuyang-liu16/GlobalCom2 (96b2d00b) ``llava/model/llava_arch.py``
(``generate_scale_for_crop_features``, ``compress_thumbnail``, ``compress_crops`` with its mask-based unpadding,
``interpolate_and_split_cls_attn_scores`` and ``select_topk_crop_features``) step by step on each crop's padded
576 patches, numpy where the official code uses numpy; they share no code with the package. Scores stand for the
head-mean CLS logits of the last CLIP layer (``apply_customvit.py``), one row per crop.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import WORDS, random_image
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.data.multigrid import anyres_layout, best_resolution
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.families import adapter_for
from prune_audit.pruners import InputSignals, get_selector
from prune_audit.pruners.registry import selector_from_strings

SIDE = 24  # CLIP-L/14 at 336 px
TILE = 336
PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # llava-v1.6, (height, width)
# (width, height): 2 x 2 canvases cut in rows / columns / not at all, 1 x 3 and 3 x 1 ones cut by 10 and by 1 rows
SIZES = [(640, 480), (480, 640), (672, 672), (700, 320), (320, 700), (1000, 300), (300, 1000)]
CASES = [(seed, fraction) for seed in range(10) for fraction in (4, 8, 16)]  # budget N // fraction


def official_scales(base: np.ndarray, num_patch_width: int, num_patch_height: int, base_scale: float) -> list[float]:
    """``generate_scale_for_crop_features`` (temperature 10): per-crop sums over an even split of the thumbnail."""
    side = int(base.shape[0] ** 0.5)
    patch_width, patch_height = max(side // num_patch_width, 1), max(side // num_patch_height, 1)
    sums = np.zeros(num_patch_width * num_patch_height)
    for index, score in enumerate(base):
        i, j = divmod(index, side)
        sums[
            min(i // patch_height, num_patch_height - 1) * num_patch_width + min(j // patch_width, num_patch_width - 1)
        ] += float(score)
    exp = np.exp((sums - np.max(sums)) / 10.0)
    soft = exp / (np.sum(exp) + 1e-8)
    return np.clip(base_scale * (1 + soft - np.mean(soft)), None, 1.0).tolist()


def official_mask(image_size, num_patch_width: int, num_patch_height: int) -> torch.Tensor:
    """(H, W) valid patches of the joined padded grid, as ``compress_crops`` computes them (``int`` of the side)."""
    width, height = image_size
    current_height, current_width = num_patch_height * SIDE, num_patch_width * SIDE
    mask = torch.zeros(current_height, current_width, dtype=torch.bool)
    if width / height > current_width / current_height:
        padding = (current_height - int(height * (current_width / width))) // 2
        mask[padding : current_height - padding, :] = True
    else:
        padding = (current_width - int(width * (current_height / height))) // 2
        mask[:, padding : current_width - padding] = True
    return mask


def official_crop_ranking(scores: torch.Tensor, image_size, grid_shape) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per crop the ``compress_crops`` combined scores of its valid patches, and the (K, 576) valid mask."""
    num_patch_width, num_patch_height = grid_shape
    mask = official_mask(image_size, num_patch_width, num_patch_height)
    rows, cols = torch.nonzero(mask.any(dim=1)).flatten(), torch.nonzero(mask.any(dim=0)).flatten()
    cur_height, cur_width = int(rows[-1] - rows[0] + 1), int(cols[-1] - cols[0] + 1)
    crop_mask = mask.view(num_patch_height, SIDE, num_patch_width, SIDE).permute(0, 2, 1, 3).reshape(-1, SIDE, SIDE)
    dimensions = []
    for crop in crop_mask:
        found = torch.nonzero(crop)
        dimensions.append((0, 0) if found.numel() == 0 else (int(found[:, 1].max() - found[:, 1].min() + 1),
                                                               int(found[:, 0].max() - found[:, 0].min() + 1)))  # fmt: skip
    resized = F.interpolate(scores[0].view(1, 1, SIDE, SIDE), size=(cur_height, cur_width), mode="bilinear",
                            align_corners=False).squeeze()  # fmt: skip
    global_parts, top = [], 0
    for i in range(num_patch_height):
        left = 0
        for j in range(num_patch_width):
            width, height = dimensions[i * num_patch_width + j]
            global_parts.append(resized[top : top + height, left : left + width].flatten())
            left += width
        top += dimensions[i * num_patch_width][1]
    valid = crop_mask.reshape(-1, SIDE * SIDE)
    combined = []
    for crop, global_scores in enumerate(global_parts):
        local = scores[1 + crop][valid[crop]]
        combined.append(F.normalize(local[None], p=2, dim=-1)[0] + F.normalize(global_scores[None], p=2, dim=-1)[0])
    return combined, valid


def official_compress(scores: torch.Tensor, image_size, grid_shape, ratio: float, counts=None):
    """``compress_thumbnail`` and ``compress_crops``: per part (thumbnail, then crops) its count and kept
    patches, crop patches as (crop, patch) pairs; ``counts`` replaces the official counts (the budget mode)."""
    combined, valid = official_crop_ranking(scores, image_size, grid_shape)
    scales = official_scales(scores[0].numpy().astype(np.float64), *grid_shape, ratio)
    own = [int(SIDE * SIDE * ratio)] + [int(part.numel() * scale) for part, scale in zip(combined, scales)]
    counts = own if counts is None else counts
    kept = [{(0, int(p)) for p in torch.argsort(scores[0], descending=True)[: counts[0]]}]
    for crop, part in enumerate(combined):
        patches = torch.nonzero(valid[crop]).flatten()
        kept.append({(1 + crop, int(patches[i])) for i in torch.topk(part, counts[1 + crop]).indices})
    return counts, kept


def case(seed: int, image_size):
    """Per-crop scores (1 + K, 576) with a smooth thumbnail bump growing with the seed (tile weights from nearly
    even to one tile taking most), the project's signals on the unpadded tokens, and the (crop, patch) of each image
    token."""
    generator = torch.Generator().manual_seed(seed)
    height, width = best_resolution(image_size, PINPOINTS)
    grid_shape = (width // TILE, height // TILE)
    layout = anyres_layout(image_size, PINPOINTS, TILE, 14)
    crops = 1 + grid_shape[0] * grid_shape[1]
    scores = torch.randn(crops, SIDE * SIDE, generator=generator) * 2.0
    centre = torch.rand(2, generator=generator) * SIDE
    rows, cols = torch.meshgrid(torch.arange(SIDE), torch.arange(SIDE), indexing="ij")
    bump = 0.1 * (1 + seed) * torch.exp(-((rows - centre[0]) ** 2 + (cols - centre[1]) ** 2) / 40.0)
    scores[0] += bump.flatten()
    joined_rows = torch.arange(layout.grid[0])[:, None] + layout.cut[0]
    joined_cols = torch.arange(layout.grid[1])[None, :] + layout.cut[1]
    tile_crop = 1 + (joined_rows // SIDE) * grid_shape[0] + joined_cols // SIDE
    tile_patch = (joined_rows % SIDE) * SIDE + joined_cols % SIDE
    owner = [(0, p) for p in range(SIDE * SIDE)] + list(
        zip(tile_crop.flatten().tolist(), tile_patch.flatten().tolist())
    )
    logits = torch.stack([scores[c, p] for c, p in owner])
    canvas = (height // TILE, width // TILE)
    signals = InputSignals(
        grid=(1, len(owner)),
        last_cls_logits=logits,
        crop_layout=torch.tensor([[SIDE, SIDE], list(layout.grid), list(canvas), list(layout.cut)]),
    )
    return scores, grid_shape, signals, owner


def project_parts(selector, signals, budget, owner):
    """Per part the selector's count and kept (crop, patch) pairs."""
    parts = selector.allocate(signals, budget)
    counts = [count for _, _, count in parts]
    kept = selector.select(signals, budget).kept.tolist()
    per_part = [set() for _ in parts]
    for token in kept:
        per_part[owner[token][0]].add(owner[token])
    return counts, per_part


@pytest.mark.parametrize(("seed", "fraction"), CASES)
def test_reference_allocation_reproduces_the_official_counts_and_kept_sets(seed, fraction):
    size = SIZES[seed % len(SIZES)]
    scores, grid_shape, signals, owner = case(seed, size)
    budget = signals.num_tokens // fraction
    selector = get_selector("globalcom2", allocation="reference")
    counts, kept = project_parts(selector, signals, budget, owner)
    official_counts, official_kept = official_compress(scores, size, grid_shape, budget / signals.num_tokens)
    assert counts == official_counts
    assert kept == official_kept
    assert len(set(official_counts[1:])) > 1  # the thumbnail's guidance gives the crops different shares


@pytest.mark.parametrize(("seed", "fraction"), CASES)
def test_budget_allocation_keeps_the_budget_with_the_official_ranking(seed, fraction):
    size = SIZES[seed % len(SIZES)]
    scores, grid_shape, signals, owner = case(seed, size)
    budget = signals.num_tokens // fraction
    selector = get_selector("globalcom2")
    counts, kept = project_parts(selector, signals, budget, owner)
    assert sum(counts) == budget and selector.select(signals, budget).kept.numel() == budget
    _, official_kept = official_compress(scores, size, grid_shape, 0.25, counts=counts)
    assert kept == official_kept
    # the counts are the official targets at one ratio, rounded: found here by bisection on the official scales
    combined, _ = official_crop_ranking(scores, size, grid_shape)
    sizes = [SIDE * SIDE] + [part.numel() for part in combined]

    def targets(ratio):
        scales = official_scales(scores[0].numpy().astype(np.float64), *grid_shape, ratio)
        return [sizes[0] * min(1.0, ratio)] + [n * s for n, s in zip(sizes[1:], scales)]

    low, high = 0.0, 4.0
    for _ in range(100):
        low, high = ((low + high) / 2, high) if sum(targets((low + high) / 2)) < budget else (low, (low + high) / 2)
    for count, target in zip(counts, targets(high)):
        assert math.floor(target) <= count <= math.ceil(target)


def test_thumbnail_weights_favour_the_tile_under_the_bump():
    """A thumbnail attending to one quadrant gives that tile of a 2 x 2 canvas the most tokens."""
    logits = torch.zeros(16 + 64)
    logits[:16].view(4, 4)[2:, :2] = 30.0  # bottom-left quadrant
    signals = InputSignals(
        grid=(1, 80), last_cls_logits=logits, crop_layout=torch.tensor([[4, 4], [8, 8], [2, 2], [0, 0]])
    )
    counts = [count for _, _, count in get_selector("globalcom2").allocate(signals, 20)]
    assert sum(counts) == 20 and counts[3] == max(counts[1:]) and counts[3] > counts[1]


def test_budget_scope_crop_is_refused_and_the_selector_has_no_products():
    with pytest.raises(ValueError, match="budget_scope"):
        selector_from_strings("globalcom2", ["budget_scope=crop"])
    scores, _, signals, _ = case(0, SIZES[0])
    with FlopCounterMode(display=False) as counter:
        get_selector("globalcom2").select(signals, 300)
    assert counter.get_total_flops() == 0 == get_selector("globalcom2").flops(None)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    checkpoint = adapter_for("llava_next", "test").build_tiny(
        tmp_path_factory.mktemp("next") / "model", words=[*WORDS, "Is"], seed=3
    )
    return load_vlm(checkpoint, device="cpu")


def test_the_adapter_gives_each_crops_last_layer_cls_logits_and_the_layout(tiny_next):
    """``last_cls_logits`` against the stock eager tower: per crop, the head mean of the last layer's log CLS
    attention differs from it by one constant (the head-mean log-sum-exp); ``crop_layout`` puts every tile token
    in the crop the adapter's own crop map says."""
    from prune_audit.pruners.globalcom2 import CropLayout

    vlm = tiny_next
    item = vlm.prepare(random_image(1, (130, 100)), "is there a dog?")
    [output] = vlm._vision([item], frozenset({"last_cls_logits", "crop_layout"}))
    tower = vlm.model.model.vision_tower
    tower.set_attn_implementation("eager")
    with torch.no_grad():
        stock = tower(item.pixel_values, output_attentions=True)
    log_rows = stock.attentions[-1][:, :, 0, 1:].log().mean(dim=1)  # (K, P)
    crop_of = vlm._token_crops(item)
    patch_of = item.extras["crop_patches"] % log_rows.shape[1]
    logits = output.signals["last_cls_logits"]
    for crop in torch.unique(crop_of):
        tokens = crop_of == crop
        shift = logits[tokens] - log_rows[crop, patch_of[tokens]]
        torch.testing.assert_close(shift, shift[:1].expand_as(shift), atol=1e-5, rtol=0)
    signals = InputSignals(grid=item.grid, **{name: value.float() for name, value in output.signals.items()})
    layout = CropLayout.of(signals)
    assert torch.equal(1 + layout.tile_of(), crop_of[layout.base_tokens :])


def test_the_tiny_llava_next_keeps_the_budget_and_the_re_derived_sets(tiny_next):
    vlm = tiny_next
    item = vlm.prepare(random_image(2, (130, 100)), "is there a dog?")
    [output] = vlm._vision([item], frozenset({"last_cls_logits", "crop_layout"}))
    signals = InputSignals(grid=item.grid, **{name: value.float() for name, value in output.signals.items()})
    budget = item.num_visual // 4
    expected = get_selector("globalcom2").select(signals, budget).kept.tolist()
    answer = vlm.answer([item], get_selector("globalcom2"), budget)[0]
    assert answer.kept_stages == [expected] and len(expected) == budget
    crops = vlm._token_crops(item)[torch.tensor(expected)]
    assert len(torch.unique(crops)) > 1  # the thumbnail and tiles all keep some


def test_one_crop_families_refuse_it_in_one_line(tmp_path):
    vlm = load_vlm(adapter_for("llava", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"]), device="cpu")
    with pytest.raises(PruneAuditError) as error:
        vlm.check_selector(get_selector("globalcom2"))
    assert "crop_layout" in str(error.value) and "\n" not in str(error.value)


def test_the_analytic_flops_count_the_last_layer_cls_row_as_the_counter_does(tiny_next):
    """``tests/test_compute.py``'s check on LLaVA-NeXT, which its models do not include: the last layer's CLS row
    costs one CLS-row probe per crop, and the selector's own arithmetic is zero, both to the FLOP."""
    from test_compute import counted, eager

    vlm = eager(tiny_next)  # eager attention everywhere, so the counter sees the attention products
    item = vlm.prepare(random_image(1, (130, 100)), "is there a red dog in the image?")
    outside, inside, answer = counted(vlm, item, get_selector("globalcom2"), item.num_visual // 4)
    assert outside == answer.cost.flops_vision + answer.cost.flops_llm and inside == answer.cost.flops_selector == 0
    assert answer.cost.signal_sources == ("vision_cls_row",)
