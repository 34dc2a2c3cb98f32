"""VTC-Bench's downsampling baseline (issue 41): the resize re-derived from PIL's filter, its grid rule, and
retention through the downsampled geometry.

The reference (Chenfei-Liao/VTC-Bench 983e443e, ``external/DART/lmms-eval/lmms_eval/models/qwen2_vl.py``)
resizes the image to ``(W // r, H // r)`` with ``PIL.Image.resize(..., Image.BICUBIC)`` for an integer ratio r;
it has no budget. ``downsample`` resizes the feature grid with that filter: PIL itself on each channel and a
float64 re-derivation of PIL's antialiased bicubic resampling (``Resample.c``: support 2 scaled by the downscale
factor, Keys kernel a = -0.5, weights normalised per output sample, horizontal pass then vertical) must agree.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.geometry import (
    TokenGeometry,
    clip_geometry,
    mapped_to_original,
    mask_area_per_token,
    qwen_geometry,
)
from prune_audit.data.retention import object_area, retention
from prune_audit.models import families, family_names
from prune_audit.pruners import InputSignals, get_selector
from prune_audit.pruners.downsample import integer_ratio_grid

LLAVA_GRID = (24, 24)  # LLaVA-1.5: 336 px / 14 px patches, 576 tokens


def grid_signals(rows: int, cols: int, dim: int = 24, seed: int = 0) -> InputSignals:
    generator = torch.Generator().manual_seed(seed)
    return InputSignals(grid=(rows, cols), vision_features=torch.randn(rows * cols, dim, generator=generator))


def keys_cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    """PIL's bicubic kernel (Keys, a = -0.5)."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def pil_weights(size_in: int, size_out: int) -> np.ndarray:
    """(size_out, size_in) float64 weights of PIL's antialiased bicubic resampling along one axis."""
    scale = size_in / size_out
    filter_scale = max(scale, 1.0)
    support = 2.0 * filter_scale
    weights = np.zeros((size_out, size_in))
    for out in range(size_out):
        center = (out + 0.5) * scale
        low = max(int(center - support + 0.5), 0)
        high = min(int(center + support + 0.5), size_in)
        taps = keys_cubic((np.arange(low, high) - center + 0.5) / filter_scale)
        weights[out, low:high] = taps / taps.sum()
    return weights


def rederived(features: torch.Tensor, grid: tuple[int, int], out: tuple[int, int]) -> np.ndarray:
    """(r' c', Dv) float64: each channel resized as PIL resizes an image, in float64."""
    rows, cols = grid
    planes = features.double().numpy().T.reshape(-1, rows, cols)
    resized = pil_weights(rows, out[0]) @ planes @ pil_weights(cols, out[1]).T  # (Dv, r', c')
    return resized.reshape(planes.shape[0], -1).T


def pil_resized(features: torch.Tensor, grid: tuple[int, int], out: tuple[int, int]) -> np.ndarray:
    """(r' c', Dv) float32: ``PIL.Image.resize((c', r'), BICUBIC)`` of each channel as a mode-F image."""
    rows, cols = grid
    planes = features.numpy().T.reshape(-1, rows, cols)
    resized = [np.asarray(Image.fromarray(p, mode="F").resize((out[1], out[0]), Image.BICUBIC)) for p in planes]
    return np.stack(resized).reshape(len(resized), -1).T


# budget -> downsampled grid on 24 x 24: 144 is 12^2 and 64 is 8^2; 192 and 128 are no square, and no integer
# ratio's count (576 / r^2): fit takes the largest square within them, integer the next integer ratio's grid
GRIDS = {
    "fit": {64: (8, 8), 144: (12, 12), 192: (13, 13), 128: (11, 11)},
    "integer": {64: (8, 8), 144: (12, 12), 192: (12, 12), 128: (8, 8)},
}


@pytest.mark.parametrize("factor", ["fit", "integer"])
@pytest.mark.parametrize("budget", [64, 144, 192, 128])
def test_downsample_equals_pil_bicubic_resize_of_each_channel(factor, budget):
    signals = grid_signals(*LLAVA_GRID)
    selection = get_selector("downsample", factor=factor).select(signals, budget)
    out = GRIDS[factor][budget]
    assert selection.vision_tokens.dtype == torch.float32 and selection.vision_tokens.shape == (out[0] * out[1], 24)
    tokens = selection.vision_tokens.double().numpy()
    np.testing.assert_allclose(tokens, rederived(signals.vision_features, LLAVA_GRID, out), atol=1e-5)
    np.testing.assert_allclose(tokens, pil_resized(signals.vision_features, LLAVA_GRID, out), atol=1e-5)
    assert selection.kept.numel() == 0 and len(selection.sources) == out[0] * out[1] <= budget


def test_a_non_square_grid_keeps_its_aspect_ratio():
    signals = grid_signals(16, 24, dim=4)
    selection = get_selector("downsample").select(signals, 96)  # s = sqrt(96 / 384) = 0.5
    np.testing.assert_allclose(
        selection.vision_tokens.double().numpy(), rederived(signals.vision_features, (16, 24), (8, 12)), atol=1e-5
    )
    assert get_selector("downsample", factor="integer").select(signals, 95).vision_tokens.shape[0] == 5 * 8


@pytest.mark.parametrize("ratio", range(1, 25))
def test_integer_ratio_grid_is_clips_patch_grid_of_the_downsampled_image(ratio):
    """On LLaVA-1.5 the image VTC-Bench would feed is 336 // r pixels square: (336 // r) // 14 patches a side."""
    side = (336 // ratio) // 14
    assert integer_ratio_grid(24, 24, max(1, side * side)) == (max(1, side), max(1, side))


def test_sources_are_each_tokens_footprint_and_partition_the_grid():
    selection = get_selector("downsample").select(grid_signals(24, 24, dim=2), 169)  # 13 x 13
    carried = torch.cat(selection.sources)
    assert torch.equal(torch.sort(carried).values, torch.arange(576))
    for token, cells in enumerate(selection.sources):
        rows, cols = cells // 24, cells % 24
        i, j = divmod(token, 13)
        # cell centre (a + 0.5) x 14 px inside the footprint [i, i + 1) x 336 / 13 px of the 182 px image's row i
        assert bool((((rows + 0.5) * 13 / 24).floor() == i).all() and (((cols + 0.5) * 13 / 24).floor() == j).all())
        assert torch.equal(cells, torch.sort(cells).values)


def downsampled_geometry(geometry: TokenGeometry, grid: tuple[int, int]) -> TokenGeometry:
    """The geometry of the image the tower would see at ``grid``: the processed image scaled by grid / original
    grid on each axis, tokens of the same pixel size (a 13 x 13 grid: the 336 px crop resized to 182 px)."""
    sy, sx = grid[0] / geometry.grid_rows, grid[1] / geometry.grid_cols
    t = geometry.token_pixels
    return TokenGeometry(
        mode=geometry.mode,
        image_width=geometry.image_width,
        image_height=geometry.image_height,
        processed_width=grid[1] * t,
        processed_height=grid[0] * t,
        grid_rows=grid[0],
        grid_cols=grid[1],
        token_pixels=t,
        scale_x=geometry.scale_x * sx,
        scale_y=geometry.scale_y * sy,
        offset_x=geometry.offset_x * sx,
        offset_y=geometry.offset_y * sy,
    )


@pytest.mark.parametrize("budget", [64, 144, 192])
def test_retention_goes_through_the_downsampled_geometry(budget):
    """A 504 x 336 image (hf_crop: 84 px cut off each side, one 14 px cell per 14 original pixels) and a
    hand-built mask on whole cells: a 6 x 7-cell rectangle plus a strip in the cropped-away margin.

    Retention through the sources is the share of the mask the downsampled geometry shows (the visible
    fraction: downsampling drops no region). At an integer factor (64: 3 x 3 cells a token, 144: 2 x 2) each
    output token's sources carry exactly the mask pixels the downsampled geometry puts in its footprint; at 169
    tokens (192) the 25.8 px footprints straddle the 14 px cells, each cell goes whole to the token holding its
    centre, and a token's share moves by part of a cell on its borders."""
    geometry = clip_geometry((504, 336), mode="hf_crop")
    assert geometry.grid == LLAVA_GRID and geometry.offset_x == -84
    mask = np.zeros((336, 504), dtype=bool)
    mask[14 * 2 : 14 * 8, 84 + 14 * 5 : 84 + 14 * 12] = True  # cells rows 2..7, cols 5..11
    mask[100:140, 10:50] = True  # outside the crop: no token sees it
    selection = get_selector("downsample").select(grid_signals(*LLAVA_GRID, dim=2), budget)
    out = GRIDS["fit"][budget]
    area = object_area(mask, geometry)
    downsampled = mask_area_per_token(mask, downsampled_geometry(geometry, out))
    through_sources = np.array([area.area_per_token[cells.numpy()].sum() for cells in selection.sources])
    if 24 % out[0] == 0:
        np.testing.assert_array_equal(through_sources, downsampled)
    else:  # only pixels of cells crossing a footprint border can change token, each moving 2 in the L1 distance
        edges = np.arange(25) * out[0] / 24
        crosses = np.floor(edges[:-1]) != np.ceil(edges[1:]) - 1  # per cell row (and column: the grid is square)
        straddling = (crosses[:, None] | crosses[None, :]).flatten()
        moved = np.abs(through_sources - downsampled).sum()
        assert through_sources.sum() == downsampled.sum() and 0 < moved <= 2 * area.area_per_token[straddling].sum()
    kept_share, object_cells, lost = retention(area.area_per_token, area.total_area, selection.covered().numpy())
    assert kept_share == pytest.approx(downsampled.sum() / area.total_area) == pytest.approx(area.visible_fraction)
    assert math.isclose(area.visible_fraction, 42 * 196 / (42 * 196 + 1600)) and not lost and object_cells == 42
    assert np.count_nonzero(downsampled) < object_cells  # fewer, coarser tokens see it


def test_downsample_option_is_validated():
    with pytest.raises(ValueError, match="factor"):
        get_selector("downsample", factor="bilinear")


def test_downsample_demo_run_records_the_footprints_as_merged_tokens(tmp_path):
    """On the LLaVA demo (12 x 12 = 144 tokens), downsample@16 feeds a 4 x 4 grid, each token 3 x 3 cells."""
    out = tmp_path / "downsample"
    result = CliRunner().invoke(
        app, ["run", "--selector", "downsample", "--budget", "16", "--limit", "4", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "records.parquet").to_pylist()
    assert len(records) == 4
    for record in records:
        assert record["kept_stages"] == [[]]
        merged = record["merged_stages"][0]
        assert len(merged) == 16 and all(len(group) == 9 for group in merged)
        assert sorted(c for group in merged for c in group) == list(range(144))
    assert json.loads((out / "manifest.json").read_text())["selector"]["name"] == "downsample"


def test_resized_image_size_follows_vtc_benchs_integer_ratio_and_the_fit_scan():
    """On a family whose processor sets the grid (Qwen): ``(W // r, H // r)`` for the smallest r whose token
    count fits (VTC-Bench), or the largest size of the aspect ratio whose count fits; here one token a started
    10 x 10 block, counted by hand."""

    def tokens_of(size: tuple[int, int]) -> int:
        return math.ceil(size[0] / 10) * math.ceil(size[1] / 10)

    integer, fit = get_selector("downsample", factor="integer"), get_selector("downsample")
    assert integer.resized_image_size((200, 100), 200, tokens_of) == (200, 100)  # keeps all: r = 1
    assert integer.resized_image_size((200, 100), 50, tokens_of) == (100, 50)  # r = 2: 10 x 5 = 50
    assert integer.resized_image_size((200, 100), 49, tokens_of) == (66, 33)  # r = 3: 7 x 4 = 28
    assert fit.resized_image_size((200, 100), 49, tokens_of) == (90, 45)  # 9 x 5 = 45; 91 x 46: 10 x 5
    assert fit.resized_image_size((200, 100), 32, tokens_of) == (80, 40)  # 8 x 4; 81 x 41: 9 x 5
    assert fit.resized_image_size((100, 200), 32, tokens_of) == (40, 80)  # the longer side is the height
    with pytest.raises(ValueError, match="at least 1"):
        fit.resized_image_size((200, 100), 0, tokens_of)


def test_retention_through_the_resized_image_geometry_is_the_hand_count():
    """A 100 x 60 image resized to 50 x 30 before a Qwen processor (28-px tokens, no pixel floor): smart_resize
    gives 56 x 28 processed pixels, one row of two tokens. Mapped back, original column x goes to token
    floor((x + 0.5) * 56 / 100 / 28) = floor((x + 0.5) / 50): columns 0-49 to the left token, 50-99 to the right.
    A mask over columns 40-59 of every row: 10 x 60 pixels in each token."""
    resized = qwen_geometry((50, 30), min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    geometry = mapped_to_original(resized, (100, 60))
    assert (geometry.image_size, geometry.grid, geometry.processed_width) == ((100, 60), (1, 2), 56)
    mask = np.zeros((60, 100), dtype=bool)
    mask[:, 40:60] = True
    area = object_area(mask, geometry)
    np.testing.assert_array_equal(area.area_per_token, [600, 600])
    assert retention(area.area_per_token, area.total_area, [0, 1]) == (1.0, 2, False)  # the run keeps every token
    assert retention(area.area_per_token, area.total_area, [1]) == (0.5, 1, False)


def test_families_that_still_cannot_downsample_say_so_in_one_line():
    """Qwen families resize the image; a family without pre-projector features and no image resizing refuses."""
    supports = {name: families.adapter_for(name, name).selector_support()["downsample"] for name in family_names()}
    assert supports["qwen2_5_vl"] is None and supports["qwen2_vl"] is None and supports["qwen3_vl"] is None
    refused = [reason for reason in supports.values() if reason is not None]
    assert refused and all("\n" not in reason for reason in refused)
