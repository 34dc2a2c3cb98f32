"""Issue 27, third batch: HiPrune (and the methods after it) against independent re-derivations of their official code.

Each re-derivation follows the official code's own steps (its tensors, its masks, its ``topk``) rather than
the library's, on random signals at LLaVA-1.5 shapes (24 x 24 patches, 23 encoder layers run up to the feature
layer); continuous random scores have no exact ties, so ``topk``'s unspecified order among ties never matters.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.pruners import InputSignals, get_selector
from prune_audit.pruners.fidelity import FIDELITY, RANDOM_CASES
from prune_audit.pruners.hiprune import buffer_cells, scaled_vision_layer

GRID, N, LAYERS = (24, 24), 576, 23
SEEDS, BUDGETS = range(10), (64, 128, 192)


def global_attention(seed: int) -> torch.Tensor:
    """(23, 576) per-layer attention received by each patch: a softmax over 577 keys averaged over rows, CLS dropped."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(LAYERS, 16, N + 1, generator=generator) * 2
    return torch.softmax(logits, dim=-1).mean(dim=1)[:, 1:]


def official_hiprune(shallow: torch.Tensor, deep: torch.Tensor, budget: int, alpha: float = 0.1) -> list[int]:
    """HiPrune's ``encode_images`` (Danielement321/HiPrune 6e83a124) for one image, as the official code steps it."""
    deep = deep.clone()[None]
    shallow_num = round(budget * alpha / 5)
    anchors = torch.topk(shallow[None], k=shallow_num, dim=1)[1]
    near = torch.cat([anchors, anchors - 1, anchors + 1, anchors - 24, anchors + 24], dim=1).clamp(0, 575)
    near = torch.unique(near, sorted=False)[None]
    mask = torch.zeros(1, N, dtype=torch.bool)
    mask.scatter_(1, near, 1)
    deep[0] -= mask.int().squeeze()
    registers = torch.topk(deep, k=budget - near.shape[1], dim=1)[1]
    index_mask = torch.zeros(1, N, dtype=torch.bool)
    index_mask.scatter_(1, torch.cat([near, registers], dim=1), True)
    return torch.nonzero(index_mask[0]).flatten().tolist()


def test_hiprune_reproduces_the_official_anchors_buffers_and_registers():
    selector = get_selector("hiprune")
    identical = 0
    for seed in SEEDS:
        attention = global_attention(seed)
        for budget in BUDGETS:
            kept = selector.select(InputSignals(grid=GRID, layer_attention=attention), budget).kept.tolist()
            identical += kept == official_hiprune(attention[8], attention[-1], budget)
            assert len(kept) == budget
    assert identical == len(SEEDS) * len(BUDGETS) == RANDOM_CASES
    assert FIDELITY["hiprune"].agreement_cases == identical


def test_hiprune_scales_the_object_layer_with_the_tower_depth():
    assert scaled_vision_layer(9, 23) == 8  # LLaVA-1.5: attentions[9 - 1]
    assert scaled_vision_layer(9, 3) == 0  # the demo runs 3 layers to its feature layer: round(27 / 23) = 1
    assert scaled_vision_layer(23, 3) == 2 and scaled_vision_layer(1, 46) == 1


def test_hiprune_grid_neighbours_stay_inside_the_grid():
    corner_and_edge = torch.tensor([0, 24 * 5 + 23])
    official = buffer_cells(corner_and_edge, GRID, "official").tolist()
    assert 24 * 5 + 24 in official  # the official +1 of a row's last cell wraps to the next row's first
    assert buffer_cells(corner_and_edge, GRID, "grid").tolist() == [0, 1, 24, 24 * 4 + 23, 24 * 5 + 22, 24 * 5 + 23,
                                                                    24 * 6 + 23]


def test_hiprune_caps_the_anchors_so_buffers_fit_the_budget():
    attention = global_attention(0)
    for budget in (1, 4, 5, 9, 16):
        kept = get_selector("hiprune", alpha=1.0).select(InputSignals(grid=GRID, layer_attention=attention), budget).kept
        assert kept.numel() == budget


@pytest.mark.parametrize("budget", ["16", "64"])
def test_hiprune_runs_on_the_demo(tmp_path, budget):
    out = tmp_path / "hiprune"
    result = CliRunner().invoke(app, ["run", "--selector", "hiprune", "--budget", budget, "--limit", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for record in pq.read_table(out / "records.parquet").to_pylist():
        assert len(record["kept_stages"][0]) == min(int(budget), 144)


def test_hiprune_is_refused_on_qwen_in_one_line(tmp_path):
    result = CliRunner().invoke(
        app, ["run", "--model", "demo-qwen", "--selector", "hiprune", "--budget", "16", "--limit", "1", "--out",
              str(tmp_path / "q")],
    )  # fmt: skip
    assert result.exit_code != 0 and "layer_attention" in result.output and "Traceback" not in result.output
