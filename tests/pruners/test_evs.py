"""EVS (``pruners.evs``) against an independent re-derivation of vLLM's ``compute_retention_mask``
(vllm-project/vllm ``vllm/multimodal/evs.py``, 094f1178): loops over the clip's tokens, float64 cosines, the kept
set read off a stable descending sort; several seeds, grids, budgets and pruning rates."""

from __future__ import annotations

import math

import pytest
import torch

from prune_audit.pruners import get_selector
from prune_audit.pruners.signals import InputSignals

# (T, h, w, D) clips
GRIDS = [(4, 3, 5, 16), (2, 6, 6, 8), (7, 2, 3, 32), (1, 4, 4, 8)]


def rederived_kept(features: torch.Tensor, grid: tuple[int, int, int], count: int) -> list[int]:
    """vLLM's retention mask, re-derived token by token: the first temporal step scores 255, every later token
    ``1 - cos`` to the token at its (row, col) one step earlier; the ``count`` highest scores, ties to the lower
    index (a stable descending sort)."""
    steps, rows, cols = grid
    per_step = rows * cols
    values = features.double()
    scores = []
    for index in range(steps * per_step):
        if index < per_step:
            scores.append(255.0)
            continue
        now, before = values[index], values[index - per_step]
        cosine = float(now @ before) / max(math.sqrt(float(now @ now) * float(before @ before)), 1e-8)
        scores.append(1.0 - cosine)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(order[:count])


def vllm_count(grid: tuple[int, int, int], rate: float) -> int:
    steps, rows, cols = grid
    return max(rows * cols, int(steps * rows * cols * (1 - rate)))


def clip_signals(grid: tuple[int, int, int], width: int, seed: int) -> InputSignals:
    steps, rows, cols = grid
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(rows * cols, width, generator=generator)
    # each step a noisy copy of the previous one, with a few tokens changed a lot (what EVS looks for)
    features = [base]
    for _ in range(steps - 1):
        step = features[-1] + 0.1 * torch.randn(rows * cols, width, generator=generator)
        moved = torch.randperm(rows * cols, generator=generator)[: max(1, rows * cols // 4)]
        step[moved] = torch.randn(moved.numel(), width, generator=generator)
        features.append(step)
    return InputSignals(grid=(steps * rows, cols), features=torch.cat(features), video_grid=(steps, rows, cols))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.9])
def test_evs_equals_the_rederived_retention_mask(seed, grid, fraction):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    budget = max(1, round(fraction * signals.num_tokens))
    kept = get_selector("evs").select(signals, budget).kept.tolist()
    assert kept == rederived_kept(signals.features, (steps, rows, cols), min(budget, signals.num_tokens))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75, 0.95])
def test_pruning_rate_is_vllms_video_pruning_rate(seed, grid, rate):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    selector = get_selector("evs", pruning_rate=rate)
    kept = selector.select(signals, signals.num_tokens).kept.tolist()  # a budget of every token: vLLM's count
    count = vllm_count((steps, rows, cols), rate)
    assert kept == rederived_kept(signals.features, (steps, rows, cols), count)
    assert set(range(rows * cols)) <= set(kept)  # the first step always survives whole
    capped = selector.select(signals, rows * cols + 1).kept  # the budget caps vLLM's count
    assert capped.numel() == min(count, rows * cols + 1)


@pytest.mark.parametrize("grid", GRIDS)
def test_keep_all_is_dense(grid):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, 0)
    for budget in (signals.num_tokens, signals.num_tokens + 3):
        assert get_selector("evs").select(signals, budget).kept.tolist() == list(range(signals.num_tokens))


def test_a_budget_below_one_step_keeps_the_first_steps_tokens_in_raster_order():
    signals = clip_signals((3, 2, 4), 8, 1)
    assert get_selector("evs").select(signals, 5).kept.tolist() == [0, 1, 2, 3, 4]


def test_a_still_image_or_a_wrong_grid_is_refused():
    signals = clip_signals((3, 2, 4), 8, 1)
    still = InputSignals(grid=signals.grid, features=signals.features)
    with pytest.raises(ValueError, match="video_grid"):
        get_selector("evs").select(still, 5)
    wrong = InputSignals(grid=signals.grid, features=signals.features, video_grid=(2, 2, 4))
    with pytest.raises(ValueError, match="does not hold"):
        get_selector("evs").select(wrong, 5)
    assert signals.subset(torch.arange(4)).video_grid is None  # a subset is no longer the clip


def test_half_precision_features_are_scored_in_float32():
    signals = clip_signals((4, 3, 3), 16, 2)
    half = InputSignals(grid=signals.grid, features=signals.features.half(), video_grid=signals.video_grid)
    upcast = InputSignals(grid=signals.grid, features=signals.features.half().float(), video_grid=signals.video_grid)
    assert torch.equal(get_selector("evs").select(half, 12).kept, get_selector("evs").select(upcast, 12).kept)
