"""pool: adaptive average pooling of the grid, its window option, per-grid merging and its demo records."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.pruners import InputSignals, get_selector
from prune_audit.pruners.pool import pooled_grid


def grid_signals(rows: int, cols: int, dim: int = 8, seed: int = 0) -> InputSignals:
    generator = torch.Generator().manual_seed(seed)
    return InputSignals(grid=(rows, cols), vision_features=torch.randn(rows * cols, dim, generator=generator))


@pytest.mark.parametrize("grid", [(24, 24), (16, 24), (7, 5)])
@pytest.mark.parametrize("budget", [1, 4, 16, 34, 64, 128])
def test_pool_equals_adaptive_average_pooling(grid, budget):
    signals = grid_signals(*grid)
    rows, cols = grid
    if budget >= rows * cols:
        pytest.skip("the base keeps every token")
    selection = get_selector("pool").select(signals, budget)
    out = pooled_grid(rows, cols, budget)
    expected = F.adaptive_avg_pool2d(signals.vision_features.T.reshape(1, -1, rows, cols), out).flatten(2)[0].T
    assert out[0] * out[1] <= budget and len(selection.sources) == out[0] * out[1]
    assert torch.allclose(selection.vision_tokens, expected, atol=1e-6)
    assert selection.kept.numel() == 0
    assert torch.equal(selection.covered(), torch.arange(rows * cols))  # every cell carried by some token


def test_pool_grid_keeps_the_aspect_ratio_and_fills_the_budget():
    assert pooled_grid(24, 24, 64) == (8, 8) and pooled_grid(24, 24, 128) == (11, 11)
    assert pooled_grid(24, 24, 144) == (12, 12) and pooled_grid(12, 24, 32) == (4, 8)


@pytest.mark.parametrize("budget, k", [(144, 2), (100, 3), (64, 3), (36, 4), (30, 5)])
def test_pool_window_uses_the_smallest_integer_factor_that_fits(budget, k):
    selection = get_selector("pool", grid="window").select(grid_signals(24, 24), budget)
    assert len(selection.sources) == (-(-24 // k)) ** 2
    assert max(s.numel() for s in selection.sources) == k * k  # the last row/column of windows may be partial
    assert torch.equal(torch.sort(torch.cat(selection.sources)).values, torch.arange(576))  # a partition


def test_pool_option_is_validated():
    with pytest.raises(ValueError, match="grid"):
        get_selector("pool", grid="bilinear")


def test_pool_demo_run_records_every_cell_as_merged(tmp_path):
    """On the LLaVA demo (144 tokens), pool@16 feeds 16 merged tokens of 9 cells each: retention 1, nothing lost."""
    out = tmp_path / "pool"
    result = CliRunner().invoke(app, ["run", "--selector", "pool", "--budget", "16", "--limit", "6", "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "records.parquet").to_pylist()
    assert len(records) == 6
    for record in records:
        assert record["kept_stages"] == [[]]
        merged = record["merged_stages"][0]
        assert len(merged) == 16 and sorted(c for group in merged for c in group) == list(range(144))
    assert json.loads((out / "manifest.json").read_text())["selector"]["name"] == "pool"


def test_pool_merges_within_each_grid_by_hand():
    """Tokens 0..3 a 2 x 2 grid, 4..11 a 2 x 4 grid. Budget 3 -> shares 1 and 2: the base grid pools to one
    token of its four cells, the tile grid to 1 x 2 (two 2 x 2 windows). Budget 11 -> shares 4 and 7: the base
    grid is kept whole (one-cell outputs, its own features), the tile grid pools to 1 x 3 with torch's
    overlapping adaptive bins (columns 0-1, 1-2, 2-3)."""
    from prune_audit.pruners.crop_scope import select_per_grid

    features = torch.arange(12, dtype=torch.float32)[:, None] * torch.tensor([[1.0, -1.0]])
    signals = InputSignals(grid=(1, 12), vision_features=features)
    grids = [(torch.arange(4), (2, 2)), (torch.arange(4, 12), (2, 4))]
    pool = get_selector("pool")
    selection = select_per_grid(pool, signals, grids, 3)
    assert [group.tolist() for group in selection.sources] == [[0, 1, 2, 3], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert selection.vision_tokens[:, 0].tolist() == [1.5, 6.5, 8.5] and selection.kept.numel() == 0
    selection = select_per_grid(pool, signals, grids, 11)
    assert [group.tolist() for group in selection.sources] == [
        [0],
        [1],
        [2],
        [3],
        [4, 5, 8, 9],
        [5, 6, 9, 10],
        [6, 7, 10, 11],
    ]
    assert selection.vision_tokens[:, 0].tolist() == [0, 1, 2, 3, 6.5, 7.5, 8.5]
    assert selection.kept.tolist() == [0, 1, 2, 3]
    assert select_per_grid(pool, signals, grids, 12).sources is None  # everything kept: plain tokens
